"""The worker's host cache index (worker/daemon/hostcache.py) on a real directory:
what it does with an entry it cannot read, and with a write that fails."""

from __future__ import annotations

import os

import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon.hostcache import HostCache


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


def test_an_entry_swapped_to_another_present_blob_is_refused_and_reported(tmp_path):
    """Someone with write access to the cache directory rewrites k1's entry
    to name k2's blob (valid bytes, present): the digest check alone would
    pass and hand k2's program to whoever asks for k1."""
    import json

    refused = []
    cache = HostCache(tmp_path, max_bytes=1 << 20, on_refused=lambda: refused.append(1))
    stored(cache, "k1", b"program one")
    other = stored(cache, "k2", b"program two")
    entry = tmp_path / "keys" / "default" / "k1.json"
    swapped = json.loads(entry.read_bytes())
    swapped.update(digest=other.digest, size=other.size)
    entry.write_text(json.dumps(swapped))
    assert cache.lookup("default", "k1") is None
    assert refused == [1] and not entry.exists()
    assert cache.lookup("default", "k2") == other  # the other entry is untouched
    # An entry written by hand (no MAC, or another worker's) is refused too.
    del swapped["mac"]
    entry.write_text(json.dumps(swapped))
    assert cache.lookup("default", "k1") is None and refused == [1, 1]


def test_the_signing_secret_survives_a_restart_and_only_the_worker_reads_it(tmp_path):
    info = stored(HostCache(tmp_path, max_bytes=1 << 20), "k1")
    assert HostCache(tmp_path, max_bytes=1 << 20).lookup("default", "k1") == info
    assert (tmp_path / "entry.key").stat().st_mode & 0o777 == 0o600


def test_a_revocation_acts_within_its_tenant(tmp_path):
    """Tenant b purges bytes that tenant a has too: b's entries go, the blob
    stays for a; where a namespace's tenant is unknown, the blob goes."""
    cache = HostCache(tmp_path, max_bytes=1 << 20)
    info = stored(cache, "k", b"shared bytes")  # namespace "default": tenant a's
    cache.record("b-one", info)
    cache.record("b-two", info)
    named = cache.naming({info.digest})
    assert sorted(named) == ["b-one", "b-two", "default"]
    assert cache.revoke({info.digest}, named, mine={"b-one", "b-two"}, others={"default"}) == []
    assert cache.lookup("b-one", "k") is None and cache.lookup("b-two", "k") is None
    assert cache.lookup("default", "k") == info
    cache.record("b-one", info)
    named = cache.naming({info.digest})
    assert cache.revoke({info.digest}, named, mine={"b-one"}, others=set()) == [info.digest]
    assert not cache.store.has(info.digest)
