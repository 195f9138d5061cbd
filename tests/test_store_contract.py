"""The artifact store's rules (compilecast/store.py), held by each of its
implementations: a directory on disk, and a real S3-compatible bucket
(SeaweedFS on loopback) with a disk cache in front of it."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from compilecast.blobstore import DiskBlobStore
from compilecast.errors import CorruptBlob, DigestMismatch, NotFound
from compilecast.store import ArtifactStore, BlobSink


@pytest.fixture(params=["disk", pytest.param("bucket", marks=pytest.mark.slow)])
def store(request, tmp_path) -> ArtifactStore:
    disk = DiskBlobStore(tmp_path / "store")
    if request.param == "disk":
        return disk
    from compilecast.objectstore import Bucket, BucketStore

    s3 = request.getfixturevalue("s3")
    bucket = Bucket(s3.bucket(f"cc-{uuid.uuid4().hex[:12]}"), endpoint=s3.endpoint)
    return BucketStore(disk, bucket)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_store_is_the_interface(store):
    assert isinstance(store, ArtifactStore)
    with store.writer() as w:
        assert isinstance(w, BlobSink)


def test_what_is_committed_reads_back_whole(store):
    data = os.urandom(3 << 20)
    with store.writer() as w:
        w.write(data[:1 << 20])
        w.write(data[1 << 20:])
        assert w.size == len(data)
        w.commit(_digest(data), len(data))
    assert store.has(_digest(data))
    assert store.read_bytes(_digest(data)) == data
    assert b"".join(store.read(_digest(data), offset=5)) == data[5:]
    small = b"a small blob"
    assert store.put_bytes(small) == _digest(small) and store.read_bytes(_digest(small)) == small


def test_nothing_is_readable_without_a_commit(store):
    data = os.urandom(1 << 16)
    with store.writer() as w:
        w.write(data)  # left without a commit
    assert not store.has(_digest(data))
    with pytest.raises(NotFound):
        store.read_bytes(_digest(data))


def test_a_commit_of_bytes_that_are_not_the_digests_is_refused(store):
    data, other = os.urandom(1 << 16), os.urandom(1 << 16)
    with pytest.raises(DigestMismatch), store.writer() as w:
        w.write(data)
        w.commit(_digest(other), len(data))
    assert not store.has(_digest(other)) and not store.has(_digest(data))


def test_bytes_that_changed_in_the_store_are_refused_and_gone(store, tmp_path):
    data = os.urandom(1 << 18)
    digest = store.put_bytes(data)
    if hasattr(store, "bucket"):  # the bucket's object changes; the local copy is gone
        store.local.delete(digest)
        store.bucket.upload(digest, _Bytes(os.urandom(len(data))), len(data))
    else:  # a raw blob's last byte flipped on disk
        disk: DiskBlobStore = store
        disk.reverify_s = 0
        path = disk.path_of(digest)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlob):
        store.read_bytes(digest)
    assert not store.has(digest)


def test_room_and_size_are_the_stores(store):
    before = store.stored_bytes
    store.put_bytes(os.urandom(1 << 16))
    assert store.stored_bytes > before
    assert store.fits(1 << 10) and store.make_room(1 << 10)


class _Bytes:
    """A readable body for Bucket.upload."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def read(self, n: int = -1) -> bytes:
        n = len(self._data) - self._at if n < 0 else n
        out = self._data[self._at:self._at + n]
        self._at += len(out)
        return out
