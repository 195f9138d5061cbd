"""Waiters fetch an artifact while its holder uploads it (real etcd, real gRPC),
when the coordinator streams uploads (publish_stream_readers > 0).

The holder's upload is a generator the test holds halfway, so a test can see
bytes reach a fetcher before the upload is done, and can cut the upload off.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import grpc
import pytest

from compilecast.coordinator.records import scope
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import CALL_ERRORS, all_at_once, details_of, eventually, sample, status_code

MIB = 1 << 20


@pytest.fixture
def coordinator(start_coordinator):
    """Streaming uploads are off by default (publish_stream_readers=0)."""
    return start_coordinator(publish_stream_readers=4)
HEAD = 3 * MIB  # past the store's 1 MiB probe: raw blobs are readable while written


class HeldUpload:
    """A publish in a thread that sends `data[:HEAD]`, then waits for `go`
    (then sends the rest) or `cut` (then ends with an error, the upload short)."""

    def __init__(self, client: CacheClient, key: str, lease: pb.Lease, data: bytes,
                 digest: str = "", *, coordinator=None, digest_last: bool = False) -> None:
        self.go, self.cut, self.sent_head = threading.Event(), threading.Event(), threading.Event()
        self.error: grpc.RpcError | None = None
        header = pb.PublishHeader(key=key, lease=lease, size=len(data), compile_time_seconds=7.0,
                                  requester=client.identity.requester(),
                                  digest="" if digest_last
                                  else digest or hashlib.sha256(data).hexdigest())

        def messages():
            yield pb.PublishChunk(header=header)
            for at in range(0, HEAD, MIB):
                yield DataChunk(data[at:at + MIB])
            self.sent_head.set()
            while not (self.go.wait(0.05) or self.cut.is_set()):
                pass
            if self.cut.is_set():
                raise RuntimeError("holder died mid-upload")
            for at in range(HEAD, len(data), MIB):
                yield DataChunk(data[at:at + MIB])
            if digest_last:
                yield pb.PublishChunk(digest=hashlib.sha256(data).hexdigest())

        def run():
            try:
                client.stub.Publish(messages(), timeout=60)
            except CALL_ERRORS as exc:
                self.error = exc
            finally:
                client.stop_lease(key, lease)

        # Renewed while held, as a real holder's lease is: on a busy machine a
        # test's held upload can outlast the lease's TTL.
        client.keep_lease(key, lease)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.sent_head.wait(10), self.error
        if coordinator is not None:  # for fetchers that do not wait to be told of it
            eventually(lambda: coordinator.state.uploads.get(scope("default", key)) is not None
                       or self.error, "the coordinator tracking the upload")


def clients(target: str) -> tuple[CacheClient, CacheClient]:
    holder = CacheClient(target, identity=Identity(job="j", process_id=0))
    waiter = CacheClient(target, identity=Identity(job="j", process_id=1), timeout_s=10)
    return holder, waiter


def read_until(stream, n: int) -> tuple[pb.ArtifactInfo, bytearray]:
    info, got = None, bytearray()
    for chunk in stream:
        if chunk.HasField("artifact"):
            info = chunk.artifact
        got += chunk.data
        if len(got) >= n:
            break
    return info, got


def released_after(holder: CacheClient, waiter: CacheClient, data: bytes,
                   seconds: float) -> HeldUpload:
    """The holder claims "k" and starts a held upload of `data`, the waiter
    asks (WAIT), and the upload goes on after `seconds`."""
    lease = holder.acquire("k").lease
    waiter.acquire("k")
    up = HeldUpload(holder, "k", lease, data)
    threading.Timer(seconds, up.go.set).start()
    return up


def held_and_announced(holder: CacheClient, waiter: CacheClient, size: int):
    """The holder publishes `size` random bytes, held after HEAD; the waiter,
    told that publishing started, fetches and reads HEAD bytes:
    (data, upload, event, stream, (the stream's artifact info, the bytes read))."""
    data = os.urandom(size)
    lease = holder.acquire("k").lease
    assert waiter.acquire("k").decision == pb.WAIT
    up = HeldUpload(holder, "k", lease, data)
    event = waiter.wait("k", 10, publishing=True)
    assert event.decision == pb.WAIT and event.artifact.size == len(data)
    stream = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=event.artifact.digest), timeout=30)
    return data, up, event, stream, read_until(stream, HEAD)


