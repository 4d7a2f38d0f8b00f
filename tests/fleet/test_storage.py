"""Storage: the local directory and S3 through boto3 against a real S3 API server (moto)."""

from __future__ import annotations

import os

import boto3
import httpx
import pytest

from fleet.settings import Settings
from fleet.storage import LocalStorage, S3Storage, StorageError, storage_from_settings


def test_local_storage(tmp_path):
    store = LocalStorage(tmp_path)
    store.put_bytes("parts/j/000001-1.pcm", b"abc")
    store.put_bytes("parts/j/000001-1.pcm", b"abc")  # idempotent overwrite
    assert store.get_bytes("parts/j/000001-1.pcm") == b"abc" and store.exists("parts/j/000001-1.pcm")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    store.put_file("audio/j.wav", src)
    assert (
        store.local_path("audio/j.wav").read_bytes() == b"x" * 1000
        and store.presigned_url("audio/j.wav") is None
    )
    assert store.delete_prefix("parts/j/") == 1 and not store.exists("parts/j/000001-1.pcm")
    with pytest.raises(StorageError):
        store.get_bytes("missing")
    with pytest.raises(StorageError, match="escapes"):
        store.put_bytes("../outside", b"")


@pytest.fixture
def s3(s3_server, tmp_path):
    settings = Settings(
        data_dir=tmp_path,
        s3_bucket="narration-test",
        s3_endpoint_url=s3_server,
        s3_prefix="books/",
        multipart_threshold=5 * 1024 * 1024,
        multipart_chunksize=5 * 1024 * 1024,
        presign_ttl_s=600,
    )
    store = storage_from_settings(settings)
    assert isinstance(store, S3Storage)
    return store


def test_s3_put_get_prefix_and_delete(s3):
    s3.put_bytes("parts/j/000000-1.pcm", b"\x01\x02")
    s3.put_bytes("parts/j/000001-1.pcm", b"\x03")
    assert s3.get_bytes("parts/j/000000-1.pcm") == b"\x01\x02" and s3.exists("parts/j/000001-1.pcm")
    raw = boto3.client("s3", endpoint_url=s3.client.meta.endpoint_url)
    keys = [
        o["Key"] for o in raw.list_objects_v2(Bucket="narration-test", Prefix="books/parts/j/")["Contents"]
    ]
    assert keys == ["books/parts/j/000000-1.pcm", "books/parts/j/000001-1.pcm"]  # the configured prefix
    assert s3.delete_prefix("parts/j/") == 2 and not s3.exists("parts/j/000000-1.pcm")
    with pytest.raises(StorageError):
        s3.get_bytes("parts/j/000000-1.pcm")


def test_s3_multipart_upload_and_presigned_download(s3, tmp_path):
    big = tmp_path / "book.wav"
    big.write_bytes(os.urandom(12 * 1024 * 1024 + 123))  # 3 parts of 5 MiB at most
    s3.put_file("audio/book.wav", big, "audio/wav")
    head = s3.client.head_object(Bucket="narration-test", Key="books/audio/book.wav")
    assert head["ETag"].strip('"').endswith("-3")  # S3's multipart ETag: md5-of-parts "-" part count
    assert head["ContentType"] == "audio/wav" and head["ContentLength"] == big.stat().st_size

    url = s3.presigned_url("audio/book.wav", filename="My Book.wav")
    assert "X-Amz-Signature=" in url and "X-Amz-Expires=600" in url
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200 and response.content == big.read_bytes()
    assert 'filename="My Book.wav"' in response.headers["content-disposition"]
    out = tmp_path / "copy.wav"
    s3.download("audio/book.wav", out)
    assert out.read_bytes() == big.read_bytes()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_name_prefix_deletes_the_same_objects_locally_and_on_s3(kind, tmp_path, request):
    """``audio/<job>.`` is every output of one job (its file and manifest), never another job's."""
    store = LocalStorage(tmp_path / "local") if kind == "local" else request.getfixturevalue("s3")
    for key in ("audio/j1.wav", "audio/j1.json", "audio/j10.wav", "audio/j2.flac"):
        store.put_bytes(key, b"x")
    assert store.delete_prefix("audio/j1.") == 2
    assert [store.exists(k) for k in ("audio/j1.wav", "audio/j1.json", "audio/j10.wav", "audio/j2.flac")] == [
        False,
        False,
        True,
        True,
    ]


def test_a_folder_deleted_meanwhile_by_another_process_is_no_error(tmp_path, monkeypatch):
    """A job deleted while the finalizer removes its parts: the two remove the same folders at once
    (seen in CI as a FileNotFoundError from the delete)."""
    storage = LocalStorage(tmp_path)
    storage.put_bytes("parts/job/a/000001-1.pcm", b"x")
    storage.put_bytes("parts/job/b/000002-1.pcm", b"y")
    real_scandir, base = os.scandir, str(tmp_path / "parts" / "job")

    def scandir(path="."):
        entries = list(real_scandir(path))
        if str(path) == base:  # listed; then the other process removes a folder under it
            import shutil

            shutil.rmtree(tmp_path / "parts" / "job" / "b")
        return _Entries(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    assert storage.delete_prefix("parts/job/") == 1
    assert not (tmp_path / "parts" / "job").exists()


class _Entries:
    """What os.scandir returns: an iterator and a context manager."""

    def __init__(self, entries) -> None:
        self._it = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass


def test_s3_keys_a_delete_did_not_remove_are_an_error():
    """DeleteObjects answers 200 with the keys it failed on (Quiet): they must not pass for deleted,
    or DELETE and the retention sweep forget a job whose files stay (botocore's Stubber plays S3)."""
    from botocore.stub import ANY, Stubber

    storage = S3Storage(Settings(redis_url="redis://unused", s3_bucket="b", s3_endpoint_url="http://127.0.0.1:9", s3_region="us-east-1"))
    keys = ["tenants/t/audio/J.m4b", "tenants/t/audio/J.json"]
    with Stubber(storage.client) as s3:
        s3.add_response("list_objects_v2", {"Contents": [{"Key": k} for k in keys], "IsTruncated": False}, {"Bucket": "b", "Prefix": "tenants/t/audio/J."})
        s3.add_response(
            "delete_objects",
            {"Errors": [{"Key": keys[0], "Code": "InternalError", "Message": "Please try again."}]},
            {"Bucket": "b", "Delete": ANY},
        )
        with pytest.raises(StorageError, match="1 object.* not deleted: tenants/t/audio/J.m4b: InternalError"):
            storage.delete_prefix("tenants/t/audio/J.")
