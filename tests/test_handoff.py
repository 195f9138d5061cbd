"""Publishes handed to the host's worker as sealed memory files
(worker/daemon/handoff.py): the holder asks its worker for a ticket (OpenUpload),
writes the bytes into a memfd, seals it and passes it over the worker's
handoff socket; the worker publishes it as a Publish stream's chunks. A file
that could still change, or of another size, is refused; a ticket serves one
handoff; refusals upstream reach the holder; anything that fails before the
handoff ends in a publish over gRPC. Real worker, coordinator and etcd; the
handoff's frames also tested at the socket."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import socket

import grpc
import pytest

from compilecast import negotiate, retry, wire
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon import handoff
from compilecast.worker.inprocess import clientpublish as client_mod
from compilecast.worker.inprocess import routeends
from compilecast.worker.inprocess.client import CacheClient, Identity
from compilecast.worker.inprocess.handoff import SEALS, handoff_supported, memory_headroom

from .conftest import CALL_ERRORS, details_of, recv_exactly, sample, status_code

pytestmark = pytest.mark.skipif(not handoff_supported(), reason="no memfd seals here")

DATA = os.urandom(5 << 20)
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture(autouse=True)
def handoffs_of_any_size(monkeypatch):
    """DATA is below the size from which publishes are handed over."""
    monkeypatch.setattr(negotiate, "UPLOAD_FROM", 0)


@pytest.fixture
def no_grpc_publish(monkeypatch):
    """A client whose publish over gRPC fails the test: it must hand over."""
    def refused(self, header, data):
        raise AssertionError("published over gRPC")

    monkeypatch.setattr(client_mod.Publisher, "_send", refused)


def handoffs(worker, result: str = "published") -> float:
    return sample(worker, "compilecast_worker_handoffs_total", result=result)


def holder(worker, key: str = "k") -> tuple[CacheClient, pb.Lease]:
    c = CacheClient(worker.target, timeout_s=10, identity=Identity(job="j"))
    resp = c.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    return c, resp.lease


def ticket(c: CacheClient, lease: pb.Lease, key: str = "k", size: int = len(DATA)):
    h = pb.PublishHeader(key=key, lease=lease, size=size, compile_time_seconds=1.0,
                         requester=c.identity.requester())
    resp = c.stub.OpenUpload(pb.OpenUploadRequest(header=h), timeout=10)
    assert resp.HasField("ticket") and resp.ticket.address.startswith("unix:")
    return resp.ticket


def hand(t: pb.DataTicket, fd: int, token: bytes | None = None) -> tuple[int, bytes] | None:
    """Hand `fd` over with the ticket's token: the first frame that is not a
    heartbeat; None when the worker closed the connection without one."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(t.address.removeprefix("unix:"))
        socket.send_fds(s, [wire.DATA_PLANE_HANDOFF + (token or t.token)], [fd])
        while True:
            if not s.recv(1, socket.MSG_PEEK):
                return None
            head = recv_exactly(s, 5)
            payload = recv_exactly(s, int.from_bytes(head[1:], "big"))
            if head[0] or payload:
                return head[0], payload


def memfd(data: bytes, seals: int = SEALS) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("digest_first", [False, True])
def test_a_publish_is_handed_to_the_worker(coordinator, start_worker, no_grpc_publish,
                                           digest_first):
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    lease.takes_digest_last = not digest_first  # else the digest in the header
    info = c.publish("k", lease, DATA, 2.0)
    assert info.digest == DIGEST and info.size == len(DATA)
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == DATA
    assert w.cache.store.has(DIGEST)  # the worker's copy
    assert CacheClient(w.target).fetch("k")[1] == DATA
    # ... and the worker sent it on over the coordinator's data plane
    assert sample(coordinator, "compilecast_coordinator_data_plane_uploads_total",
                  result="published") == 1
    assert handoffs(w) == 1


