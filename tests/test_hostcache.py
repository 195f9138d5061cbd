"""The worker's host cache index (worker/hostcache.py) on a real directory:
what it does with an entry it cannot read, and with a write that fails."""

from __future__ import annotations

import os

import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.hostcache import HostCache


def stored(cache: HostCache, key: str, data: bytes = b"executable bytes") -> pb.ArtifactInfo:
    digest = cache.store.put_bytes(data)
    info = pb.ArtifactInfo(key=key, digest=digest, size=len(data), compile_time_seconds=2.5,
                           created_unix=1_700_000_000)
    cache.record("default", info)
    return info


def test_an_entry_reads_back_as_it_was_recorded(tmp_path):
    cache = HostCache(tmp_path, max_bytes=1 << 20)
    info = stored(cache, "k1")
    assert cache.lookup("default", "k1") == info
    assert cache.lookup("other-tenant", "k1") is None  # namespaces never share entries
    assert cache.count() == 1


@pytest.mark.parametrize("junk", [b"", b"{not json", b'{"digest": 5, "nope": 1}', b"[1, 2]"])
def test_an_entry_it_cannot_read_is_a_miss_and_is_forgotten(tmp_path, junk):
    cache = HostCache(tmp_path, max_bytes=1 << 20)
    stored(cache, "k1")
    entry = tmp_path / "keys" / "default" / "k1.json"
    entry.write_bytes(junk)
    assert cache.lookup("default", "k1") is None
    assert not entry.exists()  # the next fetch writes a good one
    assert cache.lookup("default", "k1") is None


def test_an_entry_whose_blob_is_gone_is_a_miss(tmp_path):
    cache = HostCache(tmp_path, max_bytes=1 << 20)
    info = stored(cache, "k1")
    assert cache.store.delete(info.digest)
    assert cache.lookup("default", "k1") is None


def test_a_failed_write_leaves_the_old_entry_and_no_temporary_file(tmp_path, monkeypatch):
    cache = HostCache(tmp_path, max_bytes=1 << 20)
    old = stored(cache, "k1", b"first")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        stored(cache, "k1", b"second")
    monkeypatch.undo()
    assert cache.lookup("default", "k1") == old
    assert [p.name for p in (tmp_path / "keys" / "default").iterdir()] == ["k1.json"]
