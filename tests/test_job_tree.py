"""A job's news down a tree (compilecast/jobtree.py, coordinator/jobwatch.py,
worker/daemon/jobrelay.py): the replica serves job_stream_fanout streams of a
job, workers that relay serve the rest; a relay that dies costs its subtree a
reconnect, never an answer; a reconnect resumes the news. Real etcd, a
coordinator and workers on loopback; the relay killed is a process of its
own, killed with SIGKILL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import uuid

import grpc
import pytest

from compilecast import jobtree
from compilecast.jobtree import Branch, NewsLog, Outbox, place
from compilecast.launch import free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, wait_until_healthy

from .conftest import cc, eventually
from .test_job_streams import decided, process_of

JOB = "train-cold"


# -- the parts alone ----------------------------------------------------------------------
def test_the_news_log_resumes_after_a_message_it_holds_and_nowhere_else():
    log = NewsLog("e1", messages=100)
    for seq in range(1, 301):
        log.add(seq, f"m{seq}".encode())
    assert log.after("e1", 300) == []
    assert log.after("e1", 250) == [(s, f"m{s}".encode()) for s in range(251, 301)]
    assert log.after("e1", 201) == [(s, f"m{s}".encode()) for s in range(202, 301)]
    assert log.after("e1", 150) is None  # what followed it is no longer held
    assert log.after("e2", 250) is None  # another run of the job
    assert log.after("e1", 301) is None  # never sent
    joined = NewsLog("e1")
    joined.add(3, b"m1m2m3")  # news joined on its way: 1 and 2 are not messages here
    joined.add(4, b"m4")
    assert joined.after("e1", 3) == [(4, b"m4")]
    assert joined.after("e1", 2) is None


def test_placement_fills_a_node_then_sends_newcomers_to_its_least_given_relay():
    branches = [Branch(f"10.0.0.{i}:1") for i in range(3)] + [Branch("")]
    assert place(branches[:3], 4) is None  # room here
    got = [place(branches, 4) for _ in range(9)]
    assert {b.address for b in got if b} == {b.address for b in branches[:3]}
    assert sorted(b.placed for b in branches[:3]) == [3, 3, 3]
    assert place([Branch("")] * 4, 4) is None  # nobody relays: served here


def test_an_outbox_joins_waiting_news_but_never_a_message_of_its_stream_alone():
    async def run() -> list[pb.JobEvents]:
        box = Outbox(bound=10)
        box.send(pb.JobEvents(seq=1, claimed=["a"]).SerializeToString())
        box.send(pb.JobEvents(seq=2, claimed=["b"]).SerializeToString())
        box.send(pb.JobEvents(turns=[pb.KeyTurn(key="a")]))
        box.send(pb.JobEvents(seq=3, claimed=["c"]).SerializeToString())
        box.end()
        out = []
        while (data := await box.next()) is not None:
            out.append(pb.JobEvents.FromString(data))
        return out

    got = asyncio.run(run())
    assert [(e.seq, list(e.claimed), [t.key for t in e.turns]) for e in got] == [
        (2, ["a", "b"], []), (0, [], ["a"]), (3, ["c"], [])]


def test_news_leaves_at_once_while_nothing_is_in_flight_and_joins_until_acknowledged():
    """Nagle's rule on a stream: news leaves at once when all it was sent
    was acknowledged; news that comes while some is in flight waits for the
    acknowledgement and leaves joined with whatever came meanwhile; a peer
    that never acknowledges gets news at most `hold_s` apart."""
    def news(seq: int) -> bytes:
        return pb.JobEvents(seq=seq, published=[pb.ArtifactInfo(key=f"k{seq}")]).SerializeToString()

    async def run() -> tuple:
        box = Outbox(hold_s=30.0)
        box.opened_at(0)
        box.send(news(1), 1)
        first = pb.JobEvents.FromString(await box.next())  # at once: nothing in flight
        for seq in (2, 3, 4):
            box.send(news(seq), seq)
        waiting = asyncio.ensure_future(box.next())
        await asyncio.sleep(0)  # (it looks, and waits for the acknowledgement)
        held = not waiting.done()
        box.acked_to(1)
        joined = pb.JobEvents.FromString(await waiting)
        box.acked_to(4)
        box.send(news(5), 5)
        alone = pb.JobEvents.FromString(await box.next())  # acknowledged: at once again

        silent = Outbox(hold_s=0.05)  # a peer that never acknowledges
        silent.opened_at(0)
        silent.send(news(1), 1)
        await silent.next()
        silent.send(news(2), 2)
        late = pb.JobEvents.FromString(await silent.next())  # after hold_s, unacknowledged
        return first, held, joined, alone, late

    first, held, joined, alone, late = asyncio.run(run())
    assert first.seq == 1 and held
    assert joined.seq == 4 and [i.key for i in joined.published] == ["k2", "k3", "k4"]
    assert alone.seq == 5 and late.seq == 2


def test_an_idle_stream_says_it_lives_and_a_silent_one_is_taken_for_frozen():
    """A node with nothing to send sends an empty message after its
    heartbeat; a reader that hears nothing for its limit gives up (Silent),
    and one that hears heartbeats never does."""
    from compilecast.errors import Unavailable

    async def run() -> tuple:
        box = Outbox()
        beat = await box.next(0.05)  # nothing queued: a heartbeat
        box.send(b"news")
        news = await box.next(0.05)
        gate = asyncio.Event()

        async def frozen():
            yield pb.JobEvents(seq=1)
            await gate.wait()  # (says nothing more, never ends)
            yield pb.JobEvents(seq=2)

        got = []
        with pytest.raises(Unavailable, match="frozen"):
            async for m in jobtree.heard(frozen(), silent_s=0.2):
                got.append(m.seq)

        async def beating():
            for _ in range(6):
                await asyncio.sleep(0.05)  # (a heartbeat: well within the limit)
                yield pb.JobEvents()

        beats = [m async for m in jobtree.heard(beating(), silent_s=0.5)]
        return beat, news, got, len(beats)

    assert asyncio.run(run()) == (jobtree.HEARTBEAT, b"news", [1], 6)


def test_an_outbox_past_its_bound_ends_its_stream():
    box = Outbox(bound=3)
    for i in range(5):
        box.send(str(i).encode())
    assert box.behind and not box.open


# -- with real servers ----------------------------------------------------------------
def relay_of(port: int) -> dict:
    return {"relay_listen": f"127.0.0.1:{port}", "relay_advertise": f"127.0.0.1:{port}"}


def stream_of(host, job: str = JOB) -> pb.JobPrefetch | None:
    st = CacheClient(host.target).status()
    return next((p for p in st.prefetches if p.job == job and p.stream_open), None)


def relaying_hosts(coordinator, start_worker, n: int, job: str = JOB) -> list:
    """`n` workers of `job` that relay its news, each with its stream open."""
    hosts = []
    for i in range(n):  # (one by one: the tree's shape follows the order they come in)
        hosts.append(start_worker(coordinator.cfg.listen, f"h{i}", job=job,
                                  **relay_of(free_port())))
        eventually(lambda h=hosts[-1]: stream_of(h, job), "the job's stream open", 30)
    return hosts


def test_a_cold_start_down_a_tree_holds_every_hit_and_the_replica_serves_the_fanout(
        start_coordinator, start_worker):
    coordinator = start_coordinator(job_stream_fanout=2)
    hosts = relaying_hosts(coordinator, start_worker, 6)
    watches = coordinator.state.job_watches
    assert watches.streams == 2 and watches.redirected >= 4
    via = [stream_of(h).stream_via for h in hosts]
    assert via[:2] == ["", ""] and all(via[2:]), via  # the rest hang from relays
    relays = {h.cfg.relay_advertise: stream_of(h).stream_children for h in hosts}
    assert sum(relays.values()) == 4
    shown = cc("status", "--worker", hosts[5].target).stdout
    assert f"from relay {via[5]}" in shown, shown
    n = 300
    artifacts = {f"prog{i:05d}": f"executable {i}".encode() * 40 for i in range(n)}
    keys = list(artifacts)

    def waiter(i: int) -> list:
        c, me = process_of(hosts[i], i)
        return [decided(c, me, k) for k in keys]

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        waiting = [pool.submit(waiter, i) for i in range(1, 6)]
        designated, me = process_of(hosts[0], 0)
        for key in keys:
            got = decided(designated, me, key)
            assert got.kind == "COMPILE", got
            designated.publish(key, got.lease, artifacts[key], 1.0)
        answers = [w.result(timeout=300) for w in waiting]
    for got in answers:
        assert [d.kind for d in got] == ["HIT"] * n
        assert [d.data for d in got] == list(artifacts.values())
    assert watches.streams == 2  # still: the replica's streams did not grow with hosts
    assert watches.named < n


def test_when_the_designated_process_dies_the_turn_goes_down_the_tree(
        start_coordinator, start_worker):
    coordinator = start_coordinator(job_stream_fanout=1)
    hosts = relaying_hosts(coordinator, start_worker, 3)  # a chain: h0 <- h1 <- h2
    assert [bool(stream_of(h).stream_via) for h in hosts] == [False, True, True]
    designated, me = process_of(hosts[0], 0)
    got = decided(designated, me, "big")
    assert got.kind == "COMPILE"
    designated.keep_lease("big", got.lease)

    def process(i: int) -> tuple[str, bytes]:
        c, me = process_of(hosts[i], i)
        got = decided(c, me, "big")
        if got.kind == "COMPILE":
            c.publish("big", got.lease, f"compiled by {i}".encode(), 1.0)
            return "COMPILE", f"compiled by {i}".encode()
        return got.kind, got.data

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ends = {i: pool.submit(process, i) for i in (2, 1)}
        eventually(lambda: sum(stream_of(h).stream_waits for h in hosts[1:]) == 2,
                   "the waits on the streams", 30)
        designated.stop_lease("big", got.lease)
        designated.release("big", got.lease, pb.ABANDONED, "killed")
        got_ends = {i: f.result(timeout=120) for i, f in ends.items()}
    # The first-ranked process (1, a relay's host) is given the turn; 2 gets its bytes.
    assert got_ends == {1: ("COMPILE", b"compiled by 1"), 2: ("HIT", b"compiled by 1")}
    assert coordinator.state.job_watches.turns == 1


def worker_process(coordinator: str, tmp_path, name: str, port: int) -> tuple:
    sock = f"unix:///tmp/cc-{uuid.uuid4().hex[:8]}.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILECAST_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "compilecast.cli", "--log-level", "warning", "worker",
         "--listen", sock, "--coordinator", coordinator, "--cache-dir",
         str(tmp_path / name), "--metrics-port", "0", "--job", JOB,
         "--relay-listen", f"127.0.0.1:{port}", "--relay-advertise", f"127.0.0.1:{port}"],
        env=env)
    wait_until_healthy(sock, 60)
    return proc, sock


class Target:
    def __init__(self, target: str) -> None:
        self.target = target


@pytest.mark.parametrize("kill", ["SIGKILL", "SIGSTOP"])
def test_a_relay_killed_mid_job_costs_its_subtree_a_reconnect_never_an_answer(
        start_coordinator, tmp_path, kill):
    """A relay that dies (its connections closed) or freezes (SIGSTOP: still
    connected, saying nothing): the host below it resumes the news at the
    coordinator, and every HIT comes, none compiled, nothing named again."""
    coordinator = start_coordinator(job_stream_fanout=1)
    relay, relay_sock = worker_process(coordinator.cfg.listen, tmp_path, "relay", free_port())
    procs = [relay]
    try:
        eventually(lambda: stream_of(Target(relay_sock)), "the relay's stream open", 30)
        below, below_sock = worker_process(coordinator.cfg.listen, tmp_path, "below",
                                           free_port())
        procs.append(below)
        host = Target(below_sock)
        eventually(lambda: (s := stream_of(host)) and s.stream_via, "hung from the relay", 30)
        n = 400
        artifacts = {f"prog{i:05d}": f"executable {i}".encode() * 40 for i in range(n)}
        keys = list(artifacts)
        done: list = []

        def waiter() -> None:
            c, me = process_of(host, 1)
            for k in keys:
                done.append(decided(c, me, k))

        designated, me = process_of(Target(coordinator.cfg.listen), 0)
        watches = coordinator.state.job_watches
        named = watches.named
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(waiter)
            for i, key in enumerate(keys):
                if i == n // 2:  # mid-job: the relay dies
                    eventually(lambda: len(done) == n // 2, "half the job's hits", 120)
                    os.kill(relay.pid, getattr(signal, kill))
                    if kill == "SIGKILL":  # (a stopped one stays, frozen, connected)
                        relay.wait(30)
                got = decided(designated, me, key)
                assert got.kind == "COMPILE", got
                designated.publish(key, got.lease, artifacts[key], 1.0)
            waiting.result(timeout=300)
        assert [d.kind for d in done] == ["HIT"] * n
        assert [d.data for d in done] == list(artifacts.values())
        after = stream_of(host)
        assert after.stream_via == ""  # the coordinator serves it now
        # It resumed the news where it was (nothing replayed, nothing lost):
        # it named nothing, and sent no key upstream.
        assert after.stream_resumes == 1 and after.stream_restarts == 0
        assert watches.resumed >= 1
        # (through a frozen relay's silence, the one key its process waited for
        # then was named, once: NAME_AFTER_S is shorter than SILENT_S)
        assert watches.named - named <= (1 if kill == "SIGSTOP" else 0)
        metrics = CacheClient(below_sock).status()
        assert metrics.prefetches
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                p.wait(30)


def test_a_warm_start_s_manifest_comes_down_the_tree(start_coordinator, start_worker):
    from .test_manifests import JOB as WARM
    from .test_manifests import prefetch_of, published_job

    coordinator = start_coordinator(job_stream_fanout=2)
    artifacts = published_job(coordinator, start_worker, 1000)  # (its host relays nothing)
    sent = coordinator.state.manifests.sent
    hosts = relaying_hosts(coordinator, start_worker, 4, WARM)
    below = [h for h in hosts if stream_of(h, WARM).stream_via]
    assert len(below) >= 2
    for h in hosts:
        c = CacheClient(h.target, timeout_s=30)
        eventually(lambda c=c: (p := prefetch_of(c)) and p.artifacts_done == 1000,
                   "the job's manifest prefetched", 120)
        got = c.acquire_many(list(artifacts)[:500])
        assert all(a.decision == pb.HIT for a in got)
    # The coordinator sent the manifest to the hosts it serves; those below
    # had it from the relay they hang from.
    assert coordinator.state.manifests.sent - sent == len(hosts) - len(below)


def test_a_turn_a_relay_forged_is_never_taken(start_coordinator, start_worker, loop_thread):
    """A relay that hands its subtree a turn to compile the coordinator never
    gave (a lease that does not hold the key) makes nobody compile: the host
    checks the lease with the coordinator first, and its process goes on
    waiting, here for the real publish the relay passes on after it."""
    from compilecast.v1 import cache_pb2_grpc as rpc

    coordinator = start_coordinator(job_stream_fanout=1)
    go = asyncio.Event()
    published: list[pb.ArtifactInfo] = []

    class Forger(rpc.CompileCacheServicer):
        async def WatchJob(self, request_iterator, context):
            it = request_iterator.__aiter__()
            first = await it.__anext__()
            yield pb.JobEvents(epoch="forged", seq=first.since_seq)
            await go.wait()
            forged = pb.WaitEvent(decision=pb.COMPILE, lease=pb.Lease(
                id=424242, ttl_seconds=30, revision=1), reason="forged")
            yield pb.JobEvents(turns=[pb.KeyTurn(key="big", event=forged)])
            yield pb.JobEvents(published=published, seq=first.since_seq + 1, epoch="forged")
            async for _ in it:  # (held open)
                pass

    server, port = loop_thread.run(served(Forger()))  # type: ignore[abstract]
    try:
        # The replica's one stream of the job relays from the forger: the next goes there.
        relaying = loop_thread.run(open_relaying_stream(coordinator.cfg.listen, port))
        host = start_worker(coordinator.cfg.listen, "host", job=JOB)
        eventually(lambda: (s := stream_of(host)) and s.stream_via, "hung from the forger", 30)
        designated, me = process_of(Target(coordinator.cfg.listen), 0)
        got = decided(designated, me, "big")
        assert got.kind == "COMPILE"
        designated.keep_lease("big", got.lease)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            c, other = process_of(host, 1)
            waiting = pool.submit(decided, c, other, "big")
            eventually(lambda: stream_of(host).stream_waits == 1, "the wait on the stream", 30)
            published.append(designated.publish("big", got.lease, b"the real executable", 1.0))
            loop_thread.loop.call_soon_threadsafe(go.set)
            end = waiting.result(timeout=120)
        assert end.kind == "HIT" and end.data == b"the real executable", end
        loop_thread.run(relaying.aclose())
    finally:
        loop_thread.run(server.stop(None))


async def served(servicer) -> tuple:
    """`servicer` (a relay's forgery) on a port of its own: (server, port)."""
    from compilecast.serving import make_server

    server, _ = make_server(servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def open_relaying_stream(target: str, port: int, job: str = JOB):
    """A stream of `job` at the replica that says it relays from 127.0.0.1:`port`
    (held open until closed)."""
    from compilecast import wire

    stub = wire.stub(grpc.aio.insecure_channel(target))
    hold = asyncio.Event()

    async def requests():
        yield pb.JobWatchRequest(job=job, relay_address=f"127.0.0.1:{port}",
                                 requester=pb.Requester(job=job, process_id=99,
                                                        designated_process=0, client="relay"))
        await hold.wait()

    call = stub.WatchJob(requests())
    await call.__aiter__().__anext__()  # (its opening: served at the replica)

    class Held:
        async def aclose(self) -> None:
            hold.set()
            call.cancel()

    return Held()


def test_a_relays_forged_manifest_costs_the_coordinator_one_check(start_coordinator,
                                                                   start_worker, loop_thread):
    """A relay that serves its subtree a manifest of 20,000 bogus entries: the
    host checks the manifest's digest with the coordinator in one call, takes
    the coordinator's own instead, and fetches nothing on the relay's word
    (before: a fetch upstream a bogus entry, and the real ones never)."""
    from compilecast.v1 import cache_pb2_grpc as rpc

    from .test_manifests import JOB as WARM
    from .test_manifests import prefetch_of, published_job

    coordinator = start_coordinator(job_stream_fanout=1)
    artifacts = published_job(coordinator, start_worker, 5)
    up = CacheClient(coordinator.cfg.listen)
    eventually(lambda: len(up.stub.GetManifest(pb.ManifestRequest(job=WARM), timeout=10).entries)
               == len(artifacts), "the coordinator's manifest of the job", 30)
    bogus = [pb.ArtifactInfo(key=f"bogus{i:05d}", digest=f"{i:064x}", size=10)
             for i in range(20_000)]

    class Forger(rpc.CompileCacheServicer):
        async def WatchJob(self, request_iterator, context):
            it = request_iterator.__aiter__()
            first = await it.__anext__()
            yield pb.JobEvents(epoch="forged", seq=first.since_seq)
            async for _ in it:  # (held open)
                pass

        async def GetManifest(self, request, context):
            return pb.Manifest(job=request.job, digest="f" * 64, entries=bogus)

    server, port = loop_thread.run(served(Forger()))  # type: ignore[abstract]
    try:
        relaying = loop_thread.run(open_relaying_stream(coordinator.cfg.listen, port, WARM))
        host = start_worker(coordinator.cfg.listen, "host", job=WARM)
        c = CacheClient(host.target, timeout_s=30)
        eventually(lambda: (p := prefetch_of(c)) and p.artifacts_done == len(artifacts),
                   f"the coordinator's manifest prefetched ({prefetch_of(c)})", 60)
        assert prefetch_of(c).artifacts_total == len(artifacts)
        assert stream_of(host, WARM).stream_via == f"127.0.0.1:{port}"
        # Every real program a hit; a bogus entry is what it is: nobody's compile.
        got = c.acquire_many(["bogus00001", *artifacts])
        assert got[0].decision == pb.COMPILE and all(a.decision == pb.HIT for a in got[1:])
        loop_thread.run(relaying.aclose())
    finally:
        loop_thread.run(server.stop(None))