def test_a_file_that_can_still_change_is_refused(coordinator, start_worker):
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    for seals in (0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
        fd = memfd(DATA, seals)
        try:
            code, msg = hand(ticket(c, lease), fd)
        finally:
            os.close(fd)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"not sealed" in msg
    assert not w.cache.store.has(DIGEST) and handoffs(w, "refused") == 2
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST  # the lease still holds


def test_a_file_of_another_size_than_its_header_is_refused(coordinator, start_worker):
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    fd = memfd(DATA)
    try:
        code, msg = hand(ticket(c, lease, size=len(DATA) + 1), fd)
    finally:
        os.close(fd)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"header says" in msg


def test_a_ticket_serves_one_handoff_and_only_its_token(coordinator, start_worker):
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    t = ticket(c, lease)
    fd = memfd(DATA)
    try:
        assert hand(t, fd, token=bytes(len(t.token))) is None  # closed without a byte
        code, payload = hand(t, fd)
        assert code == 0 and pb.PublishResponse.FromString(payload).artifact.digest == DIGEST
        assert hand(t, fd) is None  # again
    finally:
        os.close(fd)
    assert handoffs(w, "unknown_ticket") == 2 and handoffs(w) == 1


def test_a_refusal_upstream_reaches_the_holder(coordinator, start_worker):
    """The coordinator refuses (here: the key was published meanwhile by
    another holder's lease): the holder hears its status through the worker,
    and the worker keeps no copy."""
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    stale = pb.Lease()
    stale.CopyFrom(lease)
    stale.id += 1  # not a lease the coordinator granted
    with pytest.raises(CALL_ERRORS) as err:
        c.publish("k", stale, DATA, 2.0)
    assert status_code(err.value) == grpc.StatusCode.FAILED_PRECONDITION, details_of(err.value)
    assert not w.cache.store.has(DIGEST)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST


def test_an_expired_ticket_ends_in_a_publish_over_grpc(coordinator, start_worker,
                                                      monkeypatch):
    """The worker closes the connection of a ticket it no longer holds: the
    holder tries again over gRPC, under the same lease."""
    monkeypatch.setattr(handoff, "TICKET_S", -1.0)
    monkeypatch.setattr(retry, "PUBLISH", dataclasses.replace(retry.PUBLISH, pauses=(0.0, 0.0)))
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert handoffs(w, "unknown_ticket") == 1 and handoffs(w) == 0
    assert w.cache.store.has(DIGEST)


def test_heartbeats_keep_a_slow_publish_waiting(coordinator, start_worker, monkeypatch,
                                                no_grpc_publish):
    """The holder reads with a stall limit shorter than the publish takes:
    the worker's empty frames meanwhile keep it from giving up."""
    monkeypatch.setattr(handoff, "HEARTBEAT_S", 0.05)
    w = start_worker(coordinator.cfg.listen)
    real = w.parts.publishes.publish_handoff

    async def slow(*args):
        import asyncio
        await asyncio.sleep(1.0)
        return await real(*args)

    w.parts.publishes.handoffs._publish = slow
    c, lease = holder(w)
    c.publisher.stall_s = 0.5
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST


def test_without_the_handoff_socket_a_publish_goes_over_grpc(coordinator, start_worker):
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    os.unlink(w.parts.publishes.handoffs.path)  # a container that does not see it, say
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert not c.routes.on(Route.HANDOFF)  # not tried again
    assert w.cache.store.has(DIGEST)


def test_a_worker_on_tcp_takes_no_handoffs(coordinator, start_worker):
    from .conftest import free_port

    w = start_worker(coordinator.cfg.listen, listen=f"127.0.0.1:{free_port()}")
    assert w.parts.publishes.handoffs is None
    c = CacheClient(w.target, timeout_s=10, identity=Identity(job="j"))
    assert not c.routes.on(Route.HANDOFF)
    resp = c.stub.OpenUpload(pb.OpenUploadRequest(header=pb.PublishHeader(key="k")),
                             timeout=10)
    assert not resp.HasField("ticket")


def test_near_a_memory_limit_a_publish_goes_over_grpc(coordinator, start_worker, monkeypatch):
    """A handed file holds the bytes a second time: with less memory left
    than that (and a margin), the holder sends them in pieces instead."""
    w = start_worker(coordinator.cfg.listen)
    c, lease = holder(w)
    monkeypatch.setattr(routeends, "memory_headroom", lambda: len(DATA) * 2)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert handoffs(w) == 0 and w.cache.store.has(DIGEST)
    assert not w.parts.publishes.handoffs._tickets  # none asked for
    assert c.routes.on(Route.HANDOFF)  # asked again next time
    monkeypatch.setattr(routeends, "memory_headroom", lambda: None)  # unknown: hand over
    resp = c.acquire("k2")
    c.publish("k2", resp.lease, DATA[::-1], 2.0)
    assert handoffs(w) == 1


def fake_system(tmp_path, cgroup_line: str, files: dict[str, str], available_kb: int):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        (cg / name).parent.mkdir(parents=True, exist_ok=True)
        (cg / name).write_text(text)
    return str(proc), str(cg)


def test_memory_headroom_reads_cgroup_v2_and_v1(tmp_path):
    mib = 1 << 20
    v2 = fake_system(tmp_path / "v2", "0::/pod/c1", {
        "pod/c1/memory.max": f"{1024 * mib}\n", "pod/c1/memory.current": f"{900 * mib}\n",
        "pod/c1/memory.stat": f"anon 1\ninactive_file {100 * mib}\nactive_file 5\n"},
        available_kb=8 << 20)
    assert memory_headroom(*v2) == 224 * mib  # 1024 - (900 - 100)
    v1 = fake_system(tmp_path / "v1", "4:memory:/job", {
        "memory/job/memory.limit_in_bytes": f"{2048 * mib}\n",
        "memory/job/memory.usage_in_bytes": f"{1024 * mib}\n",
        "memory/job/memory.stat": f"cache 7\ntotal_inactive_file {24 * mib}\n"},
        available_kb=512 << 10)  # the host has less left than the cgroup: it decides
    assert memory_headroom(*v1) == 512 * mib
    unlimited = fake_system(tmp_path / "none", "0::/", {
        "memory.max": "max\n", "memory.current": "5\n", "memory.stat": ""},
        available_kb=3 << 20)
    assert memory_headroom(*unlimited) == 3 << 30
    assert memory_headroom(str(tmp_path / "absent"), str(tmp_path)) is None


def test_a_worker_whose_handoff_socket_cannot_be_made_serves_publishes_over_grpc(
        coordinator, start_worker):
    """A socket path with no room for `.handoff` (108 bytes at most): the
    worker starts all the same, and offers no handoffs."""
    path = f"/tmp/cc-{os.getpid()}-" + "x" * 80
    path += "y" * (95 - len(path)) + ".sock"  # 100 bytes: 108 with .handoff
    w = start_worker(coordinator.cfg.listen, listen=f"unix://{path}")
    try:
        assert w.parts.publishes.handoffs is None
        c, lease = holder(w)
        assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
        assert not c.routes.on(Route.UPLOAD_TICKET)  # no ticket offered: not asked again
    finally:
        w.stop()


def test_a_worker_that_stops_mid_publish_leaves_the_holder_an_error(coordinator,
                                                                    start_worker,
                                                                    monkeypatch):
    """The worker stops while it publishes a handed file: the holder hears
    the connection close, tries again (over gRPC, to a worker that is gone)
    and gets UNAVAILABLE: an error, not a hang."""
    import asyncio
    import threading

    monkeypatch.setattr(handoff, "STOP_GRACE_S", 0.1)
    monkeypatch.setattr(retry, "PUBLISH", dataclasses.replace(retry.PUBLISH, pauses=(0.0, 0.0)))
    w = start_worker(coordinator.cfg.listen)
    began = threading.Event()

    async def stuck(*args):
        began.set()
        await asyncio.sleep(3600)

    w.parts.publishes.handoffs._publish = stuck
    c, lease = holder(w)
    threading.Thread(target=lambda: began.wait(10) and w.stop(), daemon=True).start()
    with pytest.raises(CALL_ERRORS) as err:
        c.publish("k", lease, DATA, 2.0)
    assert status_code(err.value) == grpc.StatusCode.UNAVAILABLE
    assert began.is_set()


def test_a_hosts_waiters_follow_a_handed_publish(coordinator, start_worker):
    """With wake_on_host_publish, a publish handed over wakes the host's
    waiters as it begins, as a Publish stream through the worker does, and
    they take the worker's copy: nothing comes from the coordinator."""
    import asyncio

    from .test_streaming_publish import HostWaiting

    host = HostWaiting(coordinator, start_worker, wake_on_host_publish=True)
    w = host.worker
    real = w.parts.publishes.publish_handoff

    async def slowly(ns, md, header, chunks):
        async def paced():
            async for chunk in chunks:
                yield chunk
                await asyncio.sleep(0.1)

        return await real(ns, md, header, paced())

    w.parts.publishes.handoffs._publish = slowly
    assert host.holder.publish("k", host.lease, DATA, 2.0).digest == DIGEST
    event, got = host.result()
    assert event.decision == pb.HIT and got == DATA
    assert handoffs(w) == 1
    assert sample(w, "compilecast_worker_woken_by_host_publish_total") == 1
    assert sample(w, "compilecast_worker_fetches_total", source="coordinator") == 0
