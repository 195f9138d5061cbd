"""A process on the worker's host reads a host cache hit from the file
itself (FetchRequest.accept_local_file): none of the bytes go through the
worker and its socket, and the process still verifies every byte. A file it
cannot open, or one whose bytes are not the artifact's, never reaches the
caller: it gets the bytes over the socket instead, or the error a corrupt
blob always gives. Real coordinator, worker and etcd."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from compilecast.negotiate import Route
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, flip_middle_byte, publish, sample, status_code

RANDOM = os.urandom(6 << 20)  # stored raw (incompressible)
COMPRESSIBLE = b"".join(os.urandom(96) + bytes(928) for _ in range(6 << 10))  # stored as zstd
# Under 4 MiB a download is joined from its pieces, not put together in place.
KINDS = {"raw": RANDOM, "zstd": COMPRESSIBLE, "small-raw": RANDOM[:300_000],
         "small-zstd": COMPRESSIBLE[:300_000]}


def served(worker) -> float:
    return sample(worker, "compilecast_worker_artifact_bytes_total", direction="served")


def files(worker) -> float:
    return sample(worker, "compilecast_worker_local_files_total")


def published_through(worker, key: str, data: bytes) -> CacheClient:
    """`data` published under `key` by a process on `worker`'s host (so its
    host cache holds it); a second process of that host, to fetch it."""
    publish(CacheClient(worker.target, timeout_s=10), key, data)
    assert worker.cache.lookup("host", key) is not None
    return CacheClient(worker.target, timeout_s=10)


@pytest.mark.parametrize("kind", KINDS)
def test_a_process_on_the_host_reads_the_host_cache_file_itself(coordinator, start_worker,
                                                                  kind):
    data = KINDS[kind]
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", data)
    assert process.routes.on(Route.LOCAL_FILE)  # it reached its worker over the unix socket
    before = served(worker)
    info, got = process.fetch("k")
    assert got == data and info.size == len(data)
    assert files(worker) == 1
    assert served(worker) == before  # not one byte through the worker
    assert process.routes.on(Route.LOCAL_FILE)


def test_a_process_off_the_host_never_asks_for_files():
    assert not CacheClient("127.0.0.1:1").routes.on(Route.LOCAL_FILE)
    assert not CacheClient("dns:///worker.example:7641").routes.on(Route.LOCAL_FILE)


def test_a_worker_told_not_to_hand_out_files_sends_the_bytes(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen, local_files=False)
    process = published_through(worker, "k", RANDOM)
    before = served(worker)
    assert process.fetch("k")[1] == RANDOM
    assert files(worker) == 0
    assert served(worker) - before == len(RANDOM)


def test_a_file_the_process_cannot_open_is_fetched_over_the_socket(coordinator, start_worker,
                                                                   tmp_path):
    """A file the process does not see (the host cache not mounted into its
    container, or evicted meanwhile): the bytes come over the socket, and the
    process stops asking for files."""
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", RANDOM)
    worker.cache.store.hand_out = lambda digest: str(tmp_path / "not-mounted-here" / digest)
    before = served(worker)
    assert process.fetch("k")[1] == RANDOM
    assert files(worker) == 1
    assert served(worker) - before == len(RANDOM)
    assert not process.routes.on(Route.LOCAL_FILE)
    assert process.fetch("k")[1] == RANDOM
    assert files(worker) == 1  # not asked again


def test_a_fifo_named_as_the_file_never_blocks_the_process(coordinator, start_worker,
                                                           tmp_path):
    """Opening a FIFO for reading blocks until someone writes to it: the
    process opens without blocking, refuses what is not a regular file, and
    gets the bytes over the socket."""
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", RANDOM)
    path = tmp_path / "fifo"
    os.mkfifo(path)
    worker.cache.store.hand_out = lambda digest: str(path)
    assert process.fetch("k")[1] == RANDOM
    assert files(worker) == 1


def test_a_file_gone_from_a_host_cache_that_is_here_is_asked_for_again(coordinator,
                                                                        start_worker):
    """Evicted between the worker's answer and the process's read (or not
    readable by the process's user): the bytes come over the socket, and the
    next fetch still asks for the file."""
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", RANDOM)
    real = worker.cache.store.hand_out
    worker.cache.store.hand_out = lambda digest: real(digest) + ".evicted"
    assert process.fetch("k")[1] == RANDOM
    assert process.routes.on(Route.LOCAL_FILE)
    worker.cache.store.hand_out = real
    before = served(worker)
    assert process.fetch("k")[1] == RANDOM
    assert files(worker) == 2 and served(worker) == before


def test_the_host_cache_blobs_are_readable_by_the_workers_group(coordinator, start_worker):
    """Job pods run as other users than the worker, with its group (they need
    it for the 0660 socket too): they can read its files only if the group may.
    Nobody else may; who sees the directory at all is the mount's choice."""
    worker = start_worker(coordinator.cfg.listen)
    published_through(worker, "k", RANDOM)
    mode = worker.cache.store.path_of(worker.cache.lookup("host", "k").digest).stat().st_mode
    assert mode & 0o777 == 0o640
    other = start_worker(coordinator.cfg.listen, name="w2", local_files=False)
    published_through(other, "k2", RANDOM)
    mode = other.cache.store.path_of(other.cache.lookup("host", "k2").digest).stat().st_mode
    assert mode & 0o777 == 0o600


def test_a_blob_written_before_files_were_handed_out_is_made_readable(coordinator,
                                                                     start_worker):
    """A host cache from before (0600 blobs): the worker hands its files out
    group-readable, so pods of other users need not fall back."""
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", RANDOM)
    path = worker.cache.store.path_of(worker.cache.lookup("host", "k").digest)
    path.chmod(0o600)
    assert process.fetch("k")[1] == RANDOM
    assert path.stat().st_mode & 0o777 == 0o640
    assert files(worker) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_cache_file_that_does_not_verify_never_reaches_the_process(coordinator,
                                                                          start_worker, kind):
    """A byte of the host cache's file changed in place: the process finds it
    out from the file, asks for the bytes, and the worker, reading the same
    file, finds it out too (DATA_LOSS) and drops it; the next fetch downloads
    the artifact again, and the process reads the new file."""
    data = KINDS[kind]
    worker = start_worker(coordinator.cfg.listen)
    process = published_through(worker, "k", data)
    info = worker.cache.lookup("host", "k")
    flip_middle_byte(worker.cache.store.path_of(info.digest))
    with pytest.raises(CALL_ERRORS) as err:
        process.fetch("k")
    assert status_code(err.value) == grpc.StatusCode.DATA_LOSS
    assert files(worker) == 1
    assert worker.cache.lookup("host", "k") is None
    assert process.routes.on(Route.LOCAL_FILE)  # the file was there; it was the bytes that were wrong
    assert process.fetch("k")[1] == data  # downloaded again from the coordinator
    # (Followed in the file being written, or asked again once the file was
    # whole when it could not be followed: a hit handed out as a file then.)
    handed_out = files(worker)
    assert worker.cache.lookup("host", "k") is not None
    assert process.fetch("k")[1] == data  # and now a host cache hit, from the new file
    assert files(worker) == handed_out + 1


# --- a cold fetch followed in the file the worker is writing -----------------

BIG = os.urandom(24 << 20)  # stored raw; more chunks than a reader's queue holds


def growing(worker) -> float:
    return sample(worker, "compilecast_worker_growing_files_total")


def cold(coordinator, start_worker, data: bytes, key: str = "k"):
    """`data` published to the coordinator, not through the worker: its
    host cache does not hold it, and a fetch through it downloads it."""
    publish(CacheClient(coordinator.cfg.listen, timeout_s=10), key, data)
    worker = start_worker(coordinator.cfg.listen)
    assert worker.cache.lookup("host", key) is None
    return worker, CacheClient(worker.target, timeout_s=10)


def test_a_cold_fetch_follows_the_file_the_worker_is_writing(coordinator, start_worker):
    """After the first MiB (when the worker knows it stores the bytes raw) the
    process reads the rest from the host cache's file as it grows: the worker
    sends it where the file is and how far it is written, not the bytes."""
    worker, process = cold(coordinator, start_worker, BIG)
    info, got = process.fetch("k")
    assert got == BIG and info.size == len(BIG)
    assert growing(worker) == 1
    assert served(worker) < len(BIG) // 2  # the head at most: the rest from the file
    assert worker.cache.lookup("host", "k") is not None  # and the host cache holds it
    # (0, or 1 when the file was whole before the process opened it: asked again.)
    handed_out = files(worker)
    assert process.fetch("k")[1] == BIG and files(worker) == handed_out + 1  # a hit: the file


def test_the_stream_switches_to_the_file_where_the_bytes_sent_end(coordinator, start_worker):
    """The protocol as any client sees it: the header, some bytes, then the
    file and how far it is written, rising to the size; the bytes sent and the
    file's from there make the artifact."""
    from compilecast.v1 import cache_pb2 as pb
    from compilecast.wire import stub

    worker, _ = cold(coordinator, start_worker, BIG)
    channel = grpc.insecure_channel(worker.target)
    try:
        sent, switch, marks = b"", None, []
        for chunk in stub(channel).Fetch(pb.FetchRequest(key="k", accept_local_file=True,
                                                         accept_growing_file=True)):
            if switch is None and chunk.local_growing:
                switch = chunk
            if switch is not None:
                marks.append(chunk.local_available)
            else:
                sent += bytes(chunk.data)
    finally:
        channel.close()
    assert switch is not None and switch.local_path
    assert marks == sorted(marks) and marks[-1] == len(BIG)
    path = worker.cache.store.path_of(worker.cache.lookup("host", "k").digest)
    with open(path, "rb") as f:
        stored = f.read()
    assert stored[8:8 + len(sent)] == sent
    assert sent + stored[8 + len(sent):] == BIG


def test_a_client_that_does_not_follow_files_gets_the_bytes(coordinator, start_worker):
    from compilecast.v1 import cache_pb2 as pb
    from compilecast.wire import stub

    worker, _ = cold(coordinator, start_worker, BIG)
    channel = grpc.insecure_channel(worker.target)
    try:
        chunks = list(stub(channel).Fetch(pb.FetchRequest(key="k", accept_local_file=True)))
    finally:
        channel.close()
    assert not any(c.local_growing for c in chunks)
    assert b"".join(bytes(c.data) for c in chunks) == BIG
    assert growing(worker) == 0


def test_a_compressed_download_is_not_followed(coordinator, start_worker):
    """Stored as zstd (as it came), the file is not the artifact's bytes
    while it is written: the process gets them over the socket, as before."""
    data = COMPRESSIBLE * 4
    worker, process = cold(coordinator, start_worker, data)
    assert process.fetch("k")[1] == data
    assert growing(worker) == 0


def test_a_file_the_process_cannot_follow_is_asked_for_again(coordinator, start_worker,
                                                             monkeypatch):
    """Not visible here, or shorter than the worker said: the process asks
    again without following, and gets the artifact whole."""
    from compilecast.worker.inprocess import client as client_mod
    from compilecast.worker.inprocess import received as received_mod

    real = received_mod._Following

    def unopenable(key, path, received, h):
        raise PermissionError(13, "not readable here", path)

    worker, process = cold(coordinator, start_worker, BIG)
    monkeypatch.setattr(received_mod, "_Following", unopenable)
    assert process.fetch("k")[1] == BIG
    assert growing(worker) == 1 and process.routes.on(Route.LOCAL_FILE)

    class Short(real):  # the file ends before what the worker said is in it
        def to(self, available):
            super().to(min(available, 3 << 20))
            if available > 3 << 20:
                raise client_mod.CorruptBlob("ends short")

    worker2, process2 = cold(coordinator, start_worker, BIG[::-1], key="k2")
    monkeypatch.setattr(received_mod, "_Following", Short)
    assert process2.fetch("k2")[1] == BIG[::-1]
    assert growing(worker2) == 1


def test_a_file_that_ends_short_is_refused(tmp_path):
    from compilecast.blobstore import RAW_MAGIC, Sha256
    from compilecast.errors import CorruptBlob
    from compilecast.worker.inprocess.received import Received, _Following

    path = tmp_path / "blob"
    path.write_bytes(RAW_MAGIC + bytes(range(200)))
    received, h = Received("k"), Sha256()
    follow = _Following("k", str(path), received, h)
    try:
        follow.to(150)
        assert received.size == 150
        with pytest.raises(CorruptBlob, match="ends at byte 200"):
            follow.to(300)
    finally:
        follow.close()
        h.close()
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(100))  # a zstd stream: not followable
    with pytest.raises(CorruptBlob, match="not a raw blob"):
        _Following("k", str(path), Received("k"), Sha256())


