"""Fan-out: many workers fetching one artifact at once cost the coordinator
about one copy; a failing peer costs a retry from the coordinator, never the
artifact. Real coordinator, etcd and workers on loopback."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest

from compilecast.launch import free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, all_at_once, status_code
from .test_security import DATA

SIZE = 24 << 20


def publish(coordinator, key: str, data: bytes) -> pb.ArtifactInfo:
    client = CacheClient(coordinator.cfg.listen)
    return client.publish(key, client.acquire(key).lease, data, 2.0)


def egress(coordinator) -> float:
    return coordinator.registry.get_sample_value(
        "compilecast_coordinator_artifact_bytes_total", {"direction": "out"}) or 0.0


def relaying_worker(start_worker, coordinator, name: str):
    port = free_port()
    return start_worker(coordinator.cfg.listen, name, relay_listen=f"127.0.0.1:{port}",
                        relay_advertise=f"127.0.0.1:{port}")


def fetch_all(targets: list[str], key: str) -> list[bytes]:
    return all_at_once([lambda t=t: CacheClient(t, timeout_s=60).fetch(key)[1]
                        for t in targets], timeout_s=120)


def test_six_workers_fetching_at_once_cost_the_coordinator_about_one_copy(
        start_coordinator, start_worker):
    coordinator = start_coordinator(relay_fanout=2)
    data = os.urandom(SIZE)
    publish(coordinator, "big", data)
    workers = [relaying_worker(start_worker, coordinator, f"w{i}") for i in range(6)]
    before = egress(coordinator)
    got = fetch_all([w.target for w in workers], "big")
    assert all(g == data for g in got)
    sent = egress(coordinator) - before
    assert sent <= 2 * SIZE, sent / SIZE  # not 6 copies
    redirects = coordinator.registry.get_sample_value(
        "compilecast_coordinator_relay_redirects_total")
    assert redirects >= 3
    relayed = sum(w.registry.get_sample_value("compilecast_worker_relays_total",
                                              {"event": "redirected"}) or 0 for w in workers)
    assert relayed == redirects
    # Each host cache holds the verified artifact: a second fetch is local.
    for w in workers:
        assert CacheClient(w.target).fetch("big")[1] == data


def test_peers_relay_the_stored_zstd_stream_as_it_came(start_coordinator, start_worker):
    """A compressible artifact goes from worker to worker as the coordinator's
    stored zstd stream: each worker receives a fraction of the bytes, keeps
    the stream byte for byte in its host cache, and hands its processes the
    decoded, verified artifact."""
    coordinator = start_coordinator(relay_fanout=2)
    data = b"".join(os.urandom(64) + b"\x00" * 960 for _ in range(SIZE // 1024))  # ~10x
    info = publish(coordinator, "zbig", data)
    stream = coordinator.store.path_of(info.digest).read_bytes()
    assert len(stream) < SIZE / 5
    workers = [relaying_worker(start_worker, coordinator, f"z{i}") for i in range(6)]
    before = egress(coordinator)
    got = fetch_all([w.target for w in workers], "zbig")
    assert all(g == data for g in got)
    assert egress(coordinator) - before <= 2 * len(stream)
    redirected = sum(w.registry.get_sample_value("compilecast_worker_relays_total",
                                                 {"event": "redirected"}) or 0 for w in workers)
    assert redirected >= 3
    # What the workers sent each other and their processes: each process got
    # the decoded artifact; each peer the stream, not the artifact.
    served = sum(w.registry.get_sample_value("compilecast_worker_artifact_bytes_total",
                                             {"direction": "served"}) or 0 for w in workers)
    assert served <= 6 * SIZE + redirected * len(stream) * 1.01
    for w in workers:
        assert w.cache.store.path_of(info.digest).read_bytes() == stream


def test_a_fill_hands_each_reader_the_stream_it_takes(loop_thread):
    """Fill: a reader that takes zstd and joins before any data follows the
    zstd stream once it comes; a plain reader gets the decoded bytes; a
    reader joining later gets the backlog of its own kind; a cut ends the
    zstd readers with UNAVAILABLE (they fetch the rest elsewhere) and sends
    later zstd readers the decoded bytes."""
    from compilecast.errors import UpstreamError
    from compilecast.wire import DataChunk
    from compilecast.worker.daemon.fill import Fill

    async def drain(q):
        out = []
        while not q.empty():
            out.append(q.get_nowait())
        return out

    async def body():
        fill = Fill(1 << 20)
        early_z, early_plain = fill.join(zstd=True), fill.join()
        await fill.send(pb.FetchChunk(artifact=pb.ArtifactInfo(size=6)))
        await fill.send_zstd(DataChunk(b"", b"Z1"))
        await fill.send(DataChunk(b"abc"))
        late_z, late_plain = fill.join(zstd=True), fill.join()
        await fill.send(pb.FetchChunk())  # a heartbeat: to everyone
        first = [await drain(q) for q in (early_z, early_plain, late_z, late_plain)]
        await fill.cut_zstd("cut")
        after_cut = fill.join(zstd=True)
        await fill.send(DataChunk(b"def"))
        await fill.finish(pb.ArtifactInfo(size=6), None)
        second = [await drain(q) for q in (early_z, late_z, after_cut, early_plain)]
        return first, second

    first, second = loop_thread.run(body())

    def one(i) -> str:
        if i is None:
            return "end"
        if isinstance(i, UpstreamError):
            return f"UpstreamError:{i.status.name}"
        if i.zstd_data:
            return "z:" + bytes(i.zstd_data).decode()
        if i.data:
            return "d:" + bytes(i.data).decode()
        return "header" if i.HasField("artifact") else "beat"

    def seen(items):
        return [one(i) for i in items]

    assert [seen(q) for q in first] == [
        ["header", "z:Z1", "beat"], ["header", "d:abc", "beat"],
        ["header", "z:Z1", "beat"], ["header", "d:abc", "beat"]]
    assert [seen(q) for q in second] == [
        ["UpstreamError:UNAVAILABLE"], ["UpstreamError:UNAVAILABLE"],
        ["header", "d:abc", "beat", "d:def", "end"], ["d:def", "end"]]


def test_a_peer_whose_zstd_stream_breaks_off_costs_the_rest_from_the_coordinator(
        start_coordinator, start_worker, loop_thread):
    """A peer (one of our own, the test's) that relays the first pieces of
    the stored zstd stream and then fails: the worker fetches the rest,
    decoded, from the offset it had decoded to, and keeps no copy of that
    stream, which is not whole. Its process, which was reading the stream,
    is cut off, asks again, and gets the whole verified artifact. What the
    host cache holds in the end is the coordinator's stream, byte for byte."""
    coordinator = start_coordinator(relay_fanout=2)
    data = b"".join(os.urandom(64) + b"\x00" * 960 for _ in range(SIZE // 1024))
    info = publish(coordinator, "zcut", data)
    stream = coordinator.store.path_of(info.digest).read_bytes()
    asked: list[bool] = []

    class BreakingPeer(rpc.CompileCacheServicer):
        async def Fetch(self, request, context):
            asked.append(request.accept_zstd)
            yield pb.FetchChunk(artifact=info)
            for i in range(0, len(stream) // 2, 256 << 10):
                yield pb.FetchChunk(zstd_data=stream[i:i + (256 << 10)])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the peer went away")

    async def serve_peer():
        server = grpc.aio.server()
        rpc.add_CompileCacheServicer_to_server(BreakingPeer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(serve_peer())
    try:
        # The peer asks first, so the coordinator points later fetchers at it.
        first = CacheClient(coordinator.cfg.listen)
        list(first.stub.Fetch(pb.FetchRequest(key="zcut", relay_address=f"127.0.0.1:{port}")))
        worker = relaying_worker(start_worker, coordinator, "zw")
        assert CacheClient(worker.target, timeout_s=60).fetch("zcut")[1] == data
        assert asked == [True]  # it asked the peer for the stream as stored
        assert worker.registry.get_sample_value("compilecast_worker_relays_total",
                                                {"event": "fallback"}) == 1
        # The process asked twice: its read of the broken stream was cut off.
        assert worker.registry.get_sample_value("compilecast_worker_fetches_total",
                                                {"source": "coordinator"}) == 2
        assert worker.cache.lookup("host", "zcut") is not None
        assert worker.cache.store.path_of(info.digest).read_bytes() == stream
        assert CacheClient(worker.target, timeout_s=60).fetch("zcut")[1] == data
    finally:
        loop_thread.run(server.stop(0))


def test_a_dead_peer_costs_a_retry_from_the_coordinator(start_coordinator, start_worker):
    coordinator = start_coordinator(relay_fanout=2)
    data = os.urandom(4 << 20)
    info = publish(coordinator, "k", data)
    # A "worker" that registers a relay address nobody serves, then vanishes.
    dead = CacheClient(coordinator.cfg.listen)
    first = list(dead.stub.Fetch(pb.FetchRequest(key="k", relay_address="127.0.0.1:1")))
    assert hashlib.sha256(b"".join(c.data for c in first)).hexdigest() == info.digest
    worker = relaying_worker(start_worker, coordinator, "w")
    assert CacheClient(worker.target).fetch("k")[1] == data
    assert worker.registry.get_sample_value("compilecast_worker_relays_total",
                                            {"event": "fallback"}) == 1


def test_fetch_resumes_at_an_offset_and_refuses_bad_relay_fields(coordinator, start_worker):
    data = os.urandom(3 << 20)
    publish(coordinator, "k", data)
    client = CacheClient(coordinator.cfg.listen)
    rest = b"".join(c.data for c in client.stub.Fetch(pb.FetchRequest(key="k", offset=1234567)))
    assert rest == data[1234567:]
    for bad in (pb.FetchRequest(key="k", offset=-1), pb.FetchRequest(key="k", offset=len(data) + 1),
                pb.FetchRequest(key="k", relay_address="no port")):
        with pytest.raises(CALL_ERRORS) as err:
            list(client.stub.Fetch(bad))
        assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    worker = start_worker(coordinator.cfg.listen)
    with pytest.raises(CALL_ERRORS) as err:
        list(CacheClient(worker.target).stub.Fetch(pb.FetchRequest(key="k", offset=5)))
    assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_relaying_respects_tokens_and_tenants(start_coordinator, start_worker, tokens_file,
                                              tmp_path):
    from compilecast.v1 import cache_pb2_grpc as rpc

    coordinator = start_coordinator(auth_tokens_file=str(tokens_file),
                                    allow_unauthenticated=False, relay_fanout=2)
    worker_token = tmp_path / "worker-token"
    worker_token.write_text("a-pub")
    ports = [free_port(), free_port()]
    workers = [start_worker(coordinator.cfg.listen, f"t{i}", token_file=str(worker_token),
                            relay_listen=f"127.0.0.1:{p}", relay_advertise=f"127.0.0.1:{p}")
               for i, p in enumerate(ports)]
    a = CacheClient(workers[0].target)  # acts as the workers (tenant team-a)
    a.publish("k", a.acquire("k").lease, DATA, 1.0)
    # Both workers fetch; the second is relayed by the first.
    assert fetch_all([w.target for w in workers], "k") == [DATA, DATA]
    # The relay port serves nobody without a token, nor another tenant's token.
    relay = rpc.CompileCacheStub(grpc.insecure_channel(f"127.0.0.1:{ports[0]}"))
    with pytest.raises(CALL_ERRORS) as err:
        list(relay.Fetch(pb.FetchRequest(key="k")))
    assert status_code(err.value) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(CALL_ERRORS) as err:
        list(relay.Fetch(pb.FetchRequest(key="k"), metadata=(("authorization", "Bearer b-pub"),)))
    assert status_code(err.value) == grpc.StatusCode.NOT_FOUND  # team-b has no such key
    got = b"".join(c.data for c in relay.Fetch(
        pb.FetchRequest(key="k"), metadata=(("authorization", "Bearer a-pub"),)))
    assert got == DATA


# -- the relay tree itself (coordinator/relay.py) ---------------------------------

def test_relay_trees_are_breadth_first_with_fanout_children():
    from compilecast.coordinator.relay import RelayTrees

    trees = RelayTrees(fanout=2)
    art = ("default", "d" * 64)
    parents = [trees.assign(art, f"w{i}:1") for i in range(7)]
    assert parents == [None, "w0:1", "w0:1", "w1:1", "w1:1", "w2:1", "w2:1"]
    assert trees.assign(art, "w3:1") is None  # asking again: from the coordinator
    assert trees.assign(("default", "e" * 64), "w9:1") is None  # another artifact, another tree
    assert trees.assign(("tenant-b", "d" * 64), "w8:1") is None  # and another tenant's


def test_workers_are_chained_while_the_chain_is_short_next_to_the_artifact():
    from compilecast.coordinator.relay import RelayTrees

    trees = RelayTrees(fanout=2, chain_bytes=4 << 20)
    art = ("default", "c" * 64)
    # 16 MiB / 4 MiB: a chain of 4, then breadth-first, 2 peers per worker.
    parents = [trees.assign(art, f"w{i}:1", 16 << 20) for i in range(8)]
    assert parents == [None, "w0:1", "w1:1", "w2:1", "w0:1", "w1:1", "w2:1", "w3:1"]
    small = ("default", "s" * 64)  # shorter than one chained worker's share: a tree at once
    assert [trees.assign(small, f"w{i}:1", 1 << 20) for i in range(4)] == \
        [None, "w0:1", "w0:1", "w1:1"]
    never = RelayTrees(fanout=2, chain_bytes=0)
    assert [never.assign(art, f"w{i}:1", 1 << 30) for i in range(4)] == \
        [None, "w0:1", "w0:1", "w1:1"]


def test_relay_trees_forget_old_nodes_and_stay_bounded(monkeypatch):
    from compilecast.coordinator import relay

    now = [1000.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])
    trees = relay.RelayTrees(fanout=1, window_s=10.0)
    art = ("default", "a" * 64)
    assert trees.assign(art, "w0:1") is None
    now[0] += 11  # w0's download is long over: nobody is pointed at it
    assert trees.assign(art, "w1:1") is None
    assert trees.assign(art, "w2:1") == "w1:1"
    monkeypatch.setattr(relay, "MAX_TREES", 3)
    for i in range(10):
        now[0] += 1
        trees.assign(("default", f"{i:064d}"), "x:1")
    assert len(trees._trees) <= 3


@pytest.mark.parametrize("address", ["", "host", "host:", ":80", "host:0", "host:65536",
                                     "host:http", "a b:80", "a/b:80", "h" * 300 + ":80"])
def test_a_bad_relay_address_is_refused(address):
    from compilecast.errors import InvalidRequest
    from compilecast.validate import relay_address as check_address

    with pytest.raises(InvalidRequest, match="relay_address"):
        check_address(address)
    assert check_address("10.0.0.7:50052") == "10.0.0.7:50052"
    assert check_address("[::1]:50052") == "[::1]:50052"


def test_relay_pieces_keep_the_bytes_and_their_kind():
    from compilecast.wire import DataChunk
    from compilecast.worker.daemon.upstream import RELAY_PIECE, relay_pieces

    data = os.urandom(2 * RELAY_PIECE + 123)
    for zstd in (False, True):
        chunk = DataChunk(b"", memoryview(data)) if zstd else DataChunk(memoryview(data))
        pieces = list(relay_pieces(chunk))
        assert [p.size for p in pieces] == [RELAY_PIECE, RELAY_PIECE, 123]
        got = b"".join(bytes(p.zstd_data if zstd else p.data) for p in pieces)
        assert got == data
        assert not any(len(p.data if zstd else p.zstd_data) for p in pieces)
    small, header = DataChunk(data[:RELAY_PIECE]), pb.FetchChunk(artifact=pb.ArtifactInfo(size=1))
    assert list(relay_pieces(small)) == [small]
    assert list(relay_pieces(header)) == [header]


@pytest.mark.parametrize("compressible", [False, True])
def test_a_peer_gets_a_live_download_in_pieces(start_coordinator, start_worker, compressible):
    """What a relay endpoint sends a peer while its own download runs comes
    in messages of at most RELAY_PIECE bytes (each hop can pass bytes on that
    much sooner), and they are the artifact, or its stored zstd stream."""
    import zstandard

    from compilecast import wire
    from compilecast.worker.daemon.upstream import RELAY_PIECE

    coordinator = start_coordinator(relay_fanout=2)
    data = (b"".join(os.urandom(64) + b"\x00" * 960 for _ in range(SIZE // 1024))
            if compressible else os.urandom(SIZE))
    info = publish(coordinator, "pieces", data)
    w = relaying_worker(start_worker, coordinator, "relay")
    channel = grpc.insecure_channel(w.cfg.relay_listen)
    sizes, payload = [], []
    for chunk in wire.stub(channel).Fetch(pb.FetchRequest(key="pieces", accept_zstd=True),
                                          timeout=60):
        if isinstance(chunk, wire.DataChunk):
            sizes.append(chunk.size)
            payload.append(bytes(chunk.zstd_data or chunk.data))
    channel.close()
    got = b"".join(payload)
    if compressible:
        got = zstandard.ZstdDecompressor().decompressobj().decompress(got)
    assert hashlib.sha256(got).hexdigest() == info.digest
    assert max(sizes) <= RELAY_PIECE  # the coordinator sent 2 MiB chunks