def test_a_waiter_is_told_when_publishing_starts_and_reads_bytes_before_the_upload_ends(
        coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data, up, event, stream, (info, got) = held_and_announced(holder, waiter, 8 * MIB)
    assert event.artifact.digest == hashlib.sha256(data).hexdigest()
    assert info.digest == event.artifact.digest
    assert bytes(got) == data[:HEAD]
    assert up.thread.is_alive(), "the upload is held: these bytes came while it ran"

    up.go.set()
    for chunk in stream:
        got += chunk.data
    up.thread.join(10)
    assert up.error is None and bytes(got) == data
    assert waiter.fetch("k")[1] == data  # and it is published as usual
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_fetches_while_publishing_total") == 1


def test_wait_and_fetch_returns_the_verified_bytes_of_the_upload(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(6 * MIB)
    released_after(holder, waiter, data, 0.5)
    event, got = waiter.wait_and_fetch("k", 20)
    assert event.decision == pb.HIT and got == data
    assert event.artifact.digest == hashlib.sha256(data).hexdigest()
    reg = coordinator.registry  # streamed from the upload, not fetched after it
    assert reg.get_sample_value("compilecast_coordinator_fetches_while_publishing_total") == 1


def test_a_fetch_can_resume_inside_an_upload(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(5 * MIB)
    lease = holder.acquire("k").lease
    up = HeldUpload(holder, "k", lease, data, coordinator=coordinator)
    digest = hashlib.sha256(data).hexdigest()
    stream = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=digest, offset=HEAD - 100),
                               timeout=30)
    up.go.set()
    got = b"".join(chunk.data for chunk in stream)
    assert got == data[HEAD - 100:]


def test_a_compressible_upload_is_sent_once_committed(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = b"compressible executable " * (300 * 1024)  # stored zstd: not readable in flight
    lease = holder.acquire("k").lease
    waiter.acquire("k")
    up = HeldUpload(holder, "k", lease, data)
    event = waiter.wait("k", 10, publishing=True)  # the upload is announced
    stream = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=event.artifact.digest),
                               timeout=30)
    threading.Timer(0.5, up.go.set).start()
    assert b"".join(chunk.data for chunk in stream) == data


def test_an_upload_cut_short_fails_its_fetchers_and_the_waiter_waits_on(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(6 * MIB)
    lease = holder.acquire("k").lease
    waiter.acquire("k")
    up = HeldUpload(holder, "k", lease, data)
    event = waiter.wait("k", 10, publishing=True)
    stream = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=event.artifact.digest), timeout=30)
    read_until(stream, HEAD)
    up.cut.set()
    with pytest.raises(CALL_ERRORS) as err:
        for _ in stream:
            pass
    assert status_code(err.value) == grpc.StatusCode.UNAVAILABLE
    assert "wait for the key again" in details_of(err.value)
    up.thread.join(10)
    assert up.error is not None
    # The holder gives up; the waiter, still waiting, is promoted to compile.
    holder.release("k", lease, pb.ABANDONED, "died")
    event, got = waiter.wait_and_fetch("k", 20)
    assert event.decision == pb.COMPILE and got is None
    code = None
    try:
        waiter.fetch("k")
    except CALL_ERRORS as exc:
        code = status_code(exc)
    assert code == grpc.StatusCode.NOT_FOUND  # nothing was published


