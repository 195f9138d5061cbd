"""Publishes over the coordinator's data plane (coordinator/dataplane.py,
OpenUpload): the lease holder gets a one-time upload ticket over the
authenticated gRPC call, sends the bytes over plain TCP, and the coordinator
publishes them exactly as a Publish stream with the same header. Refusals
come back with the status a Publish would have ended with; a broken or
unreachable data plane ends in a publish over gRPC. Real coordinator and
etcd; tickets and frames also tested at the socket."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import time

import grpc
import pytest

from compilecast import negotiate, retry, wire
from compilecast.coordinator import dataplane
from compilecast.coordinator.records import scope
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import (
    CALL_ERRORS,
    details_of,
    eventually,
    free_port,
    recv_exactly,
    sample,
    status_code,
)

DATA = os.urandom(5 << 20)  # several CHUNKs, stored raw
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture(autouse=True)
def uploads_of_any_size(monkeypatch):
    """DATA is below the size from which publishes take the data plane."""
    monkeypatch.setattr(negotiate, "UPLOAD_FROM", 0)


def uploads(coordinator, result: str = "published") -> float:
    return sample(coordinator, "compilecast_coordinator_data_plane_uploads_total", result=result)


def bytes_in(coordinator) -> float:
    return sample(coordinator, "compilecast_coordinator_artifact_bytes_total", direction="in")


def holder(coordinator, key: str = "k") -> tuple[CacheClient, pb.Lease]:
    c = CacheClient(coordinator.cfg.listen, timeout_s=10, identity=Identity(job="j"))
    resp = c.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    return c, resp.lease


def header(c: CacheClient, key: str, lease: pb.Lease, data: bytes = DATA,
           digest: str = "") -> pb.PublishHeader:
    return pb.PublishHeader(key=key, lease=lease, size=len(data), digest=digest,
                            compile_time_seconds=2.0, requester=c.identity.requester())


def open_upload(c: CacheClient, h: pb.PublishHeader) -> pb.DataTicket:
    resp = c.stub.OpenUpload(pb.OpenUploadRequest(header=h), timeout=10)
    assert resp.HasField("ticket")
    return resp.ticket


def frame(s: socket.socket) -> tuple[int, bytes]:
    head = recv_exactly(s, 5)
    return head[0], recv_exactly(s, int.from_bytes(head[1:], "big"))


def connect(coordinator, token: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10)
    s.sendall(wire.DATA_PLANE_UPLOAD + token)
    return s


def still_held(coordinator, c: CacheClient, key: str, lease: pb.Lease) -> bool:
    return c.keepalive(key, lease) > 0


def refused_while_sending(coordinator, c: CacheClient, lease: pb.Lease) -> grpc.RpcError:
    """The error of `c`'s publish of more than the socket buffers take,
    which the coordinator refuses after its first piece (over its limit)."""
    artifacts = coordinator.state.artifacts
    real, settings = artifacts.publish, artifacts.settings

    async def over_the_limit(header, chunks, *, tenant):
        artifacts.settings = dataclasses.replace(settings, max_artifact_bytes=1024)
        try:
            return await real(header, chunks, tenant=tenant)
        finally:
            artifacts.settings = dataclasses.replace(settings, max_artifact_bytes=1 << 40)

    coordinator.state.artifacts.publish = over_the_limit
    try:
        with pytest.raises(CALL_ERRORS) as err:
            c.publish("k", lease, DATA * 13, 2.0)
    finally:
        coordinator.state.artifacts.publish = real
    return err.value


def breaking_after_a_piece(monkeypatch) -> None:
    """The coordinator's reading thread of an upload fails after a first piece."""
    real = dataplane._receive
    calls = []

    def breaking(sock, n):
        calls.append(n)
        if len(calls) == 2:
            raise ConnectionResetError("reset by a test")
        return real(sock, n)

    monkeypatch.setattr(dataplane, "_receive", breaking)


@pytest.mark.parametrize("digest_first", [False, True])
def test_a_publish_goes_over_the_data_plane(coordinator, digest_first):
    c, lease = holder(coordinator)
    lease.takes_digest_last = not digest_first  # else the digest in the header
    info = c.publish("k", lease, DATA, 2.0)
    assert info.digest == DIGEST and info.size == len(DATA)
    assert uploads(coordinator) == 1 and bytes_in(coordinator) == len(DATA)
    assert c.routes.on(Route.DATA_PLANE) and c.routes.on(Route.UPLOAD_TICKET)
    other = CacheClient(coordinator.cfg.listen, timeout_s=10)
    assert other.fetch("k")[1] == DATA
    assert other.acquire("k").decision == pb.HIT
    assert not still_held(coordinator, c, "k", lease)  # the publish ended the lease


