"""Waits carried on over the coordinator's data plane (cache.proto,
DataTicket "CCWAT01"): the Wait call answers with a ticket, the client
blocks in a plain socket's recv, and the coordinator answers there with the
event that ends the wait and, after a HIT, the blob on the same connection.
Every failure ends in what a Wait stream would have given. Real coordinator
and etcd; the protocol tested at the socket too."""

from __future__ import annotations

import os
import socket
import threading

import grpc
import pytest

from compilecast import wire
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, eventually, free_port, recv_exactly, sample, status_code
from .test_data_plane import KINDS, RANDOM, tickets

DATA_WAITS = "compilecast_coordinator_data_plane_waits_total"


def waits(coordinator, result: str) -> float:
    return sample(coordinator, DATA_WAITS, result=result)


def answered(coordinator, result: str, n: int = 1) -> None:
    """The coordinator counts an answer once it is sent, after the client
    may have read it: wait for the count, and for the wait to be let go."""
    eventually(lambda: waits(coordinator, result) == n and coordinator.data_plane.waiting == 0,
               f"{n} wait(s) counted {result}")


class Waiter:
    """`wait_and_fetch` on a thread of its own, as a JAX process's waiter."""

    def __init__(self, client: CacheClient, key: str, timeout_s: float = 30.0) -> None:
        self.result: tuple[pb.WaitEvent, bytes | None] | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = client.wait_and_fetch(key, timeout_s)
            except BaseException as exc:  # handed to the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> tuple[pb.WaitEvent, bytes | None]:
        self.thread.join(60)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.result


def holding(coordinator, key: str) -> tuple[CacheClient, pb.Lease]:
    holder = CacheClient(coordinator.cfg.listen, timeout_s=10)
    resp = holder.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    return holder, resp.lease


def waiting(coordinator, key: str, **kw) -> Waiter:
    """A waiter on `key`, once it is held on the coordinator's data plane."""
    before = coordinator.data_plane.waiting
    waiter = Waiter(CacheClient(coordinator.cfg.listen, timeout_s=10), key, **kw)
    eventually(lambda: coordinator.data_plane.waiting > before, "the wait is on the data plane")
    return waiter


@pytest.mark.parametrize("kind", ["raw", "zstd"])
def test_a_waiter_gets_the_bytes_on_its_wait_connection(coordinator, kind):
    data = KINDS[kind]
    holder, lease = holding(coordinator, "k")
    waiter = waiting(coordinator, "k")
    holder.publish("k", lease, data, 1.0)
    event, got = waiter.join()
    assert event.decision == pb.HIT and got == data
    answered(coordinator, "hit_sent")
    assert tickets(coordinator) == 0  # no Fetch call: the bytes came after the HIT


def test_a_wait_for_a_key_published_meanwhile_is_answered_at_once(coordinator):
    """A key published between the Wait call and the connection: the HIT
    and its bytes come as soon as the client connects."""
    holder, lease = holding(coordinator, "k")
    with grpc.insecure_channel(coordinator.cfg.listen) as ch:
        events = list(wire.stub(ch).Wait(pb.WaitRequest(
            key="k", requester=pb.Requester(client="t"), accept_data_wait=True), timeout=10))
    assert len(events) == 1 and events[0].decision == pb.WAIT
    ticket = events[0].data_ticket
    assert ticket.address == f":{coordinator.data_plane.port}" and len(ticket.token) == 32
    holder.publish("k", lease, RANDOM, 1.0)
    with socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10) as s:
        s.sendall(wire.DATA_PLANE_WAIT + ticket.token)
        head = recv_exactly(s, 5)
        assert head[0] == 0
        event = pb.WaitEvent.FromString(recv_exactly(s, wire.status_length(head, "test")))
        assert event.decision == pb.HIT and event.data_follows
        assert event.artifact.size == len(RANDOM)
        assert recv_exactly(s, 8 + len(RANDOM)) == b"CCRAW01\n" + RANDOM
        assert s.recv(1) == b""  # and then the end
    answered(coordinator, "hit_sent")


