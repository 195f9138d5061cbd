"""The workers' relay data plane (worker/daemon/relayplane.py): peers take what a
worker relays over plain TCP with sendfile, following its download as it is
written; a peer whose plane breaks off or cannot be reached costs a fetch of
the rest from the coordinator, or a relay over gRPC, never the artifact. Real
coordinator, etcd and workers on loopback; the plane's sender unit-tested
against a fake download (our own interface)."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest

from compilecast.launch import free_port
from compilecast.negotiate import Route
from compilecast.streams import RAW_MAGIC
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import DATA_PLANE_REQUEST
from compilecast.worker.daemon.fill import Fill
from compilecast.worker.daemon.relayplane import RelayPlane
from compilecast.worker.inprocess.client import CacheClient

from .test_relay import SIZE, egress, fetch_all, publish


def sample(worker, name: str, label: str, value: str) -> float:
    return worker.registry.get_sample_value(name, {label: value}) or 0.0


@pytest.mark.parametrize("plane", ["auto", "off"])
def test_peers_take_relays_over_the_relay_data_plane(start_coordinator, start_worker, plane):
    """Six workers fetch at once: every redirected worker got the whole
    artifact over its peer's data plane (with it on), or over gRPC (off); the
    coordinator sent about one copy either way."""
    coordinator = start_coordinator(relay_fanout=2)
    data = os.urandom(SIZE)
    publish(coordinator, "big", data)
    workers = [start_worker(coordinator.cfg.listen, f"w{i}", relay_data_listen=plane,
                            **relaying_worker_config()) for i in range(6)]
    before = egress(coordinator)
    assert fetch_all([w.target for w in workers], "big") == [data] * 6
    assert egress(coordinator) - before <= 2 * SIZE
    redirected = sum(sample(w, "compilecast_worker_relays_total", "event", "redirected")
                     for w in workers)
    taken = sum(sample(w, "compilecast_worker_relays_total", "event", "data_plane")
                for w in workers)
    sent = sum(sample(w, "compilecast_worker_relay_data_plane_total", "result", "sent")
               for w in workers)
    assert redirected >= 3
    if plane == "auto":
        assert taken == sent == redirected
    else:
        assert taken == sent == 0
        assert all(w.parts.fetches.relay_plane is None for w in workers)
    for w in workers:  # each host cache holds the verified artifact
        assert w.cache.lookup("host", "big") is not None


def relaying_worker_config() -> dict:
    port = free_port()
    return {"relay_listen": f"127.0.0.1:{port}", "relay_advertise": f"127.0.0.1:{port}"}


def plane_worker(start_worker, coordinator, name: str):
    """A relaying worker with its relay data plane on (as by default)."""
    return start_worker(coordinator.cfg.listen, name, relay_data_listen="auto",
                        **relaying_worker_config())


def test_a_relay_plane_that_cannot_be_reached_relays_over_grpc(start_coordinator,
                                                                start_worker):
    """A peer offers tickets for a port nobody listens on (a firewall, say):
    the worker relays from that peer over gRPC, not from the coordinator,
    and asks it for no ticket again."""
    coordinator = start_coordinator(relay_fanout=2)
    data = os.urandom(4 << 20)
    publish(coordinator, "k", data)
    first = plane_worker(start_worker, coordinator, "first")
    assert CacheClient(first.target).fetch("k")[1] == data
    first.lt.run(_close_server(first.parts.fetches.relay_plane))
    second = plane_worker(start_worker, coordinator, "second")
    before = egress(coordinator)
    assert CacheClient(second.target).fetch("k")[1] == data
    assert egress(coordinator) == before  # relayed, over gRPC
    assert sample(second, "compilecast_worker_relays_total", "event", "redirected") == 1
    assert sample(second, "compilecast_worker_relays_total", "event", "data_plane") == 0
    assert sample(second, "compilecast_worker_relays_total", "event", "fallback") == 0
    assert not second.parts.routes.on(Route.RELAY_PLANE, first.cfg.relay_listen)
    assert second.parts.routes.on(Route.RELAY_PLANE, "another-peer:7642")


async def _close_server(plane: RelayPlane) -> None:
    plane._server.close()
    await plane._server.wait_closed()


def test_a_relay_plane_that_breaks_off_costs_the_rest_from_the_coordinator(
        start_coordinator, start_worker, loop_thread):
    """A peer (the test's) whose data plane sends the first half of the
    artifact and closes: the worker fetches the rest from the coordinator,
    from the byte it had, and its host cache holds the verified artifact."""
    coordinator = start_coordinator(relay_fanout=2)
    data = os.urandom(SIZE)
    info = publish(coordinator, "cut", data)
    asked: list[bool] = []

    async def serve_bytes(reader, writer):
        await reader.readexactly(len(DATA_PLANE_REQUEST) + 32)
        writer.write(RAW_MAGIC + data[:SIZE // 2])
        await writer.drain()
        writer.close()

    class TicketingPeer(rpc.CompileCacheServicer):
        async def Fetch(self, request, context):
            asked.append(request.accept_data_ticket)
            yield pb.FetchChunk(artifact=info, data_ticket=pb.DataTicket(
                address=f":{plane.sockets[0].getsockname()[1]}", token=b"t" * 32))

    async def serve_peer():
        server = grpc.aio.server()
        rpc.add_CompileCacheServicer_to_server(TicketingPeer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port, await asyncio.start_server(serve_bytes, "127.0.0.1", 0)

    server, port, plane = loop_thread.run(serve_peer())
    try:
        # The peer asks first, so the coordinator points later fetchers at it.
        list(CacheClient(coordinator.cfg.listen).stub.Fetch(
            pb.FetchRequest(key="cut", relay_address=f"127.0.0.1:{port}")))
        worker = plane_worker(start_worker, coordinator, "w")
        before = egress(coordinator)
        assert CacheClient(worker.target, timeout_s=60).fetch("cut")[1] == data
        assert asked == [True]
        assert sample(worker, "compilecast_worker_relays_total", "event", "fallback") == 1
        assert egress(coordinator) - before == SIZE - SIZE // 2  # only the rest
        assert worker.cache.lookup("host", "cut") is not None
    finally:
        plane.close()
        loop_thread.run(server.stop(0))


def test_a_relay_plane_connection_without_a_valid_ticket_gets_nothing(
        start_coordinator, start_worker):
    coordinator = start_coordinator(relay_fanout=2)
    worker = plane_worker(start_worker, coordinator, "w")
    port = worker.parts.fetches.relay_plane.port
    for hello in (DATA_PLANE_REQUEST + b"x" * 32, b"CCPUT01\n" + b"x" * 32):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(hello)
            assert s.recv(1) == b""  # closed without a byte
    assert sample(worker, "compilecast_worker_relay_data_plane_total", "result",
                  "refused") == 2


# -- the sender, against a fake download -------------------------------------------


class FakeFill:
    """What relayplane._send reads of worker/daemon/service.py's Fill: how much of
    its file is written, a wake-up when that changes, and how it ended."""

    def __init__(self, path) -> None:
        self.file = open(path, "wb")
        self.file.write(RAW_MAGIC)
        self.file.flush()
        self.written = 0
        self.finished = False
        self.kept = True
        self.done = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()

    def readable(self):
        return None if self.finished else self.written

    changed = Fill.changed  # waits on self._changed, as the real one

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.file.flush()
        self.written += len(data)
        self._changed.set()
        self._changed = asyncio.Event()

    def finish(self, error: BaseException | None) -> None:
        self.file.close()
        self.finished = True
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)
        self._changed.set()


@pytest.mark.parametrize("fails", [False, True])
def test_the_sender_follows_a_download_as_it_is_written(tmp_path, loop_thread, fails):
    """A ticket for a growing file: the peer gets what is written as it is
    written (its first MiB before the peer connects, the rest after), and
    the whole file once the download commits; a download that fails ends
    the connection where its file stopped."""
    from prometheus_client import CollectorRegistry, Counter

    data = os.urandom(3 << 20)
    path = tmp_path / "growing"
    counter = Counter("relays", "", ["result"], registry=CollectorRegistry())

    async def run() -> bytes:
        plane = RelayPlane("127.0.0.1:0", counter)
        await plane.start()
        try:
            fill = FakeFill(path)
            fill.write(data[:1 << 20])
            ticket = plane.offer(await asyncio.to_thread(open, path, "rb"),
                                 len(RAW_MAGIC) + len(data), fill)
            reader, writer = await asyncio.open_connection("127.0.0.1", plane.port)
            writer.write(DATA_PLANE_REQUEST + ticket.token)
            got = await reader.readexactly(len(RAW_MAGIC) + (1 << 20))
            fill.write(data[1 << 20:2 << 20])
            got += await reader.readexactly(1 << 20)  # sent before anything else is written
            if fails:
                fill.finish(OSError("the download broke off"))
            else:
                fill.write(data[2 << 20:])
                fill.finish(None)
            got += await reader.read()  # to the end of the connection
            writer.close()
            return got
        finally:
            await plane.stop()

    got = loop_thread.run(run())
    end = (2 << 20) if fails else len(data)
    assert got == RAW_MAGIC + data[:end]
    assert counter.labels("sent")._value.get() == (0 if fails else 1)
    assert counter.labels("short")._value.get() == (1 if fails else 0)