def test_a_process_that_joins_a_download_late_follows_the_file_from_its_start(
        coordinator, start_worker):
    """A second process of the host asking while the worker downloads (too
    late for the bytes sent so far) used to wait for the whole download and
    then read the file; it follows the file from its first byte instead."""
    import threading

    from compilecast.v1 import cache_pb2 as pb
    from compilecast.wire import stub

    worker, late = cold(coordinator, start_worker, BIG)
    channel = grpc.insecure_channel(worker.target)
    try:
        # The first reader takes bytes and holds the download back (its queue is full).
        first = stub(channel).Fetch(pb.FetchRequest(key="k"))
        head = [bytes(next(first).data) for _ in range(3)]
        got = {}
        t = threading.Thread(target=lambda: got.update(late=late.fetch("k")))
        t.start()
        deadline = time.monotonic() + 10
        while growing(worker) == 0 and t.is_alive() and time.monotonic() < deadline:
            t.join(0.05)
        following = growing(worker)  # before the first reader moves on
        rest = b"".join(bytes(c.data) for c in first)
        t.join(30)
    finally:
        channel.close()
    assert following == 1
    assert b"".join(head) + rest == BIG
    assert got["late"][1] == BIG


def test_a_process_that_does_not_see_the_workers_files_stops_following(
        coordinator, start_worker, monkeypatch, tmp_path):
    """The temp file's directory is not here (the host cache not mounted into
    the process's container): the fetch still gets the artifact, and the
    process no longer asks to follow files."""
    from compilecast.blobstore import BlobWriter

    elsewhere = tmp_path / "not-mounted-here"
    monkeypatch.setattr(BlobWriter, "path", property(lambda w: elsewhere / w._path.name))
    worker, process = cold(coordinator, start_worker, BIG)
    assert process.fetch("k")[1] == BIG
    assert growing(worker) == 1 and not process.routes.on(Route.GROWING_FILE)
    publish(CacheClient(coordinator.cfg.listen, timeout_s=10), "k2", BIG[::-1])
    assert process.fetch("k2")[1] == BIG[::-1]
    assert growing(worker) == 1  # not asked again