def test_a_wait_ticket_is_good_for_one_connection(coordinator):
    holding(coordinator, "k")
    with grpc.insecure_channel(coordinator.cfg.listen) as ch:
        ticket = next(wire.stub(ch).Wait(pb.WaitRequest(
            key="k", requester=pb.Requester(client="t"), timeout_ms=200,
            accept_data_wait=True), timeout=10)).data_ticket
    for magic in (wire.DATA_PLANE_REQUEST, wire.DATA_PLANE_UPLOAD):  # not a fetch's, an upload's
        with socket.create_connection(("127.0.0.1", coordinator.data_plane.port),
                                      timeout=10) as s:
            s.sendall(magic + ticket.token)
            assert s.recv(1) == b""
    with socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10) as s:
        s.sendall(wire.DATA_PLANE_WAIT + ticket.token)
        head = recv_exactly(s, 5)
        event = pb.WaitEvent.FromString(recv_exactly(s, wire.status_length(head, "test")))
    assert event.decision == pb.COMPILE_LOCALLY and "timeout" in event.reason
    with socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10) as s:
        s.sendall(wire.DATA_PLANE_WAIT + ticket.token)  # used
        assert s.recv(1) == b""
    answered(coordinator, "answered")


def test_a_wait_ends_at_its_timeout_with_compile_locally(coordinator):
    holding(coordinator, "k")
    waiter = waiting(coordinator, "k", timeout_s=1.0)
    event, got = waiter.join()
    assert event.decision == pb.COMPILE_LOCALLY and got is None
    assert "share-binary timeout" in event.reason
    answered(coordinator, "answered")


def test_a_waiter_is_promoted_on_its_wait_connection_and_publishes(coordinator):
    holder, lease = holding(coordinator, "k")
    waiter = waiting(coordinator, "k")
    holder.release("k", lease, pb.ABANDONED, "gone")
    event, got = waiter.join()
    assert event.decision == pb.COMPILE and event.lease.id > 0 and got is None
    promoted = CacheClient(coordinator.cfg.listen, timeout_s=10)
    info = promoted.publish("k", event.lease, RANDOM, 1.0)
    assert info.size == len(RANDOM)
    assert promoted.fetch("k")[1] == RANDOM


def test_a_client_that_leaves_ends_its_wait(coordinator):
    """The coordinator stops waiting (and forgets the waiter) when the
    client closes its connection: nothing is left behind."""
    holding(coordinator, "k")
    with grpc.insecure_channel(coordinator.cfg.listen) as ch:
        ticket = next(wire.stub(ch).Wait(pb.WaitRequest(
            key="k", requester=pb.Requester(client="t"), accept_data_wait=True),
            timeout=10)).data_ticket
    s = socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10)
    s.sendall(wire.DATA_PLANE_WAIT + ticket.token)
    eventually(lambda: coordinator.data_plane.waiting == 1, "held")
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 1, "waiting")
    s.close()
    eventually(lambda: coordinator.data_plane.waiting == 0, "let go")
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 0, "forgotten")
    assert waits(coordinator, "left") == 1


def test_a_bad_wait_is_refused_before_any_ticket(coordinator):
    with grpc.insecure_channel(coordinator.cfg.listen) as ch:
        with pytest.raises(CALL_ERRORS) as err:
            list(wire.stub(ch).Wait(pb.WaitRequest(key="no/such key", accept_data_wait=True,
                                                   requester=pb.Requester(client="t")),
                                    timeout=10))
    assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert coordinator.data_plane.waiting == 0


