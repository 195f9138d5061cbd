"""The content-addressed store: atomic writes, verified reads, quarantine, bounds."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading

import pytest

from compilecast.blobstore import DiskBlobStore
from compilecast.errors import CorruptBlob, DigestMismatch, NotFound, StoreFull, TooLarge
from compilecast.streams import Inflate, Sha256
from compilecast.wire import Zstd


def test_roundtrip_is_verified_and_compressed(tmp_path):
    store = DiskBlobStore(tmp_path)
    data = b"abc" * 100_000
    digest = store.put_bytes(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.read_bytes(digest) == data
    assert store.path_of(digest).stat().st_size < len(data) // 10


def test_incompressible_blobs_are_stored_raw_and_still_verified(tmp_path):
    from compilecast.blobstore import RAW_MAGIC

    store = DiskBlobStore(tmp_path)
    data = os.urandom(3 << 20)  # more than the 1 MiB probe, in several writes
    with store.writer() as w:
        for off in range(0, len(data), 700_000):
            w.write(data[off:off + 700_000])
        assert w.stored_raw
        w.commit(hashlib.sha256(data).hexdigest(), len(data))
    digest = hashlib.sha256(data).hexdigest()
    path = store.path_of(digest)
    assert path.read_bytes()[:len(RAW_MAGIC)] == RAW_MAGIC
    assert path.stat().st_size == len(data) + len(RAW_MAGIC)
    assert store.read_bytes(digest) == data
    small = os.urandom(1000)  # decided at commit
    assert store.read_bytes(store.put_bytes(small)) == small
    assert store.path_of(hashlib.sha256(small).hexdigest()).read_bytes()[:8] == RAW_MAGIC
    # A flipped byte in a raw blob is caught like in a compressed one.
    raw = bytearray(path.read_bytes())
    raw[len(RAW_MAGIC) + 12345] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlob):
        store.read_bytes(digest)
    assert store.quarantined == 1 and not store.has(digest)


def test_a_blob_stored_raw_from_its_first_byte_skips_the_probe(tmp_path):
    """store_raw: bytes their sender stored raw are written raw at once,
    readable from the first write (a relay peer or a host process follows
    the file), whatever a probe would say; it must come before any byte."""
    from compilecast.blobstore import RAW_MAGIC

    store = DiskBlobStore(tmp_path)
    data = b"compressible " * 100_000  # a probe would compress this
    with store.writer() as w:
        w.store_raw()
        w.write(data[:1000])
        assert w.readable() == 1000  # not held back for the probe's first MiB
        assert w.path.read_bytes() == RAW_MAGIC + data[:1000]
        w.write(data[1000:])
        w.commit(hashlib.sha256(data).hexdigest(), len(data))
    digest = hashlib.sha256(data).hexdigest()
    assert store.path_of(digest).read_bytes() == RAW_MAGIC + data
    assert store.read_bytes(digest) == data
    with store.writer() as w:
        assert w.readable() is None  # probing: nothing to follow yet
        w.write(b"x")
        with pytest.raises(ValueError):
            w.store_raw()
        w.abort()


def test_wrong_digest_stores_nothing(tmp_path):
    store = DiskBlobStore(tmp_path)
    with pytest.raises(DigestMismatch), store.writer() as w:
        w.write(b"payload")
        w.commit("0" * 64, 7)
    assert store.count() == 0
    assert list(store.tmp_dir.iterdir()) == []


def test_wrong_size_stores_nothing(tmp_path):
    store = DiskBlobStore(tmp_path)
    data = b"payload"
    with pytest.raises(DigestMismatch), store.writer() as w:
        w.write(data)
        w.commit(hashlib.sha256(data).hexdigest(), len(data) + 1)
    assert store.count() == 0


def test_flipped_byte_is_detected_and_quarantined(tmp_path):
    store = DiskBlobStore(tmp_path, level=1)
    data = os.urandom(200_000)  # incompressible, so a flipped byte is a flipped data byte
    digest = store.put_bytes(data)
    path = store.path_of(digest)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlob):
        store.read_bytes(digest)
    assert not store.has(digest)
    assert store.quarantined == 1
    assert len(list(store.quarantine_dir.iterdir())) == 1


def test_missing_blob_is_not_found(tmp_path):
    store = DiskBlobStore(tmp_path)
    with pytest.raises(NotFound):
        store.read_bytes("a" * 64)


def test_leftover_temp_files_are_swept_on_open(tmp_path):
    store = DiskBlobStore(tmp_path)
    w = store.writer()
    w.write(b"half written")
    w._file.close()  # simulate a crash: the process dies mid-write, never committing
    assert len(list(store.tmp_dir.iterdir())) == 1
    store2 = DiskBlobStore(tmp_path)
    assert list(store2.tmp_dir.iterdir()) == []
    assert store2.count() == 0


def test_size_limit_per_blob(tmp_path):
    store = DiskBlobStore(tmp_path, max_blob_size=10)
    with pytest.raises(TooLarge), store.writer() as w:
        w.write(b"x" * 11)
    assert list(store.tmp_dir.iterdir()) == []


def test_bounded_store_evicts_least_recently_used(tmp_path):
    store = DiskBlobStore(tmp_path, max_bytes=350_000, level=1)
    blobs = [os.urandom(100_000) for _ in range(3)]
    digests = [store.put_bytes(b) for b in blobs]
    os.utime(store.path_of(digests[0]), (1, 1))  # the oldest
    os.utime(store.path_of(digests[1]), (2, 2))
    store.read_bytes(digests[0])  # reading refreshes it
    store.put_bytes(os.urandom(100_000))
    assert store.stored_bytes <= 350_000
    assert store.has(digests[0])
    assert not store.has(digests[1])


def test_stores_sharing_a_directory_hold_it_to_the_bound_when_they_rescan(tmp_path):
    """Coordinator replicas on one volume: each counts its own writes, so
    neither is over its bound until a scan counts the other's too."""
    evicted: list[int] = []
    a = DiskBlobStore(tmp_path, max_bytes=500_000, level=1, on_evict=evicted.append)
    b = DiskBlobStore(tmp_path, max_bytes=500_000, level=1)
    digests = []
    for i in range(6):
        digests.append((a if i % 2 else b).put_bytes(os.urandom(100_000)))
        os.utime((a if i % 2 else b).path_of(digests[-1]), (10 + i, 10 + i))
    assert a.stored_bytes < 500_000 and not evicted  # 3 of 6 blobs, as a counts
    a.read_bytes(digests[0])  # the oldest write, read lately
    assert a.rescan() <= 450_000  # 90 % of the bound
    assert len(evicted) == 2 and all(size > 100_000 for size in evicted)
    kept = [d for d in digests if a.has(d)]
    assert kept == [digests[0], *digests[3:]]  # the least recently read went first
    assert b.rescan() == a.stored_bytes


