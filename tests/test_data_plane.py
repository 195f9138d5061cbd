"""Whole artifacts from the coordinator over its data plane
(coordinator/dataplane.py): a fetch answered with a one-time ticket, the
stored blob sent with sendfile over plain TCP, read straight into the
result and verified by the client. Every failure (a refused or unreachable
data plane, bytes that do not verify) ends in the same verified bytes over
gRPC. Real coordinator and etcd; tickets and connections tested at the
socket."""

from __future__ import annotations

import hashlib
import os
import socket

import grpc
import pytest

from compilecast import wire
from compilecast.coordinator import dataplane
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient
from compilecast.worker.inprocess.dataplane import data_plane_address

from .conftest import coordinator_config, eventually, free_port, publish, sample

RANDOM = os.urandom(6 << 20)  # stored raw (incompressible)
COMPRESSIBLE = b"".join(os.urandom(96) + bytes(928) for _ in range(6 << 10))  # stored as zstd
KINDS = {"raw": RANDOM, "zstd": COMPRESSIBLE, "small-raw": RANDOM[:300_000],
         "small-zstd": COMPRESSIBLE[:300_000]}


def sends(coordinator, result: str = "sent") -> float:
    return sample(coordinator, "compilecast_coordinator_data_plane_sends_total", result=result)


def tickets(coordinator) -> float:
    return sample(coordinator, "compilecast_coordinator_data_tickets_total")


def bytes_out(coordinator) -> float:
    return sample(coordinator, "compilecast_coordinator_artifact_bytes_total", direction="out")


def published(coordinator, key: str, data: bytes) -> CacheClient:
    publish(CacheClient(coordinator.cfg.listen, timeout_s=10), key, data)
    return CacheClient(coordinator.cfg.listen, timeout_s=10)


def ticket_for(coordinator, key: str, **request) -> tuple[pb.ArtifactInfo, pb.DataTicket | None]:
    """Ask as a client would, by hand: the header and the ticket, if any."""
    with grpc.insecure_channel(coordinator.cfg.listen) as ch:
        chunks = list(wire.stub(ch).Fetch(pb.FetchRequest(key=key, accept_data_ticket=True,
                                                          **request), timeout=10))
    head = chunks[0]
    return head.artifact, head.data_ticket if head.HasField("data_ticket") else None


def redeem(coordinator, token: bytes, magic: bytes = wire.DATA_PLANE_REQUEST) -> bytes:
    """Everything the data plane sends for `token` until it closes."""
    with socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10) as s:
        s.sendall(magic + token)
        out = bytearray()
        try:
            while piece := s.recv(1 << 20):
                out += piece
        except ConnectionResetError:  # closed with our token unread: a reset, not a FIN
            pass
        return bytes(out)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fetch_takes_the_stored_blob_over_the_data_plane(coordinator, kind):
    data = KINDS[kind]
    client = published(coordinator, "k", data)
    assert client.routes.on(Route.DATA_PLANE)  # a plaintext TCP coordinator
    info, got = client.fetch("k")
    assert got == data and info.size == len(data)
    assert tickets(coordinator) == 1 and sends(coordinator) == 1
    stored = os.path.getsize(coordinator.store.path_of(info.digest))
    assert bytes_out(coordinator) == stored  # the file as stored, and nothing over gRPC
    assert client.routes.on(Route.DATA_PLANE)


def test_a_ticket_is_good_for_one_connection(coordinator):
    published(coordinator, "k", RANDOM)
    info, ticket = ticket_for(coordinator, "k", accept_zstd=True)
    assert ticket is not None and ticket.address == f":{coordinator.data_plane.port}"
    assert info.size == len(RANDOM)
    first = redeem(coordinator, ticket.token)
    assert first.startswith(b"CCRAW01\n") and first[8:] == RANDOM
    assert redeem(coordinator, ticket.token) == b""  # used
    assert redeem(coordinator, os.urandom(32)) == b""  # never issued
    _, other = ticket_for(coordinator, "k", accept_zstd=True)
    assert redeem(coordinator, other.token, magic=b"GET / HT") == b""  # not our protocol
    assert sends(coordinator) == 1 and sends(coordinator, "refused") == 3


def test_a_ticket_not_used_in_time_expires(coordinator, monkeypatch):
    published(coordinator, "k", RANDOM)
    monkeypatch.setattr(dataplane, "TICKET_S", -1.0)  # expired as it is issued
    _, ticket = ticket_for(coordinator, "k", accept_zstd=True)
    assert redeem(coordinator, ticket.token) == b""
    assert sends(coordinator, "expired") == 1 and sends(coordinator) == 0