def test_bytes_that_do_not_verify_after_the_wait_are_fetched(coordinator, tmp_path):
    """The client verifies what follows the HIT: a file that changed under
    a trusted entry never reaches the caller, and the artifact is fetched."""
    bad = tmp_path / "bad"
    bad.write_bytes(b"CCRAW01\n" + RANDOM[:-1] + bytes([RANDOM[-1] ^ 1]))
    holder, lease = holding(coordinator, "k")
    waiter = waiting(coordinator, "k")
    coordinator.store.open_trusted = lambda digest: open(bad, "rb")
    holder.publish("k", lease, RANDOM, 1.0)
    event, got = waiter.join()
    assert event.decision == pb.HIT and got == RANDOM
    answered(coordinator, "hit_sent")  # the bad bytes went out, and were refused


def test_an_unreachable_data_plane_waits_and_fetches_over_grpc(start_coordinator):
    """Advertised where nothing listens: the wait goes on over gRPC, the
    bytes come over gRPC, and the client stops asking for the data plane."""
    coordinator = start_coordinator(data_advertise=f"127.0.0.1:{free_port()}")
    holder, lease = holding(coordinator, "k")
    client = CacheClient(coordinator.cfg.listen, timeout_s=10)
    waiter = Waiter(client, "k")
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 1, "waiting")
    holder.publish("k", lease, RANDOM, 1.0)
    event, got = waiter.join()
    assert event.decision == pb.HIT and got == RANDOM
    assert not client.routes.on(Route.DATA_PLANE)
    assert waits(coordinator, "expired") + waits(coordinator, "hit_sent") == 0


def test_without_a_data_plane_the_wait_stays_on_its_stream(start_coordinator, monkeypatch):
    off = start_coordinator(data_listen="off")
    holder, lease = holding(off, "k")
    waiter = Waiter(CacheClient(off.cfg.listen, timeout_s=10), "k")
    eventually(lambda: sample(off, "compilecast_coordinator_waiters") == 1, "waiting")
    holder.publish("k", lease, RANDOM, 1.0)
    event, got = waiter.join()
    assert event.decision == pb.HIT and got == RANDOM
    on = start_coordinator()  # a client told not to use the data plane never asks
    monkeypatch.setenv("COMPILECAST_DATA_PLANE", "0")
    holder, lease = holding(on, "k2")
    waiter = Waiter(CacheClient(on.cfg.listen, timeout_s=10), "k2")
    eventually(lambda: sample(on, "compilecast_coordinator_waiters") == 1, "waiting")
    assert on.data_plane.waiting == 0
    holder.publish("k2", lease, os.urandom(1000), 1.0)
    assert waiter.join()[0].decision == pb.HIT


def test_a_process_told_not_to_waits_on_its_stream(coordinator, monkeypatch):
    monkeypatch.setenv("COMPILECAST_DATA_WAITS", "0")
    holder, lease = holding(coordinator, "k")
    client = CacheClient(coordinator.cfg.listen, timeout_s=10)
    waiter = Waiter(client, "k")
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 1, "waiting")
    assert coordinator.data_plane.waiting == 0
    holder.publish("k", lease, RANDOM, 1.0)
    event, got = waiter.join()
    assert event.decision == pb.HIT and got == RANDOM
    assert client.routes.on(Route.DATA_PLANE) and tickets(coordinator) == 1  # fetched: over the data plane
    assert waits(coordinator, "hit_sent") == 0


def test_past_the_limit_a_wait_stays_on_its_stream(coordinator, monkeypatch):
    from compilecast.coordinator import dataplane

    monkeypatch.setattr(dataplane, "MAX_WAITS", 1)
    holder, lease = holding(coordinator, "k")
    first = waiting(coordinator, "k")
    second = Waiter(CacheClient(coordinator.cfg.listen, timeout_s=10), "k")
    eventually(lambda: sample(coordinator, "compilecast_coordinator_waiters") == 2, "both wait")
    assert coordinator.data_plane.waiting == 1
    holder.publish("k", lease, RANDOM, 1.0)
    assert first.join()[1] == RANDOM and second.join()[1] == RANDOM
    answered(coordinator, "hit_sent")
    assert tickets(coordinator) == 1  # the second fetched
