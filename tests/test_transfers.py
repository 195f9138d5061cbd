"""Transfers take as long as they move: a fetch or publish that moves nothing
for the client's stall_s is given up (DEADLINE_EXCEEDED), one that keeps
moving is not cut off by a deadline on the whole call (unit tests of the
client against small servers of our own protocol that stall or trickle).
And what a coordinator restart cuts off (a publish, a download, a wait) is
taken up again with the replica that takes its place (real coordinators,
workers and etcd)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent import futures

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, details_of, eventually, status_code

DATA = bytes(range(256)) * 4096  # 1 MiB


class Trickle(rpc.CompileCacheServicer):
    """Fetch: the header, then a chunk every `every_s` (`chunks` of them), or
    after `stall_after` chunks nothing until released. Publish: reads the
    header and one chunk, then stops reading until released."""

    def __init__(self, chunks: int, every_s: float, stall_after: int | None = None) -> None:
        self.chunks, self.every_s, self.stall_after = chunks, every_s, stall_after
        self.release = threading.Event()
        self.held_out = threading.Event()  # a hold ended unreleased (30 s)
        self.data = DATA * chunks

    def _hold(self) -> None:
        if not self.release.wait(30):
            self.held_out.set()

    def Fetch(self, request, context):
        info = pb.ArtifactInfo(key=request.key, size=len(self.data),
                               digest=hashlib.sha256(self.data).hexdigest())
        yield pb.FetchChunk(artifact=info)
        for i in range(self.chunks):
            if i == self.stall_after:
                self._hold()
            time.sleep(self.every_s)
            yield pb.FetchChunk(data=DATA)

    def Publish(self, request_iterator, context):
        next(request_iterator)
        next(request_iterator)
        self._hold()
        return pb.PublishResponse()

    def OpenUpload(self, request, context):
        return pb.OpenUploadResponse()  # no ticket: publishes over gRPC


def _receiving(coordinator) -> bool:
    """Whether a publish's bytes are arriving: a temp file in the store has some."""
    return any(p.stat().st_size > 0 for p in coordinator.store.tmp_dir.glob("*.part"))


def restart(first, started, *, grace_s: float = 2.0):
    """Stop coordinator `first` (with `grace_s` for what it serves) and start
    another on its address, etcd and store, as a rolling update does."""
    import dataclasses

    from compilecast.coordinator.server import Coordinator

    first.stopped = True
    first.lt.run(first.server.stop(grace_s))
    return started(Coordinator(dataclasses.replace(first.cfg)))


def restart_worker(worker, started):
    """Stop `worker` with no grace for what it serves and start another on its
    socket and host cache, as a DaemonSet rollout does."""
    import dataclasses

    from compilecast.worker.daemon.server import Worker

    worker.stopped = True
    worker.lt.run(worker.server.stop(0.1))
    return started(Worker(dataclasses.replace(worker.cfg)))


def fetching_through_a_worker(coordinator, start_worker, data: bytes | None = None) -> tuple:
    """300 MB (or `data`) published; a process fetching them through a new
    worker, its download from the coordinator under way: (data, worker,
    thread, result)."""
    data = os.urandom(300 << 20) if data is None else data
    holder = CacheClient(coordinator.cfg.listen, timeout_s=30)
    lease = holder.acquire("k").lease
    # Renewed as a real holder's is: on a busy machine the upload can outlast the TTL.
    holder.keep_lease("k", lease)
    try:
        holder.publish("k", lease, data, 1.0)
    finally:
        holder.stop_lease("k", lease)
    worker = start_worker(coordinator.cfg.listen)
    out: list = []
    t = threading.Thread(target=lambda: out.append(CacheClient(worker.target).fetch("k")[1]))
    t.start()
    eventually(lambda: any(f.started for f in worker.parts.fetches.fills.values()),
               "the download under way")
    return data, worker, t, out