def test_a_ticket_goes_only_to_the_lease_holder_with_a_publishable_header(coordinator):
    """OpenUpload refuses what a Publish stream refuses before its first
    byte, with the same status: no ticket is issued."""
    c, lease = holder(coordinator)
    forged = pb.Lease(id=lease.id + 1, ttl_seconds=lease.ttl_seconds, revision=lease.revision)
    c.publish("k", lease, DATA, 2.0)
    c2, lease2 = holder(coordinator, "k2")
    for h, code in [(header(c2, "k2", forged), grpc.StatusCode.FAILED_PRECONDITION),
                    (header(c2, "nobody", lease2), grpc.StatusCode.FAILED_PRECONDITION),
                    (header(c, "k", lease), grpc.StatusCode.FAILED_PRECONDITION),  # published
                    (header(c2, "k2", lease2, digest="not-a-digest"),
                     grpc.StatusCode.INVALID_ARGUMENT),
                    (header(c2, "bad key!", lease2), grpc.StatusCode.INVALID_ARGUMENT)]:
        with pytest.raises(CALL_ERRORS) as err:
            c2.stub.OpenUpload(pb.OpenUploadRequest(header=h), timeout=10)
        assert status_code(err.value) == code, (h, details_of(err.value))
        with pytest.raises(CALL_ERRORS) as streamed:
            c2.publisher._send(h, DATA)  # the same header as a Publish stream
        assert status_code(streamed.value) == code
    assert uploads(coordinator) == 1  # k's
    assert still_held(coordinator, c2, "k2", lease2)


def test_a_ticket_is_good_for_one_connection_and_a_few_seconds(coordinator, monkeypatch):
    c, lease = holder(coordinator)
    ticket = open_upload(c, header(c, "k", lease, digest=DIGEST))
    with connect(coordinator, ticket.token) as s:
        assert frame(s) == (0, b"")  # go
        s.sendall(DATA)
        code, payload = frame(s)
    assert code == 0 and pb.PublishResponse.FromString(payload).artifact.digest == DIGEST
    with connect(coordinator, ticket.token) as s:  # used
        assert s.recv(1) == b""
    c2, lease2 = holder(coordinator, "k2")
    monkeypatch.setattr(dataplane, "TICKET_S", -1.0)  # expired as it is issued
    late = open_upload(c2, header(c2, "k2", lease2, digest=DIGEST))
    with connect(coordinator, late.token) as s:  # expired
        assert s.recv(1) == b""
    assert uploads(coordinator) == 1 and uploads(coordinator, "expired") == 1
    assert still_held(coordinator, c2, "k2", lease2)


def test_bytes_that_do_not_match_their_digest_are_refused_and_nothing_is_stored(coordinator):
    c, lease = holder(coordinator)
    bad = DATA[:-1] + bytes([DATA[-1] ^ 1])
    ticket = open_upload(c, header(c, "k", lease))  # the digest comes after the bytes
    with connect(coordinator, ticket.token) as s:
        assert frame(s)[0] == 0
        s.sendall(bad + DIGEST.encode())
        code, message = frame(s)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"digest mismatch" in message
    assert uploads(coordinator, "refused") == 1 and uploads(coordinator) == 0
    assert not coordinator.store.path_of(DIGEST).exists()
    assert not coordinator.store.path_of(hashlib.sha256(bad).hexdigest()).exists()
    # The lease still holds: the real bytes are published under it.
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST


def test_a_digest_after_the_bytes_that_is_not_one_is_refused(coordinator):
    c, lease = holder(coordinator)
    ticket = open_upload(c, header(c, "k", lease))
    with connect(coordinator, ticket.token) as s:
        assert frame(s)[0] == 0
        s.sendall(DATA + b"z" * 64)
        code, _ = frame(s)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert still_held(coordinator, c, "k", lease)


