"""The servers' shared lifecycle (compilecast.serving) on real gRPC."""

from __future__ import annotations

import asyncio
import gc
import socket
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry

from compilecast.serving import HeapWatch, ListenError, listen, make_server
from compilecast.v1 import cache_pb2_grpc as rpc

from .conftest import CALL_ERRORS, status_code


def test_a_port_one_of_our_servers_serves_is_taken_for_the_next():
    """gRPC's default SO_REUSEPORT would let a second server bind the same
    port and take half of its connections; ours refuse, with a ListenError
    naming the address and the setting."""

    async def run():
        first, _ = make_server(rpc.CompileCacheServicer())
        servers = [first]  # all stopped here, in this loop: none left for the collector
        port = listen(first, "127.0.0.1:0", setting="listen")
        await first.start()
        try:
            second, _ = make_server(rpc.CompileCacheServicer())
            servers.append(second)
            with pytest.raises(ListenError) as err:
                listen(second, f"127.0.0.1:{port}", setting="relay_listen")
            assert f"127.0.0.1:{port} (relay_listen)" in str(err.value)
            # The first still serves the port alone.
            third, _ = make_server(rpc.CompileCacheServicer())
            servers.append(third)
            with pytest.raises(ListenError):
                listen(third, f"127.0.0.1:{port}", setting="listen")
        finally:
            for server in servers:
                await server.stop(None)

    asyncio.run(run())


def test_a_unix_socket_is_taken_over_only_when_nothing_serves_it(tmp_path):
    """A second worker on a host must not unlink the first's live socket
    (the first would run on, unreachable); a stale socket file of a crashed
    run is replaced."""
    path = tmp_path / "run" / "worker.sock"
    address = f"unix://{path}"

    async def run():
        first, _ = make_server(rpc.CompileCacheServicer())
        listen(first, address, setting="listen")  # makes the directory too
        await first.start()
        second, _ = make_server(rpc.CompileCacheServicer())
        try:
            with pytest.raises(ListenError) as err:
                listen(second, address, setting="listen")
            assert f"{address} (listen)" in str(err.value)
            assert path.is_socket()
        finally:
            await second.stop(None)
            await first.stop(None)

    asyncio.run(run())
    # A socket file nobody accepts on, as a killed worker leaves it.
    path.unlink(missing_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    assert path.is_socket()

    async def again():
        server, _ = make_server(rpc.CompileCacheServicer())
        listen(server, address, setting="listen")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await asyncio.wait_for(channel.channel_ready(), 10)
        finally:
            await server.stop(None)

    asyncio.run(again())


def test_a_new_client_of_a_coordinator_restarted_on_its_address_is_served(start_coordinator):
    """gRPC shares connections, and the backoff of a failed one, across a
    process's channels unless told not to: an older client that saw the first
    coordinator go had a fresh client of the second refused at once."""
    from compilecast.v1 import cache_pb2 as pb
    from compilecast.worker.inprocess.client import CacheClient

    first = start_coordinator()
    address = first.cfg.listen
    old = CacheClient(address, timeout_s=2.0)
    assert old.acquire("k").decision == pb.COMPILE
    first.stop()
    with pytest.raises(CALL_ERRORS) as err:
        old.acquire("k")  # its connection now backs off
    assert status_code(err.value) == grpc.StatusCode.UNAVAILABLE
    second = start_coordinator(listen=address)
    assert second.cfg.listen == address
    new = CacheClient(address, timeout_s=2.0)
    assert new.acquire("other").decision == pb.COMPILE
    old.close()
    new.close()


@pytest.fixture
def unfrozen():
    """Whatever a test freezes is unfrozen after it (this process goes on)."""
    yield
    gc.unfreeze()


def test_a_serving_process_freezes_its_start_up_heap_and_counts_its_gc_pauses(unfrozen):
    """After start-up the heap is frozen, so that collections stop walking it;
    each collection's pause lands in every role's registry, by generation,
    until the watch is closed."""
    gc.unfreeze()
    roles = {"coordinator": CollectorRegistry(), "worker": CollectorRegistry()}

    def pauses(role: str, generation: str) -> float:
        return roles[role].get_sample_value(f"compilecast_{role}_gc_pause_seconds_count",
                                            {"generation": generation})

    heap = HeapWatch(roles)
    try:
        # This process's modules, at the least (frozen objects freed since leave the count).
        assert gc.get_freeze_count() > 1000
        assert roles["worker"].get_sample_value("compilecast_worker_gc_frozen_objects") > 1000
        assert pauses("coordinator", "2") == pauses("worker", "2") == 0
        gc.collect()
        gc.collect(0)
        for role in roles:
            assert pauses(role, "2") == 1 and pauses(role, "0") >= 1, role
        assert roles["coordinator"].get_sample_value(
            "compilecast_coordinator_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        heap.close()
    gc.collect()
    assert pauses("coordinator", "2") == 1  # closed: no longer counted
    heap.close()  # twice is harmless
    gc.unfreeze()
    assert roles["worker"].get_sample_value("compilecast_worker_gc_frozen_objects") == 0


def test_up_serves_with_its_heap_frozen_and_reports_gc_pauses(up):
    """`compilecast up` (both roles in one process) settles its heap once both
    listen, and both roles' metrics say so."""
    for role in ("coordinator", "worker"):
        port = up.ports[f"{role}-metrics-port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        lines = dict(line.rsplit(" ", 1) for line in text.decode().splitlines()
                     if line and not line.startswith("#"))
        assert float(lines[f"compilecast_{role}_gc_frozen_objects"]) > 1000, role
        assert f'compilecast_{role}_gc_pause_seconds_count{{generation="2"}}' in lines, role