def waits_through(holder: CacheClient, claim, waiter: CacheClient, interrupt) -> None:
    """`waiter` waits for "k" while `interrupt()` runs, then the holder
    publishes: the waiter must get HIT and the holder's bytes."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(waiter.wait_and_fetch("k", 30)))
    t.start()
    interrupt()
    data = os.urandom(1 << 20)
    holder.publish("k", claim.lease, data, 1.0)
    t.join(40)
    event, got = out[0]
    assert event.decision == pb.HIT, event
    assert got == data


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        rpc.add_CompileCacheServicer_to_server(servicer, server)
        # Port 0: the port the server binds, not one seen free a moment before.
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append((server, servicer))
        return target

    yield start
    for server, servicer in servers:
        servicer.release.set()
        server.stop(0)


def test_a_fetch_that_keeps_moving_outlasts_the_stall_limit(serve):
    trickle = Trickle(chunks=8, every_s=0.25)  # 2 s in all, never silent for 1 s
    client = CacheClient(serve(trickle), stall_s=1.0)
    info, data = client.fetch("k")
    assert data == trickle.data and info.size == len(data)


def test_a_fetch_that_stalls_is_given_up(serve):
    trickle = Trickle(chunks=4, every_s=0.0, stall_after=2)
    client = CacheClient(serve(trickle), stall_s=0.5)
    with pytest.raises(CALL_ERRORS) as err:
        client.fetch("k")
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "moved nothing for 0.5s" in details_of(err.value)
    assert not trickle.held_out.is_set()  # given up while the server held it


def test_a_publish_the_server_stops_reading_is_given_up(serve):
    trickle = Trickle(chunks=0, every_s=0.0)
    client = CacheClient(serve(trickle), stall_s=0.5)
    with pytest.raises(CALL_ERRORS) as err:
        client.publish("k", pb.Lease(id=1, revision=1), DATA * 64, 1.0)
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "publish of k" in details_of(err.value) and "0.5s" in details_of(err.value)
    assert not trickle.held_out.is_set()  # given up while the server held it
    assert client.leases.publishing == set()


def test_a_worker_gives_up_an_upstream_transfer_that_stalls(serve, start_worker, monkeypatch):
    """The worker's own transfers to and from the coordinator: what stalls
    reaches its processes as DEADLINE_EXCEEDED, not as an internal error."""
    from compilecast.worker.daemon import fetches, publishes, upstream

    monkeypatch.setattr(publishes, "UPSTREAM_IDLE_S", 0.5)
    monkeypatch.setattr(fetches, "UPSTREAM_IDLE_S", 0.5)
    monkeypatch.setattr(upstream, "UPSTREAM_IDLE_S", 0.5)
    upstream = serve(Trickle(chunks=4, every_s=0.0, stall_after=2))
    worker = start_worker(upstream)
    client = CacheClient(worker.target, stall_s=20.0)
    with pytest.raises(CALL_ERRORS) as err:
        client.fetch("k")
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "the fetch of k moved nothing for 0.5s" in details_of(err.value)
    with pytest.raises(CALL_ERRORS) as err:
        client.publish("k", pb.Lease(id=1, revision=1), DATA * 64, 1.0)
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "the publish of k moved nothing for 0.5s" in details_of(err.value)


def test_a_publish_cut_off_by_a_coordinator_restart_is_tried_again(
        start_coordinator, start_worker, started, tmp_path, caplog):
    """A rolling update stops the replica a publish streams to: the process
    still holds its lease and its bytes, so it publishes again (through its
    worker, to the replica that took the address) instead of giving up."""
    first = start_coordinator(store_dir=tmp_path / "store")
    worker = start_worker(first.cfg.listen)
    holder = CacheClient(worker.target)
    data = os.urandom(300 << 20)  # long enough to be cut off midway
    claim = holder.acquire("k")
    holder.keep_lease("k", claim.lease)
    out: list = []
    t = threading.Thread(target=lambda: out.append(holder.publish("k", claim.lease, data, 1.0)))
    t.start()
    eventually(lambda: _receiving(first), "the upload under way")
    restart(first, started, grace_s=0.1)  # mid-publish, with no grace for it to finish
    t.join(60)
    assert out and out[0].digest == hashlib.sha256(data).hexdigest()
    assert "was cut off" in caplog.text
    assert CacheClient(first.cfg.listen, timeout_s=30).fetch("k")[1] == data


@pytest.mark.parametrize("way", ["grpc", "data-plane"])
@pytest.mark.parametrize("stored", ["raw", "zstd"])
def test_a_download_cut_off_by_a_coordinator_restart_resumes(
        start_coordinator, start_worker, started, tmp_path, caplog, stored, way):
    """The worker's download from a replica stopped midway goes on, from the
    byte it had, at the replica that took the address; its processes never
    see the break. A download sent as stored zstd goes on as plain data from
    the last byte it decoded. Over the data plane too: the rest comes over gRPC."""
    first = start_coordinator(store_dir=tmp_path / "store",
                              data_listen="off" if way == "grpc" else "auto")
    data = None
    if stored == "zstd":  # compresses ~2x: still long enough on the wire to be cut off
        data = b"".join(os.urandom(512) + bytes(512) for _ in range(300 << 10))
    data, _, t, out = fetching_through_a_worker(first, start_worker, data)
    if stored == "zstd":
        assert first.store.path_of(hashlib.sha256(data).hexdigest()).stat().st_size < \
            0.6 * len(data)
    restart(first, started, grace_s=0.1)  # mid-download, with no grace for it to finish
    t.join(60)
    assert out == [data]
    assert ("was cut off at byte" if way == "grpc" else "fetching the rest without it") \
        in caplog.text


def test_a_wait_cut_off_by_a_coordinator_restart_is_sent_again(
        start_coordinator, start_worker, started, tmp_path):
    """A rolling update stops the replica a host's wait is on: the worker asks
    again (the replica that took the address) instead of telling the waiting
    process to compile, and the process gets the holder's executable."""
    from compilecast.worker.inprocess.client import Identity

    first = start_coordinator(store_dir=tmp_path / "store")
    holder = CacheClient(start_worker(first.cfg.listen, name="h1").target,
                         identity=Identity(job="j", process_id=0))
    waiter = CacheClient(start_worker(first.cfg.listen, name="h2").target,
                         identity=Identity(job="j", process_id=1), timeout_s=10)
    claim = holder.acquire("k")
    holder.keep_lease("k", claim.lease)
    assert waiter.acquire("k").decision == pb.WAIT

    def interrupt() -> None:
        time.sleep(0.5)  # the host's wait on its way to the coordinator
        restart(first, started)

    waits_through(holder, claim, waiter, interrupt)


