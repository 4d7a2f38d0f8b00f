"""The embedded Valkey: private to its user (a password in a 0600 file, loopback only), one command
per data directory (a lock), and findable by the data directory's other commands while it runs."""

from __future__ import annotations

import stat

import pytest
import redis

from narrate.embedded import DataDirBusy, EmbeddedValkey, running_url


def test_it_requires_its_password_and_keeps_it_private(tmp_path):
    server = EmbeddedValkey(tmp_path)
    url = server.start()
    try:
        port = url.rsplit(":", 1)[1].split("/")[0]
        with (
            redis.Redis(host="127.0.0.1", port=int(port)) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.ping()
        with redis.Redis.from_url(url) as owner:
            assert owner.ping()
        for name in ("password", "valkey.conf", "server.json"):
            assert stat.S_IMODE((tmp_path / "valkey" / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE((tmp_path / "valkey").stat().st_mode) == 0o700
    finally:
        server.stop()


def test_one_command_per_data_directory_and_the_others_find_it(tmp_path):
    first = EmbeddedValkey(tmp_path)
    url = first.start()
    try:
        with pytest.raises(DataDirBusy, match="is in use by narrate"):
            EmbeddedValkey(tmp_path).start()
        assert running_url(tmp_path) == url
    finally:
        first.stop()
    assert running_url(tmp_path) is None
    again = EmbeddedValkey(tmp_path)  # free again once the first has stopped; same password
    assert again.start() == url.replace(url.rsplit(":", 1)[1].split("/")[0], str(again.port))
    again.stop()