def test_an_upload_cut_short_or_stalled_publishes_nothing(coordinator, monkeypatch):
    monkeypatch.setattr(dataplane, "UPLOAD_STALL_S", 0.3)
    c, lease = holder(coordinator)
    h = header(c, "k", lease, digest=DIGEST)
    with connect(coordinator, open_upload(c, h).token) as s:
        assert frame(s)[0] == 0
        s.sendall(DATA[:len(DATA) // 2])  # and the connection ends
    with connect(coordinator, open_upload(c, h).token) as s:
        assert frame(s)[0] == 0
        s.sendall(DATA[:100])  # and then nothing: given up after UPLOAD_STALL_S
        assert s.recv(1) == b""
    deadline = time.monotonic() + 10
    while uploads(coordinator, "broken") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploads(coordinator, "broken") == 2 and uploads(coordinator) == 0
    assert not coordinator.store.path_of(DIGEST).exists()
    with pytest.raises(CALL_ERRORS) as err:
        CacheClient(coordinator.cfg.listen).fetch("k")
    assert status_code(err.value) == grpc.StatusCode.NOT_FOUND
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST


def test_a_client_whose_upload_breaks_publishes_over_grpc(coordinator, monkeypatch):
    """The connection breaks midway (here: the coordinator's reading thread
    fails after a first piece): the client publishes the same bytes again
    over gRPC under the same lease, and keeps the data plane for later."""
    real = dataplane._receive
    breaking_after_a_piece(monkeypatch)
    monkeypatch.setattr(retry, "PUBLISH", dataclasses.replace(retry.PUBLISH, pauses=(0.0, 0.0)))
    c, lease = holder(coordinator)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert uploads(coordinator, "broken") == 1 and uploads(coordinator) == 0
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == DATA
    assert c.routes.on(Route.DATA_PLANE) and c.routes.on(Route.UPLOAD_TICKET)
    monkeypatch.setattr(dataplane, "_receive", real)
    c2, lease2 = holder(coordinator, "k2")
    c2.publish("k2", lease2, DATA[::-1], 2.0)
    assert uploads(coordinator) == 1


def test_a_refused_upload_is_the_error_a_publish_would_raise(coordinator):
    """Refused at the upload (after the ticket): the client raises the
    status of the refusal, as a Publish stream's would be, and does not
    publish over gRPC instead."""
    c, lease = holder(coordinator)
    err = refused_while_sending(coordinator, c, lease)
    assert status_code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert uploads(coordinator, "refused") == 1 and bytes_in(coordinator) == 0


def test_without_a_data_plane_publishes_go_over_grpc(start_coordinator):
    off = start_coordinator(data_listen="off")
    c, lease = holder(off)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert not c.routes.on(Route.UPLOAD_TICKET)  # not asked again
    assert bytes_in(off) == len(DATA)
    resp = c.stub.OpenUpload(pb.OpenUploadRequest(header=header(c, "k", lease)), timeout=10)
    assert not resp.HasField("ticket")


def test_an_unreachable_data_plane_publishes_over_grpc(start_coordinator):
    coordinator = start_coordinator(data_advertise=f"127.0.0.1:{free_port()}")
    c, lease = holder(coordinator)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert not c.routes.on(Route.DATA_PLANE)  # nor fetches: the data plane cannot be reached from here
    assert uploads(coordinator, "expired") + uploads(coordinator) == 0
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == DATA


def test_a_stop_ends_an_upload_that_waits_for_bytes(start_coordinator):
    """A coordinator stopping while an upload's thread waits on the
    connection wakes it and closes the connection at once (not after
    UPLOAD_STALL_S): a stop does not hang on it, nor keep the client waiting."""
    coordinator = start_coordinator()
    c, lease = holder(coordinator)
    s = connect(coordinator, open_upload(c, header(c, "k", lease, digest=DIGEST)).token)
    with s:
        assert frame(s)[0] == 0
        s.sendall(DATA[:100])  # and then nothing
        sk = scope("default", "k")
        eventually(lambda: coordinator.state.uploads.get(sk) is not None,
                   "the upload under way, its thread waiting for a chunk")
        coordinator.stop()
        s.settimeout(dataplane.UPLOAD_STALL_S / 2)
        assert s.recv(1) == b""  # closed by the stop, not by the upload's stall limit


def test_a_small_publish_goes_over_grpc(coordinator, monkeypatch):
    """Below negotiate.UPLOAD_FROM the upload's round trips cost more than
    they save: no ticket is asked for, and the data plane stays on."""
    monkeypatch.setattr(negotiate, "UPLOAD_FROM", len(DATA) + 1)
    c, lease = holder(coordinator)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert uploads(coordinator) == 0 and bytes_in(coordinator) == len(DATA)
    assert c.routes.on(Route.DATA_PLANE) and c.routes.on(Route.UPLOAD_TICKET)
    monkeypatch.setattr(negotiate, "UPLOAD_FROM", len(DATA))
    c2, lease2 = holder(coordinator, "k2")
    c2.publish("k2", lease2, DATA, 2.0)
    assert uploads(coordinator) == 1


def test_with_too_many_tickets_out_a_publish_goes_over_grpc_this_time(coordinator,
                                                                    monkeypatch):
    monkeypatch.setattr(dataplane, "MAX_TICKETS", 0)
    c, lease = holder(coordinator)
    with pytest.raises(CALL_ERRORS) as err:
        c.stub.OpenUpload(pb.OpenUploadRequest(header=header(c, "k", lease)), timeout=10)
    assert status_code(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert uploads(coordinator) == 0 and bytes_in(coordinator) == len(DATA)
    assert c.routes.on(Route.UPLOAD_TICKET)  # asked again next time
    monkeypatch.setattr(dataplane, "MAX_TICKETS", 4096)
    c2, lease2 = holder(coordinator, "k2")
    c2.publish("k2", lease2, DATA, 2.0)
    assert uploads(coordinator) == 1


def test_an_upload_from_a_process_with_many_files_open(coordinator):
    """The client's check for an early answer works on a descriptor past
    select()'s limit of 1024, as a big JAX process may have."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:  # the upload's socket comes after these
            held.append(os.open(os.devnull, os.O_RDONLY))
        c, lease = holder(coordinator)
        assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
        assert uploads(coordinator) == 1
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# A worker's publishes upstream: a host's holder publishes through its worker,
# which sends the bytes on over the coordinator's data plane (raw ones; a
# zstd stream it packed goes over gRPC) and keeps its copy.

def through_worker(start_worker, coordinator, key: str = "k", **kw):
    w = start_worker(coordinator.cfg.listen, **kw)
    c = CacheClient(w.target, timeout_s=10, identity=Identity(job="j"))
    resp = c.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    return w, c, resp.lease


@pytest.mark.parametrize("digest_first", [False, True])
def test_a_worker_sends_a_publish_on_over_the_data_plane(coordinator, start_worker,
                                                         digest_first):
    w, c, lease = through_worker(start_worker, coordinator)
    lease.takes_digest_last = not digest_first  # else the digest in the header
    info = c.publish("k", lease, DATA, 2.0)
    assert info.digest == DIGEST and info.size == len(DATA)
    assert uploads(coordinator) == 1
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == DATA
    assert w.cache.store.has(DIGEST)  # the worker's copy: this host hits locally
    assert CacheClient(w.target).fetch("k")[1] == DATA


def test_a_zstd_stream_a_worker_packs_goes_over_grpc(coordinator, start_worker):
    data = b"compressible " * (len(DATA) // 13)
    w, c, lease = through_worker(start_worker, coordinator)
    info = c.publish("k", lease, data, 2.0)
    assert uploads(coordinator) == 0 and bytes_in(coordinator) < len(data) // 10
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == data
    assert info.digest == hashlib.sha256(data).hexdigest() and w.cache.store.has(info.digest)


def test_a_worker_whose_upload_breaks_sends_the_retry_over_grpc(coordinator, start_worker,
                                                                monkeypatch):
    """The coordinator's reading thread fails after a first piece: the
    holder hears UNAVAILABLE from its worker and tries again, which the
    worker sends over gRPC; later publishes take the data plane again."""
    real = dataplane._receive
    breaking_after_a_piece(monkeypatch)
    monkeypatch.setattr(retry, "PUBLISH", dataclasses.replace(retry.PUBLISH, pauses=(0.0, 0.0)))
    w, c, lease = through_worker(start_worker, coordinator)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert uploads(coordinator, "broken") == 1 and uploads(coordinator) == 0
    assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == DATA
    monkeypatch.setattr(dataplane, "_receive", real)
    resp = c.acquire("k2")
    c.publish("k2", resp.lease, DATA[::-1], 2.0)
    assert uploads(coordinator) == 1 and w.parts.routes.on(Route.UPLOAD_TICKET)


def test_an_upload_a_worker_sends_refused_is_the_holders_error(coordinator, start_worker):
    """Refused after the ticket, while the worker is still sending: the
    holder gets the coordinator's status through its worker, nothing is
    published, and the worker keeps no copy."""
    w, c, lease = through_worker(start_worker, coordinator)
    err = refused_while_sending(coordinator, c, lease)
    assert status_code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED and "1024" in details_of(err)
    assert uploads(coordinator, "refused") == 1 and bytes_in(coordinator) == 0
    assert w.cache.store.count() == 0


def test_a_worker_publishes_over_grpc_where_the_coordinator_takes_no_uploads(
        start_coordinator, start_worker):
    off = start_coordinator(data_listen="off")
    w, c, lease = through_worker(start_worker, off)
    assert c.publish("k", lease, DATA, 2.0).digest == DIGEST
    assert bytes_in(off) == len(DATA)
    assert not w.parts.routes.on(Route.UPLOAD_TICKET)  # not asked again
    resp = c.acquire("k2")
    c.publish("k2", resp.lease, DATA[::-1], 2.0)
    assert bytes_in(off) == 2 * len(DATA)