def test_a_blob_another_store_evicted_first_counts_as_evicted(tmp_path):
    """Two replicas scanning at once: one looks at the directory while the
    other evicts; the first must not evict further blobs for those gone."""
    a = DiskBlobStore(tmp_path, max_bytes=300_000, level=1)
    b = DiskBlobStore(tmp_path, max_bytes=300_000, level=1)
    digests = [(a if i % 2 else b).put_bytes(os.urandom(100_000)) for i in range(4)]
    for i, d in enumerate(digests):
        os.utime(a.path_of(d), (10 + i, 10 + i))
    stale = b._scan()  # b has read the directory...
    b._total = sum(size for _, size, _ in stale)
    a.rescan()  # ...when a evicts the two oldest
    b._evict(stale)
    assert [a.has(d) for d in digests] == [False, False, True, True]
    assert b.stored_bytes == a.stored_bytes


@pytest.mark.parametrize("payload", [os.urandom(5 << 20), b"xyz" * 2_000_000],
                         ids=["raw", "zstd"])
def test_reads_from_an_offset_return_the_rest(tmp_path, payload):
    store = DiskBlobStore(tmp_path)
    digest = store.put_bytes(payload)  # trusted: written and hashed by this store
    fresh = DiskBlobStore(tmp_path)  # another process: hashes its first read
    for offset in (0, 1, (2 << 20) - 1, 2 << 20, 3_333_333, len(payload)):
        assert b"".join(store.read(digest, offset=offset)) == payload[offset:]
        assert b"".join(fresh.read(digest, offset=offset)) == payload[offset:]


