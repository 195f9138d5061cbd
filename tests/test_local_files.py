"""A process on the worker's host reads a host cache hit from the file
itself (FetchRequest.accept_local_file): none of the bytes go through the
worker and its socket, and the process still verifies every byte. A file it
cannot open, or one whose bytes are not the artifact's, never reaches the
caller: it gets the bytes over the socket instead, or the error a corrupt
blob always gives. Real coordinator, worker and etcd."""

from __future__ import annotations

import os

import grpc
import pytest

from compilecast.worker.client import CacheClient

from .conftest import flip_middle_byte, publish, sample

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
    assert process.local_files  # it reached its worker over the unix socket
    before = served(worker)
    info, got = process.fetch("k")
    assert got == data and info.size == len(data)
    assert files(worker) == 1
    assert served(worker) == before  # not one byte through the worker
    assert process.local_files


def test_a_process_off_the_host_never_asks_for_files():
    assert not CacheClient("127.0.0.1:1").local_files
    assert not CacheClient("dns:///worker.example:7641").local_files


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
    assert not process.local_files
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
    assert process.local_files
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
    with pytest.raises(grpc.RpcError) as err:
        process.fetch("k")
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert files(worker) == 1
    assert worker.cache.lookup("host", "k") is None
    assert process.local_files  # the file was there; it was the bytes that were wrong
    assert process.fetch("k")[1] == data  # downloaded again from the coordinator
    assert process.fetch("k")[1] == data  # and now a host cache hit, from the new file
    assert files(worker) == 2