def test_an_upload_whose_bytes_lie_never_verifies_for_its_fetchers(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(5 * MIB)
    lease = holder.acquire("k").lease
    claimed = hashlib.sha256(b"something else").hexdigest()
    up = HeldUpload(holder, "k", lease, data, digest=claimed)
    threading.Timer(0.3, up.go.set).start()
    event, got = waiter.wait_and_fetch("k", 3)
    assert got is None and event.decision != pb.HIT
    up.thread.join(10)
    assert up.error is not None and status_code(up.error) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_fetch_for_another_digest_is_not_served_from_the_upload(coordinator):
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(4 * MIB)
    up = HeldUpload(holder, "k", holder.acquire("k").lease, data, coordinator=coordinator)
    with pytest.raises(CALL_ERRORS) as err:
        waiter.fetch("k", hashlib.sha256(b"other").hexdigest())
    assert status_code(err.value) == grpc.StatusCode.NOT_FOUND
    up.go.set()
    up.thread.join(10)


def test_a_waiter_behind_a_worker_streams_the_upload_too(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    holder = CacheClient(coordinator.cfg.listen, identity=Identity(job="j", process_id=0))
    waiter = CacheClient(worker.cfg.listen, identity=Identity(job="j", process_id=1),
                         timeout_s=10)
    data, up, _, stream, (_, got) = held_and_announced(holder, waiter, 6 * MIB)
    assert up.thread.is_alive()
    up.go.set()
    for chunk in stream:
        got += chunk.data
    assert bytes(got) == data
    up.thread.join(10)
    assert waiter.fetch("k")[1] == data  # now from the worker's host cache


def test_fetchers_past_the_stream_limit_get_the_committed_blob(start_coordinator):
    coordinator = start_coordinator(publish_stream_readers=1)
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(5 * MIB)
    up = HeldUpload(holder, "k", holder.acquire("k").lease, data, coordinator=coordinator)
    digest = hashlib.sha256(data).hexdigest()
    first = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=digest), timeout=30)
    _, got = read_until(first, HEAD)  # the one fetcher streamed in flight
    second: dict = {}

    def read_second():
        stream = waiter.stub.Fetch(pb.FetchRequest(key="k", digest=digest), timeout=30)
        chunks = []
        for c in stream:
            if c.data and not chunks:
                second["first_bytes_while_held"] = not up.go.is_set()
            if c.data:
                chunks.append(c.data)
        second["data"] = b"".join(chunks)

    reader = threading.Thread(target=read_second)
    reader.start()
    reader.join(1.0)  # time enough to stream the head, were it allowed to
    up.go.set()
    for chunk in first:
        got += chunk.data
    reader.join(20)
    assert bytes(got) == data and second["data"] == data
    assert second["first_bytes_while_held"] is False, "the second fetcher waits for the commit"


def test_by_default_waiters_are_not_told_and_fetch_once_published(start_coordinator):
    coordinator = start_coordinator()
    holder, waiter = clients(coordinator.cfg.listen)
    data = os.urandom(4 * MIB)
    released_after(holder, waiter, data, 1.0)
    event = waiter.wait("k", 20, publishing=True)
    # No publishing event: the first event that ends the wait is the published HIT.
    assert event.decision == pb.HIT
    assert waiter.fetch("k", event.artifact.digest)[1] == data