def test_a_connection_that_sends_no_token_is_closed(coordinator, monkeypatch):
    monkeypatch.setattr(dataplane, "REQUEST_S", 0.2)
    with socket.create_connection(("127.0.0.1", coordinator.data_plane.port), timeout=10) as s:
        s.sendall(wire.DATA_PLANE_REQUEST)  # and then nothing
        assert s.recv(1) == b""
    assert sends(coordinator, "refused") == 1


def test_connections_past_the_limit_are_closed_at_once(coordinator, monkeypatch):
    """Connections that hold no token cost a file descriptor each until
    REQUEST_S: past MAX_CONNECTIONS open at once, a new one is closed at
    once, and a client's fetch falls back to gRPC."""
    published(coordinator, "k", RANDOM)
    monkeypatch.setattr(dataplane, "MAX_CONNECTIONS", 2)
    idle = [socket.create_connection(("127.0.0.1", coordinator.data_plane.port))
            for _ in range(2)]
    try:
        eventually(lambda: coordinator.data_plane.connections == 2,
                   "both accepted, waiting for their tokens")
        _, ticket = ticket_for(coordinator, "k", accept_zstd=True)
        assert redeem(coordinator, ticket.token) == b""
        assert CacheClient(coordinator.cfg.listen).fetch("k")[1] == RANDOM
    finally:
        for s in idle:
            s.close()
    assert sends(coordinator) == 0 and sends(coordinator, "refused") >= 2
    _, ticket = ticket_for(coordinator, "k", accept_zstd=True)
    assert redeem(coordinator, ticket.token)[8:] == RANDOM  # room again


def test_no_ticket_where_the_bytes_must_go_over_grpc(start_coordinator):
    """A resumed fetch (offset), a zstd blob to a client that does not
    decode, and a blob the replica has not verified recently go over gRPC,
    whose read decodes or verifies them."""
    coordinator = start_coordinator()
    published(coordinator, "raw", RANDOM)
    published(coordinator, "zstd", COMPRESSIBLE)
    assert ticket_for(coordinator, "raw", offset=10)[1] is None
    assert ticket_for(coordinator, "zstd")[1] is None
    assert ticket_for(coordinator, "raw")[1] is not None  # raw needs no decoding
    unverified = start_coordinator(store_reverify_s=0)
    published(unverified, "k", RANDOM)
    assert ticket_for(unverified, "k", accept_zstd=True)[1] is None
    client = CacheClient(unverified.cfg.listen)
    assert client.fetch("k")[1] == RANDOM and tickets(unverified) == 0


def test_a_data_plane_switched_off_answers_over_grpc(start_coordinator, monkeypatch):
    off = start_coordinator(data_listen="off")
    assert off.data_plane is None
    assert published(off, "k", RANDOM).fetch("k")[1] == RANDOM
    assert tickets(off) == 0 and bytes_out(off) == len(RANDOM)  # the data, over gRPC
    on = start_coordinator()  # a second replica (same etcd and store)
    published(on, "k2", RANDOM)
    monkeypatch.setenv("COMPILECAST_DATA_PLANE", "0")
    client = CacheClient(on.cfg.listen)
    assert not client.routes.on(Route.DATA_PLANE)
    assert client.fetch("k2")[1] == RANDOM and tickets(on) == 0


def test_an_unreachable_data_plane_falls_back_to_grpc_for_good(start_coordinator):
    """Advertised where nothing listens (a Service that does not expose its
    port): the bytes come over gRPC, and the client stops asking."""
    coordinator = start_coordinator(data_advertise=f"127.0.0.1:{free_port()}")
    client = published(coordinator, "k", RANDOM)
    assert client.fetch("k")[1] == RANDOM
    assert tickets(coordinator) == 1 and sends(coordinator) == 0
    assert not client.routes.on(Route.DATA_PLANE)
    assert client.fetch("k")[1] == RANDOM
    assert tickets(coordinator) == 1  # not asked again


def test_bytes_that_do_not_verify_are_fetched_again_over_grpc(coordinator, tmp_path):
    """The client verifies what the data plane sends: a file that changed
    under a trusted entry (here: another file handed to the sender) never
    reaches the caller, and the stored blob comes over gRPC."""
    client = published(coordinator, "k", RANDOM)
    bad = tmp_path / "bad"
    bad.write_bytes(b"CCRAW01\n" + RANDOM[:-1] + bytes([RANDOM[-1] ^ 1]))
    real = coordinator.store.open_trusted
    coordinator.store.open_trusted = lambda digest: open(bad, "rb")
    try:
        assert client.fetch("k")[1] == RANDOM
    finally:
        coordinator.store.open_trusted = real
    assert sends(coordinator) == 1  # the bad bytes went out, and were refused by the client
    assert client.routes.on(Route.DATA_PLANE)  # a bad send does not switch the data plane off
    assert client.fetch("k")[1] == RANDOM and sends(coordinator) == 2