def test_a_fetch_cut_off_by_a_worker_restart_is_tried_again(
        coordinator, start_worker, started, caplog):
    """A worker restarts (a DaemonSet rollout) while a process reads an
    artifact through it: the process asks the new worker, and gets it."""
    data, worker, t, out = fetching_through_a_worker(coordinator, start_worker)
    restart_worker(worker, started)  # mid-fetch
    t.join(60)
    assert out == [data]
    assert "was cut off" in caplog.text
    caplog.clear()  # refused from the start: no retry
    with pytest.raises(CALL_ERRORS) as err:
        CacheClient(f"unix://{worker.cfg.listen.removeprefix('unix://')}.none").fetch("k")
    assert status_code(err.value) == grpc.StatusCode.UNAVAILABLE
    assert "trying again" not in caplog.text


def test_a_wait_cut_off_by_a_worker_restart_is_sent_again(coordinator, start_worker, started):
    """A worker restarts while a process waits through it on another host's
    compile: the process waits again at the new worker and gets the result."""
    from compilecast.worker.inprocess.client import Identity

    holder = CacheClient(coordinator.cfg.listen, identity=Identity(job="j", process_id=0))
    claim = holder.acquire("k")
    holder.keep_lease("k", claim.lease)
    worker = start_worker(coordinator.cfg.listen)
    waiter = CacheClient(worker.target, identity=Identity(job="j", process_id=1), timeout_s=10)
    assert waiter.acquire("k").decision == pb.WAIT

    def interrupt() -> None:
        eventually(lambda: worker.parts.waits.waiting, "the process waiting at its worker")
        time.sleep(0.6)  # running for a while: a cut, not a refusal
        restart_worker(worker, started)

    waits_through(holder, claim, waiter, interrupt)