def test_a_trusted_blob_changed_in_place_is_hashed_again(tmp_path):
    """Reads skip hashing only for a file unchanged since this store verified
    it: an in-place edit, even with its mtime put back, changes its ctime."""
    store = DiskBlobStore(tmp_path)
    data = os.urandom(3 << 20)
    digest = store.put_bytes(data)
    assert store.read_bytes(digest) == data
    path = store.path_of(digest)
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CorruptBlob):
        store.read_bytes(digest)
    assert store.quarantined == 1 and not store.has(digest)


def test_reverify_zero_hashes_every_read(tmp_path):
    """With reverify_s=0 nothing is trusted: a blob swapped for another
    file with the same size and times is still caught."""
    store = DiskBlobStore(tmp_path, reverify_s=0)
    data = os.urandom(1 << 20)
    digest = store.put_bytes(data)
    path = store.path_of(digest)
    assert store.read_bytes(digest) == data
    assert store._trusted(digest, path.stat()) is None
    trusting = DiskBlobStore(tmp_path)
    assert trusting.read_bytes(digest) == data
    assert trusting._trusted(digest, path.stat()) is not None


def test_a_cache_store_cut_short_by_a_crash_is_caught_on_the_next_read(tmp_path):
    """durable=False (the host cache) skips fsync; what a crash leaves short
    or empty fails verification in the restarted process and is quarantined."""
    data = os.urandom(3 << 20)
    digest = DiskBlobStore(tmp_path, durable=False).put_bytes(data)
    for cut in (0, len(data) // 2):
        path = DiskBlobStore(tmp_path).path_of(digest)
        if not path.exists():
            DiskBlobStore(tmp_path, durable=False).put_bytes(data)
        with open(path, "r+b") as f:
            f.truncate(cut)
        restarted = DiskBlobStore(tmp_path, durable=False)
        with pytest.raises(CorruptBlob):
            restarted.read_bytes(digest)
        assert not restarted.has(digest)


def _onto_a_full_volume(w) -> None:
    """Send a writer's bytes to /dev/full from here on: the kernel fails every
    write with ENOSPC, as a full volume does."""
    w._file.close()
    w._file = open("/dev/full", "wb", buffering=0)  # the writer closes it


def test_a_full_volume_fails_a_write_with_store_full_and_leaves_nothing(tmp_path):
    store = DiskBlobStore(tmp_path)
    data = os.urandom(3 << 20)
    with pytest.raises(StoreFull, match="no space left"), store.writer() as w:
        _onto_a_full_volume(w)
        w.write(data)
    assert list(store.tmp_dir.iterdir()) == []
    assert store.stored_bytes == 0


def test_a_writer_that_may_discard_still_verifies_what_it_could_not_keep(tmp_path):
    store = DiskBlobStore(tmp_path)
    data = os.urandom(3 << 20)
    digest = hashlib.sha256(data).hexdigest()
    with store.writer(discard_when_unwritable=True) as w:
        w.write(data[:1 << 20])  # the probe's worth: decided (raw) and on disk
        assert not w.discarded
        _onto_a_full_volume(w)
        for off in range(1 << 20, len(data), 512 << 10):
            w.write(data[off:off + (512 << 10)])
        assert "no space left" in w.discarded
        assert w.commit(digest, len(data)) is None
    assert not store.has(digest)
    assert list(store.tmp_dir.iterdir()) == []
    with store.writer(discard_when_unwritable=True) as w:
        _onto_a_full_volume(w)
        w.write(data)
        with pytest.raises(DigestMismatch):
            w.commit(hashlib.sha256(b"other bytes").hexdigest(), len(data))


def _room(store: DiskBlobStore, nbytes: int) -> None:
    """Keep all but `nbytes` of the volume's free space free."""
    store.min_free = shutil.disk_usage(store.root).free - nbytes


def test_make_room_evicts_least_recently_read_blobs_and_nothing_else(tmp_path):
    evicted = []
    store = DiskBlobStore(tmp_path / "store", on_evict=evicted.append)
    theirs = tmp_path / "checkpoint.bin"  # a job's file on the same volume
    theirs.write_bytes(os.urandom(4 << 20))
    blobs = [store.put_bytes(os.urandom(1 << 20)) for _ in range(3)]
    for age, digest in enumerate(blobs):  # blobs[0] read longest ago
        os.utime(store.path_of(digest), (1_000_000 + age, 1_000_000 + age))

    _room(store, 2 << 20)
    assert store.make_room(1 << 20)  # fits as it is
    assert all(store.has(d) for d in blobs) and evicted == []

    _room(store, 2 << 20)
    assert store.make_room(2 << 20)  # a little short: the oldest blob goes
    assert [store.has(d) for d in blobs] == [False, True, True]
    assert len(evicted) == 1

    _room(store, 2 << 20)
    assert not store.make_room(64 << 20)  # could not fit even in an empty store
    assert [store.has(d) for d in blobs] == [False, True, True]
    assert theirs.stat().st_size == 4 << 20


def compressible(n: int) -> bytes:
    """Bytes that compress about 2x (half of each KiB random), like code."""
    return b"".join(os.urandom(512) + bytes(512) for _ in range(n >> 10))


def test_a_blob_read_as_stored_is_its_zstd_stream_and_decodes_to_it(tmp_path):
    data = compressible(3 << 20)
    store = DiskBlobStore(tmp_path)
    digest = store.put_bytes(data)
    for reader in (store, DiskBlobStore(tmp_path)):  # trusted (wrote it), and not yet
        parts = list(reader.read(digest, 1 << 20, as_stored=True))
        assert parts and all(type(p) is Zstd for p in parts)
        assert b"".join(parts) == store.path_of(digest).read_bytes()
        out: list[bytes] = []
        inflate = Inflate(out.append, len(data))
        for p in parts:
            inflate.feed(p)
        assert b"".join(out) == data and inflate.size == len(data)
    # From an offset, or stored raw: the artifact's own bytes.
    assert b"".join(store.read(digest, offset=10, as_stored=True)) == data[10:]
    raw = os.urandom(1 << 20)
    raw_digest = store.put_bytes(raw)
    parts = list(store.read(raw_digest, as_stored=True))
    assert b"".join(parts) == raw and not any(type(p) is Zstd for p in parts)


def test_a_blob_read_as_stored_is_still_verified_and_quarantined(tmp_path):
    """Sent as stored, a blob this store has not verified is decoded and
    hashed on the way out: a changed one is caught and quarantined, as a
    decoded read would be."""
    data = compressible(2 << 20)
    digest = DiskBlobStore(tmp_path).put_bytes(data)
    path = DiskBlobStore(tmp_path).path_of(digest)
    stored = bytearray(path.read_bytes())
    stored[len(stored) // 2] ^= 0x40
    path.write_bytes(bytes(stored))
    store = DiskBlobStore(tmp_path)
    with pytest.raises(CorruptBlob):
        list(store.read(digest, as_stored=True))
    assert store.quarantined == 1 and not store.has(digest)


def test_inflate_hands_on_bounded_pieces_and_stops_past_the_size():
    """Zeros compress thousands of times over: what one chunk of the stream
    decodes to is handed on a piece at a time, never held whole; and a stream
    that decodes past the artifact's size is refused."""
    import zstandard

    zeros = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert len(zeros) < 64 << 10
    pieces: list[int] = []
    inflate = Inflate(lambda b: pieces.append(len(b)), 64 << 20, piece=1 << 20)
    inflate.feed(zeros)
    assert sum(pieces) == 64 << 20 and max(pieces) <= 1 << 20
    with pytest.raises(CorruptBlob, match="decodes past"):
        Inflate(lambda b: None, (64 << 20) - 1).feed(zeros)
    with pytest.raises(CorruptBlob, match="does not decode"):
        Inflate(lambda b: None, 1 << 20).feed(b"not zstd at all" * 10)


def test_a_blob_written_as_its_zstd_stream_is_stored_as_it_came(tmp_path):
    """A host cache keeps what the coordinator sent as stored byte for byte;
    the decoded bytes decide, as for any write."""
    data = compressible(2 << 20)
    source = DiskBlobStore(tmp_path / "a")
    digest = source.put_bytes(data)
    stream = source.path_of(digest).read_bytes()
    store = DiskBlobStore(tmp_path / "b")
    with store.writer() as w:
        inflate = Inflate(w.write, len(data))
        for i in range(0, len(stream), 1 << 16):
            w.write_zstd(stream[i:i + (1 << 16)])
            inflate.feed(stream[i:i + (1 << 16)])
        w.commit(digest, len(data))
    assert store.path_of(digest).read_bytes() == stream
    assert DiskBlobStore(tmp_path / "b").read_bytes(digest) == data
    with store.writer() as w:  # decoded bytes that are not the artifact: nothing stored
        w.write_zstd(stream)
        w.write(data[:-1] + b"?")
        with pytest.raises(DigestMismatch):
            w.commit(digest, len(data))
    with store.writer() as w, pytest.raises(ValueError):
        w.write(b"plain first")
        w.write_zstd(stream)


def _hash_threads() -> int:
    return sum(t.name == "compilecast-sha256" for t in threading.enumerate())


def test_sha256_batches_keep_their_order_through_a_full_queue():
    """Many batches through a queue one deep (each update may wait for the
    thread): the digest is hashlib's over the pieces in order."""
    pieces = [os.urandom(n) for n in range(1, 3000, 7)]
    h = Sha256(inline=1, depth=1, batch=1000)
    for p in pieces:
        h.update(p)
    assert h.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()


def test_sha256_on_a_thread_gives_hashlibs_digest():
    """Below its threshold it hashes inline (no thread); past it, on a thread,
    in batches, with the same digest, also for a buffer the caller reuses at
    once."""
    pieces = [os.urandom(n) for n in (5, 100, 3, 64 << 10, 1, 7000)]
    expect = hashlib.sha256(b"".join(pieces)).hexdigest()
    small = Sha256(inline=1 << 30)
    for p in pieces:
        small.update(p)
    assert _hash_threads() == 0 and small.hexdigest() == expect
    before = _hash_threads()
    big = Sha256(inline=10, depth=2, batch=4096)
    reused = bytearray(7000)
    for p in pieces:
        if len(p) == 7000:  # handed over, then overwritten before it is hashed
            reused[:] = p
            big.update(reused)
            reused[:] = b"x" * 7000
        elif len(p) == 3:
            big.update(memoryview(p))
        else:
            big.update(p)
    assert _hash_threads() == before + 1
    assert big.hexdigest() == expect and _hash_threads() == before
    big.update(b"more")  # after the digest: inline again
    assert big.hexdigest() == hashlib.sha256(b"".join(pieces) + b"more").hexdigest()


def test_a_writer_given_up_ends_its_hashing_thread(tmp_path):
    store = DiskBlobStore(tmp_path / "store")
    before = _hash_threads()
    with store.writer() as w:
        for _ in range(12):
            w.write(os.urandom(2 << 20))  # past the 16 MiB hashed inline
        assert _hash_threads() == before + 1
    assert _hash_threads() == before
    data = os.urandom(20 << 20)
    with store.writer() as w:
        w.write(data)
        w.commit(hashlib.sha256(data).hexdigest(), len(data))
    assert _hash_threads() == before
    assert b"".join(store.read(hashlib.sha256(data).hexdigest())) == data


def test_the_kernel_starts_writeback_where_the_platform_allows(tmp_path):
    """The binding of sync_file_range works here (a wrong one would only be
    refused, and every durable commit would wait for its whole blob again)."""
    import sys

    from compilecast import blobwriter

    if not sys.platform.startswith("linux"):
        assert not blobwriter._start_writeback(0, 0, 1)
        return
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        assert blobwriter._start_writeback(fd, 0, 1 << 20)
        assert not blobwriter._start_writeback(-1, 0, 1 << 20)  # EBADF: refused, said so
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["raw", "compressed", "as-sent"])
def test_a_durable_writer_has_its_bytes_written_out_as_it_goes(tmp_path, monkeypatch, how):
    """Every WRITEBACK_EVERY bytes of a durable blob's file, the kernel is
    asked to start writing them out, each range once and in order, before
    the commit; a cache's store (not durable) never asks; once refused, a
    writer stops asking and its commit still makes the blob."""
    from compilecast import blobwriter

    asked = []

    def start(fd, offset, nbytes):
        asked.append((offset, nbytes, os.fstat(fd).st_size))
        return len(asked) < 100

    monkeypatch.setattr(blobwriter, "_start_writeback", start)
    monkeypatch.setattr(blobwriter, "WRITEBACK_EVERY", 1 << 20)
    data = os.urandom(5 << 19) * 4 if how != "raw" else os.urandom(10 << 20)  # 10 MiB
    import zstandard

    stored = zstandard.ZstdCompressor(level=1).compress(data) if how == "as-sent" else b""
    for durable in (True, False):
        asked.clear()
        store = DiskBlobStore(tmp_path / str(durable), durable=durable)
        with store.writer() as w:
            if how == "as-sent":
                for off in range(0, len(stored), 300_000):
                    w.write_zstd(stored[off:off + 300_000])
            for off in range(0, len(data), 300_000):
                w.write(data[off:off + 300_000])
            before_commit = list(asked)
            w.commit(hashlib.sha256(data).hexdigest(), len(data))
        assert store.read_bytes(hashlib.sha256(data).hexdigest()) == data
        if not durable:
            assert asked == []
            continue
        assert before_commit == asked and len(asked) >= 2, (how, asked)
        ends = 0
        for offset, nbytes, file_size in asked:
            assert offset == ends and nbytes >= (1 << 20) and offset + nbytes <= file_size
            ends = offset + nbytes
        assert ends > store.path_of(hashlib.sha256(data).hexdigest()).stat().st_size - (1 << 20)

    asked.clear()
    monkeypatch.setattr(blobwriter, "_start_writeback", lambda *a: asked.append(a) and False)
    store = DiskBlobStore(tmp_path / "refused")
    with store.writer() as w:
        w.write(os.urandom(4 << 20))
        assert len(asked) == 1  # refused the first time: never asked again
        w.write(os.urandom(4 << 20))
        assert len(asked) == 1


def test_a_scrub_quarantines_corrupt_blobs_nobody_reads_and_leaves_the_read_order(tmp_path):
    import threading

    from .conftest import flip_middle_byte

    store = DiskBlobStore(tmp_path, max_bytes=1 << 30)
    digests = [store.put_bytes(os.urandom(100_000)) for _ in range(3)]
    flip_middle_byte(store.path_of(digests[1]))
    before = {d: os.stat(store.path_of(d)).st_mtime_ns for d in (digests[0], digests[2])}
    found = []
    assert store.scrub(1e12, threading.Event(), found.append) == (3, 1)
    assert found == [digests[1]] and not store.has(digests[1])
    assert [p.name.split(".")[0] for p in store.quarantine_dir.iterdir()] == [digests[1]]
    assert {d: os.stat(store.path_of(d)).st_mtime_ns for d in before} == before
    stopped = threading.Event()
    stopped.set()
    assert store.scrub(1e12, stopped) == (0, 0)  # a stop ends the pass
