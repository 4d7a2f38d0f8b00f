"""Where assembled segments and finished files live: a local directory, or S3 (any S3 API) via boto3.

Writes are whole-object and idempotent (writing a key twice leaves one copy). Large files go up in
parts (boto3's managed transfer: multipart above ``multipart_threshold``). S3 downloads are handed
out as presigned URLs; local files are served by the API itself.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol

from fleet.settings import Settings


class StorageError(RuntimeError):
    pass


class Storage(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def open_read(self, key: str) -> BinaryIO: ...
    def copy(self, src: str, dst: str) -> None: ...
    def download(self, key: str, path: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def local_path(self, key: str) -> Path | None: ...
    def presigned_url(self, key: str, filename: str | None = None) -> str | None: ...


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise StorageError(f"key {key!r} escapes the storage root")
        return path

    def _atomic_write(self, key: str, write) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None:
        with open(path, "rb") as src:
            self._atomic_write(key, lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise StorageError(f"no object {key!r}") from exc

    def open_read(self, key: str) -> BinaryIO:
        """The object as a seekable file (a decoder reads what it needs of a long book)."""
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"no object {key!r}") from exc

    def copy(self, src: str, dst: str) -> None:
        try:
            with open(self._path(src), "rb") as f:
                self._atomic_write(dst, lambda out: shutil.copyfileobj(f, out, 1 << 20))
        except FileNotFoundError as exc:
            raise StorageError(f"no object {src!r}") from exc

    def download(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.exists():
            raise StorageError(f"no object {key!r}")
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete_prefix(self, prefix: str) -> int:
        """Every object whose key starts with ``prefix`` (as on S3): a folder's, or names that begin so."""
        base = self._path(prefix.rstrip("/"))
        if base.is_dir():
            # os.walk, not rglob: another process (the finalizer removing a job's parts while the
            # job is deleted) may remove folders under us, which walk skips and rglob raises on
            count = sum(len(files) for _, _, files in os.walk(base))
            shutil.rmtree(base, ignore_errors=True)
            return count
        count = 0
        if base.parent.is_dir():
            for path in base.parent.iterdir():
                if path.is_file() and path.name.startswith(base.name):
                    path.unlink(missing_ok=True)
                    count += 1
        return count

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.exists() else None

    def presigned_url(self, key: str, filename: str | None = None) -> str | None:
        return None


class S3Storage:
    def __init__(self, settings: Settings) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix.strip("/") + "/" if settings.s3_prefix.strip("/") else ""
        self.ttl = settings.presign_ttl_s
        # credentials: the usual AWS variables / profiles / instance roles, as boto3 finds them
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            config=Config(retries={"max_attempts": 8, "mode": "standard"}, signature_version="s3v4"),
        )
        self.transfer = TransferConfig(
            multipart_threshold=settings.multipart_threshold, multipart_chunksize=settings.multipart_chunksize
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else None
        self.client.upload_file(str(path), self.bucket, self._key(key), ExtraArgs=extra, Config=self.transfer)

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as exc:
            raise StorageError(f"no object {key!r}: {exc}") from exc

    def open_read(self, key: str) -> BinaryIO:
        """The object as a seekable file whose reads are ranged GETs (1 MiB buffered)."""
        from botocore.exceptions import ClientError

        try:
            size = self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except ClientError as exc:
            raise StorageError(f"no object {key!r}: {exc}") from exc
        return io.BufferedReader(_RangedObject(self.client, self.bucket, self._key(key), size), 1 << 20)

    def copy(self, src: str, dst: str) -> None:
        """Server-side (no bytes through this process; managed: multipart above 5 GB)."""
        source = {"Bucket": self.bucket, "Key": self._key(src)}
        self.client.copy(source, self.bucket, self._key(dst), Config=self.transfer)

    def download(self, key: str, path: Path) -> None:
        self.client.download_file(self.bucket, self._key(key), str(path), Config=self.transfer)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError:
            return False

    def delete_prefix(self, prefix: str) -> int:
        count = 0
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
                # a 200 may still list keys S3 did not delete: raise, so the caller's retry (the
                # sweep's next pass, a DELETE again) finds them, rather than forgetting the job
                if failed := answer.get("Errors"):
                    first = failed[0]
                    raise StorageError(
                        f"{len(failed)} object(s) under {prefix!r} not deleted: {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message', '')}".strip()
                    )
                count += len(objects)
        return count

    def local_path(self, key: str) -> Path | None:
        return None

    def presigned_url(self, key: str, filename: str | None = None) -> str | None:
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        if filename:
            params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
        return self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=self.ttl)


class _RangedObject(io.RawIOBase):
    """An S3 object read by ranges: what a seeking reader (PyAV decoding from a chapter) needs, without
    downloading the whole file first. boto3's StreamingBody cannot seek; s3fs would add a dependency
    tree for these few lines."""

    def __init__(self, client, bucket: str, key: str, size: int) -> None:
        self.client, self.bucket, self.key, self.size, self.pos = client, bucket, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        if self.pos >= self.size or not len(buffer):
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-{end}")["Body"]
        data = body.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def storage_from_settings(settings: Settings) -> Storage:
    if settings.s3_bucket:
        return S3Storage(settings)
    return LocalStorage(settings.storage_dir)