def test_a_send_cut_short_is_fetched_again_over_grpc(coordinator, tmp_path):
    client = published(coordinator, "k", RANDOM)
    short = tmp_path / "short"
    short.write_bytes(b"CCRAW01\n" + RANDOM[: len(RANDOM) // 2])
    coordinator.store.open_trusted = lambda digest: open(short, "rb")
    assert client.fetch("k")[1] == RANDOM
    assert client.routes.on(Route.DATA_PLANE)


def test_the_data_plane_address_of_a_ticket():
    t = pb.DataTicket(address=":7650")
    assert data_plane_address(t, "127.0.0.1:7640") == ("127.0.0.1", 7650)
    assert data_plane_address(t, "dns:///coordinator.ns:7640") == ("coordinator.ns", 7650)
    assert data_plane_address(t, "[::1]:7640") == ("::1", 7650)
    assert data_plane_address(pb.DataTicket(address="10.0.0.5:7650"), "svc:7640") == \
        ("10.0.0.5", 7650)
    with pytest.raises(OSError):
        data_plane_address(pb.DataTicket(address="nowhere"), "svc:7640")


def test_a_data_plane_is_dialed_by_name_and_an_unresolvable_one_is_unreachable():
    """A ticket's host goes to the resolver as it is (a name, or a non-ASCII
    name through the idna codec): a name that resolves connects, one that
    does not is Unreachable, saying which address."""
    from compilecast.worker.inprocess.dataplane import connect_data_plane
    from compilecast.worker.inprocess.received import Unreachable

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sock, where = connect_data_plane(pb.DataTicket(address=f":{port}"),
                                          "dns:///localhost:7640", 5.0)
        with sock:
            assert sock.getpeername() == ("127.0.0.1", port)
        assert where == f"the data plane at localhost:{port}"
    for name in ("nosuchhost.invalid", "bücher.invalid"):
        with pytest.raises(Unreachable, match=f"cannot connect to {name}:"):
            connect_data_plane(pb.DataTicket(address=f"{name}:1"), "svc:7640", 5.0)


def taken(worker, result: str = "taken") -> float:
    return sample(worker, "compilecast_worker_data_plane_downloads_total", result=result)


@pytest.mark.parametrize("kind", ["raw", "zstd"])
def test_a_workers_download_takes_the_data_plane(coordinator, start_worker, kind):
    """The host's download comes over the data plane; the worker passes it
    on to its processes and keeps it (as stored) in its host cache."""
    data = KINDS[kind]
    published(coordinator, "k", data)
    worker = start_worker(coordinator.cfg.listen)
    assert worker.parts.routes.on(Route.DATA_PLANE)
    assert CacheClient(worker.target).fetch("k")[1] == data
    assert taken(worker) == 1 and sends(coordinator) == 1 and taken(worker, "fallback") == 0
    assert worker.cache.lookup("host", "k") is not None  # kept: the next process reads it here
    assert CacheClient(worker.target).fetch("k")[1] == data and sends(coordinator) == 1


def test_a_worker_told_not_to_never_asks(coordinator, start_worker):
    published(coordinator, "k", RANDOM)
    worker = start_worker(coordinator.cfg.listen, data_plane=False)
    assert CacheClient(worker.target).fetch("k")[1] == RANDOM
    assert tickets(coordinator) == 0 and taken(worker) == 0


def test_a_worker_that_cannot_reach_the_data_plane_stops_asking(start_coordinator,
                                                                start_worker):
    coordinator = start_coordinator(data_advertise=f"127.0.0.1:{free_port()}")
    published(coordinator, "k", RANDOM)
    published(coordinator, "k2", COMPRESSIBLE)
    worker = start_worker(coordinator.cfg.listen)
    assert CacheClient(worker.target).fetch("k")[1] == RANDOM
    assert taken(worker, "fallback") == 1 and not worker.parts.routes.on(Route.DATA_PLANE)
    assert CacheClient(worker.target).fetch("k2")[1] == COMPRESSIBLE
    assert tickets(coordinator) == 1  # the second download did not ask


@pytest.mark.parametrize("kind", ["raw", "zstd"])
def test_a_workers_download_cut_short_gets_the_rest_over_grpc(coordinator, start_worker,
                                                              tmp_path, kind):
    data = KINDS[kind]
    published(coordinator, "k", data)
    stored = coordinator.store.path_of(hashlib.sha256(data).hexdigest()).read_bytes()
    short = tmp_path / "short"
    short.write_bytes(stored[: len(stored) // 2])
    real, cut = coordinator.store.open_trusted, []

    def once_short(digest: str):  # the first send breaks off halfway; later ones do not
        cut.append(digest)
        return open(short, "rb") if len(cut) == 1 else real(digest)

    coordinator.store.open_trusted = once_short
    worker = start_worker(coordinator.cfg.listen)
    assert CacheClient(worker.target).fetch("k")[1] == data
    assert taken(worker, "fallback") == 1
    assert worker.parts.routes.on(Route.DATA_PLANE)  # it was reachable: asked again next time


def test_a_coordinator_on_all_addresses_serves_a_data_plane_only_where_told(
        etcd, tmp_path, prefix, started):
    """Listening on 0.0.0.0, it cannot know an address clients reach it at
    (behind a Service, "the host you dialed" is not this process): no data
    plane unless one is advertised."""
    from compilecast.coordinator.server import Coordinator

    def on_all_addresses(**kw):
        cfg = coordinator_config(etcd, tmp_path, prefix, **kw)
        cfg.listen = f"0.0.0.0:{free_port()}"
        return started(Coordinator(cfg))

    assert on_all_addresses().data_plane is None
    p = free_port()
    told = on_all_addresses(data_listen=f"127.0.0.1:{p}", data_advertise=f"127.0.0.1:{p}")
    assert told.data_plane is not None and told.data_plane.port == p
    target = f"127.0.0.1:{told.cfg.listen.rpartition(':')[2]}"
    publish(CacheClient(target, timeout_s=10), "k", RANDOM)
    assert CacheClient(target).fetch("k")[1] == RANDOM
    assert sends(told) == 1



class BadDataPlane:
    """A data plane that misbehaves, where a ticket points (as a faulty
    network or a broken replica would): `stall` takes the connection and
    sends nothing, `drip` sends a byte now and then, `garbage` sends bytes
    that are no blob, `zstd garbage` a zstd frame's magic and bytes that do
    not decode. Counts the connections it took."""

    def __init__(self, how: str) -> None:
        import threading

        self.how = how
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                if self.how == "garbage":
                    conn.sendall(os.urandom(3 << 20))
                    return
                if self.how == "zstd garbage":  # a zstd frame's magic, then no frame
                    conn.sendall(b"\x28\xb5\x2f\xfd" + os.urandom(3 << 20))
                    return
                while not self.stop.wait(0.2):
                    if self.how == "drip":
                        conn.sendall(b"C")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.server.close()


@pytest.fixture
def fast_stalls(monkeypatch):
    """The stall bound of a data plane download, 1 s here (10 s as shipped)."""
    from compilecast.worker.daemon import dataplane as worker_end
    from compilecast.worker.inprocess import dataplane as process_end

    monkeypatch.setattr(process_end, "DATA_PLANE_STALL_S", 1.0)
    monkeypatch.setattr(worker_end, "DATA_PLANE_STALL_S", 1.0)


@pytest.mark.parametrize("how", ["stall", "drip", "garbage", "zstd garbage"])
@pytest.mark.parametrize("through", ["process", "worker"])
def test_a_stalling_dripping_or_garbling_data_plane_ends_in_the_right_bytes_over_grpc(
        start_coordinator, start_worker, fast_stalls, how, through):
    bad = BadDataPlane(how)
    try:
        coordinator = start_coordinator(data_advertise=f"127.0.0.1:{bad.port}")
        published(coordinator, "k", RANDOM)
        published(coordinator, "k2", COMPRESSIBLE)
        if through == "worker":
            worker = start_worker(coordinator.cfg.listen)
            client, routes = CacheClient(worker.target, timeout_s=30), worker.parts.routes
        else:
            client = CacheClient(coordinator.cfg.listen, timeout_s=30)
            routes = client.routes
        assert client.fetch("k")[1] == RANDOM
        assert bad.connections == 1
        assert client.fetch("k2")[1] == COMPRESSIBLE
        if how in ("garbage", "zstd garbage"):  # fails at once: tried again next time, free
            assert routes.on(Route.DATA_PLANE) and bad.connections == 2
        else:  # only the first fetch pays the stall bound: off for the end's life
            assert not routes.on(Route.DATA_PLANE) and bad.connections == 1
    finally:
        bad.close()