def test_a_process_asks_a_worker_that_is_restarting_again(coordinator, started, tmp_path):
    """A JAX process's decision while its worker restarts (nothing listens
    for a second) waits for the worker instead of giving up on it for 30 s,
    which would compile everything the job asks for meanwhile locally."""
    import uuid

    from compilecast.config import WorkerConfig
    from compilecast.worker.daemon.server import Worker
    from compilecast.worker.jaxdoor.jax_integration import CompilecastCache

    sock = f"unix:///tmp/cc-{uuid.uuid4().hex[:8]}.sock"
    cache = CompilecastCache(sock, job="j")
    late = threading.Timer(1.0, lambda: started(Worker(WorkerConfig(
        listen=sock, coordinator=coordinator.cfg.listen, cache_dir=str(tmp_path / "hc"),
        metrics_port=0))))
    late.start()
    with cache.acquiring("k"):
        assert cache.get("k") is None  # a miss: this process holds the compile lease
    late.join(10)
    assert cache.stats.compiles == 1 and cache.stats.fallbacks == 0, cache.stats
    held = CacheClient(coordinator.cfg.listen).acquire("k")
    assert held.decision == pb.WAIT  # the lease is this process's


def test_a_big_download_is_put_together_in_place():
    """Past IN_PLACE_FROM, the bytes go into one bytes object of the size the
    header gave, as they arrive: nothing kept to join. The object is an
    ordinary bytes (equal, hashed, sliced as any); more bytes than the size,
    or fewer, are refused."""
    from compilecast.errors import CorruptBlob
    from compilecast.worker.inprocess.client import Received

    data = os.urandom(Received.IN_PLACE_FROM + 12_345)
    r = Received("k")
    r.expect(len(data))
    view = memoryview(data)
    for off in range(0, len(data), 1 << 20):  # views of the messages, as the parser gives
        r.add(view[off:off + (1 << 20)])
    assert r._parts == []
    out = r.result()
    assert type(out) is bytes and out == data and hash(out) == hash(bytes(data))
    assert out[-5:] == data[-5:]

    over = Received("k")
    over.expect(len(data))
    over.add(data)
    with pytest.raises(CorruptBlob, match="more bytes than its size"):
        over.add(b"x")
    short = Received("k")
    short.expect(len(data))
    short.add(data[:-1])
    with pytest.raises(CorruptBlob, match="ended after"):
        short.result()
    small = Received("k")  # under the bound: joined, as before
    small.expect(10)
    small.add(b"01234")
    small.add(memoryview(b"56789"))
    assert small.result() == b"0123456789" and len(small._parts) == 2


def test_a_download_put_together_in_place_has_its_pages_faulted_in_ahead():
    """The result's whole pages are populated POPULATE_STEP at a time ahead
    of the bytes (one madvise for many page faults), on kernels that have
    MADV_POPULATE_WRITE (Linux 5.14); the bytes are the same either way."""
    import platform

    from compilecast.worker.inprocess.client import Received

    step = Received.POPULATE_STEP
    data = os.urandom(2 * step + 3 * 4096 + 17)
    r = Received("k")
    r.expect(len(data))
    room = r.room(1 << 20)
    room[:] = data[:1 << 20]
    r.filled(1 << 20)
    kernel = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    if platform.system() == "Linux" and kernel >= (5, 14):
        assert r._populated - r._base >= step > 1 << 20  # ahead of the bytes, not all at once
        assert r._populated < r._pages_end
    view = memoryview(data)
    for off in range(1 << 20, len(data), 1 << 20):
        r.add(view[off:off + (1 << 20)])
    if r._pages_end:
        assert r._populated == r._pages_end  # every whole page, none past the end
        assert r._pages_end <= r._base + len(data)
    assert r.result() == data


def test_a_process_keeps_only_its_latest_reasons():
    """A process that runs for days compiling new shapes locally keeps the
    latest reasons, not one string per compile since it started."""
    from compilecast.worker.jaxdoor.jax_integration import REASONS_KEPT, Stats

    stats = Stats()
    for i in range(3 * REASONS_KEPT):
        stats.reasons.append(f"reason {i}")
    reasons = stats.as_dict()["reasons"]
    assert type(reasons) is list and len(reasons) == REASONS_KEPT
    assert reasons[-1] == f"reason {3 * REASONS_KEPT - 1}"