def test_heartbeats_keep_a_fetcher_of_a_held_upload_from_giving_up(
        coordinator, start_worker, monkeypatch):
    """A compressible upload is sent once committed: until then the coordinator
    sends empty chunks, and the worker passes them on, so a fetcher that gives
    up on a transfer silent for 1 s waits through a 2.5 s upload."""
    from compilecast.coordinator import uploads
    from compilecast.worker.daemon import fetches, upstream

    monkeypatch.setattr(uploads, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(fetches, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(upstream, "HEARTBEAT_S", 0.2)
    worker = start_worker(coordinator.cfg.listen)
    holder = CacheClient(coordinator.cfg.listen, identity=Identity(job="j", process_id=0))
    data = b"compressible executable " * (300 * 1024)
    lease = holder.acquire("k").lease
    up = HeldUpload(holder, "k", lease, data, coordinator=coordinator)
    digest = hashlib.sha256(data).hexdigest()
    threading.Timer(2.5, up.go.set).start()
    fetchers = [CacheClient(worker.cfg.listen, stall_s=1.0) for _ in range(2)]
    results = all_at_once([lambda f=f: f.fetch("k", digest)[1] for f in fetchers])
    assert results == [data, data]  # one follows the download, one joined it late or waits
    up.thread.join(10)
    assert up.error is None
    silent = CacheClient(coordinator.cfg.listen, stall_s=1.0)
    monkeypatch.setattr(uploads, "HEARTBEAT_S", 30.0)  # no heartbeats: the same wait stalls
    lease = holder.acquire("k2").lease
    up = HeldUpload(holder, "k2", lease, data, coordinator=coordinator)
    threading.Timer(2.5, up.go.set).start()
    with pytest.raises(CALL_ERRORS) as err:
        silent.fetch("k2", digest)
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "moved nothing for 1s" in details_of(err.value)
    up.thread.join(10)


def test_a_coordinator_that_streams_uploads_takes_the_digest_first_only(
        coordinator, start_coordinator):
    """Its fetchers are told the digest of an upload as it starts, so its
    leases ask for it first (one that does not stream uploads does not ask,
    and its holders hash as they send). A holder that sends it last anyway
    publishes as usual; its upload is not read in flight."""
    plain = CacheClient(start_coordinator().cfg.listen).acquire("o")
    assert plain.decision == pb.COMPILE and plain.lease.takes_digest_last
    holder, waiter = clients(coordinator.cfg.listen)
    lease = holder.acquire("k").lease
    assert not lease.takes_digest_last
    data = os.urandom(6 * MIB)
    up = HeldUpload(holder, "k", lease, data, digest_last=True)
    assert coordinator.state.uploads.get(scope("default", "k")) is None
    up.go.set()
    up.thread.join(30)
    assert up.error is None, up.error
    assert waiter.fetch("k")[1] == data
    lease = holder.acquire("k2").lease
    published = holder.publish("k2", lease, data, 1.0)  # the client sends it first here
    assert published.digest == hashlib.sha256(data).hexdigest()


def fetch_in_thread(client: CacheClient, key: str) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(client.fetch(key)[1])
        except CALL_ERRORS as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("digest_last", [False, True])
@pytest.mark.parametrize("follow", [True, False])
def test_a_process_fetching_what_its_host_publishes_reads_the_workers_copy(
        coordinator, start_worker, follow, digest_last):
    """Holder and waiter on one host: the waiter's fetch, asked while the
    upload goes through their worker, reads the worker's own copy: it follows
    the copy's file as the upload writes it (the digest, when the holder sends
    it last, comes with the fetch's last message), or, a client that does not
    follow files, waits for the copy and reads the file. The worker downloads
    nothing of what it uploads."""
    worker = start_worker(coordinator.cfg.listen)
    holder, waiter = clients(worker.target)
    if not follow:
        waiter.routes.off(Route.GROWING_FILE, "the test does not follow files")
    data = os.urandom(6 * MIB)
    lease = holder.acquire("k").lease
    assert waiter.acquire("k").decision == pb.WAIT
    up = HeldUpload(holder, "k", lease, data, digest_last=digest_last)
    if digest_last:  # (not announced: fetched while the head is in)
        assert up.sent_head.wait(10)
    else:
        assert waiter.wait("k", 10, publishing=True).decision == pb.WAIT
    fetching, out = fetch_in_thread(waiter, "k")
    fetching.join(1.0)
    assert fetching.is_alive() and up.thread.is_alive()  # asked before the upload ended
    if follow:  # following the copy already, the head of the upload read
        assert sample(worker, "compilecast_worker_growing_files_total") == 1
    up.go.set()
    fetching.join(30)
    assert out == [data]
    assert sample(worker, "compilecast_worker_growing_files_total") == int(follow)
    assert sample(worker, "compilecast_worker_local_files_total") == int(not follow)
    assert sample(worker, "compilecast_worker_fetches_total", source="coordinator") == 0


def test_a_fetch_waiting_for_its_hosts_upload_ends_when_the_upload_fails(coordinator,
                                                                         start_worker):
    worker = start_worker(coordinator.cfg.listen)
    holder, waiter = clients(worker.target)
    lease = holder.acquire("k").lease
    assert waiter.acquire("k").decision == pb.WAIT
    up = HeldUpload(holder, "k", lease, os.urandom(6 * MIB))
    assert waiter.wait("k", 10, publishing=True).decision == pb.WAIT
    fetching, out = fetch_in_thread(waiter, "k")
    fetching.join(1.0)
    assert fetching.is_alive()
    up.cut.set()
    fetching.join(30)
    assert not fetching.is_alive()
    assert len(out) == 1 and isinstance(out[0], CALL_ERRORS), out  # never bytes of a cut upload
    assert sample(worker, "compilecast_worker_local_files_total") == 0


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


class HostWaiting:
    """A holder and a waiter of one host (one worker): the waiter in
    wait_and_fetch, its wait registered with the worker, before the holder
    starts to publish (held at its head) with `upload(...)`."""

    def __init__(self, coordinator, start_worker, **worker_kw) -> None:
        self.worker = start_worker(coordinator.cfg.listen, **worker_kw)
        self.holder, waiter = clients(self.worker.target)
        self.lease = self.holder.acquire("k").lease
        assert waiter.acquire("k").decision == pb.WAIT
        self.out: list = []
        self.thread = threading.Thread(
            target=lambda: self.out.append(waiter.wait_and_fetch("k", 60)), daemon=True)
        self.thread.start()
        assert _until(lambda: self.worker.parts.waits.waiting == 1)

    def upload(self, data: bytes) -> HeldUpload:
        return HeldUpload(self.holder, "k", self.lease, data, digest_last=True)

    def result(self) -> tuple[pb.WaitEvent, bytes | None]:
        self.thread.join(60)
        (got,) = self.out
        return got

    def following(self) -> bool:
        return _until(lambda: sample(self.worker, "compilecast_worker_growing_files_total") == 1)


@pytest.mark.parametrize("digest_last", [False, True])
def test_a_hosts_waiters_are_woken_by_its_own_publish_and_follow_it(coordinator, start_worker,
                                                                    digest_last):
    """The worker sees a publish of its own host before the coordinator can
    tell anyone: the host's waiters (until publishing) are woken as it
    begins, and follow the worker's copy while the upload runs, even when
    the holder sends its digest last (the coordinator then announces nothing
    until the end). One upstream wait, never a second."""
    host = HostWaiting(coordinator, start_worker, wake_on_host_publish=True)
    data = os.urandom(6 * MIB)
    up = HeldUpload(host.holder, "k", host.lease, data, digest_last=digest_last)
    assert host.following()  # woken, and following the copy, while the upload is held
    assert up.thread.is_alive() and host.thread.is_alive()
    up.go.set()
    event, got = host.result()
    assert event.decision == pb.HIT and got == data
    assert event.artifact.digest == hashlib.sha256(data).hexdigest()
    worker = host.worker
    assert sample(worker, "compilecast_worker_woken_by_host_publish_total") == 1
    assert sum(sample(worker, "compilecast_worker_waits_total", how=how)  # (or on the job's
               for how in ("upstream", "stream")) == 1                      # stream)
    assert sample(worker, "compilecast_worker_fetches_total", source="coordinator") == 0


def test_a_host_waiter_woken_by_a_publish_that_fails_waits_on(coordinator, start_worker):
    """Woken by its host's publish, following its copy, when the upload is
    cut: the waiter gets no bytes of it and waits on, to the end the holder
    gives the lease (here a refused publish: compile locally)."""
    host = HostWaiting(coordinator, start_worker, wake_on_host_publish=True)
    up = host.upload(os.urandom(6 * MIB))
    assert host.following()
    up.cut.set()
    up.thread.join(30)
    host.holder.release("k", host.lease, pb.PUBLISH_REFUSED, "the upload was cut")
    event, got = host.result()
    assert got is None  # never bytes of the cut upload
    assert event.decision == pb.COMPILE_LOCALLY and "the upload was cut" in event.reason


def test_by_default_a_hosts_waiters_are_woken_when_its_publish_ends(coordinator, start_worker):
    """wake_on_host_publish off (the default): the coordinator's notice ends
    the wait, at the end of a publish whose digest comes last."""
    host = HostWaiting(coordinator, start_worker)
    data = os.urandom(6 * MIB)
    up = host.upload(data)
    assert up.sent_head.wait(10)
    host.thread.join(1.0)
    assert host.thread.is_alive() and host.worker.parts.waits.waiting == 1  # not woken
    up.go.set()
    event, got = host.result()
    assert event.decision == pb.HIT and got == data
    assert sample(host.worker, "compilecast_worker_woken_by_host_publish_total") == 0
