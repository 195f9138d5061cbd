"""The Decide stream: decisions over one long-lived stream, against a real
coordinator (etcd, gRPC on loopback); `serve` alone with a decide function of
our own in tests/test_decideserve.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

import grpc
import pytest

from compilecast import decide
from compilecast.coordinator.server import Coordinator
from compilecast.errors import InvalidRequest, Status, UpstreamError
from compilecast.grpcutil import aio_channel, bearer
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import EtcdProcess, coordinator_config
from .deciding import DATA, ask, published, with_decider


def test_decisions_over_the_stream_are_those_of_acquire(coordinator, loop_thread):
    target = coordinator.cfg.listen
    info = published(target, "hit")

    async def body(d: decide.Decider):
        hit, fresh = await d.decide([ask("hit"), ask("fresh", client="a")])
        again = (await d.decide([ask("fresh", client="b")]))[0]
        return hit, fresh, again

    hit, fresh, again = loop_thread.run(with_decider(target, body))
    assert hit.decision == pb.HIT and hit.artifact.digest == info.digest
    assert fresh.decision == pb.COMPILE and fresh.lease.id > 0
    assert again.decision == pb.WAIT and "compiled by a" in again.reason
    # The lease granted over the stream is a real one: it publishes.
    c = CacheClient(target)
    try:
        c.publish("fresh", fresh.lease, DATA, 1.0)
        assert c.acquire("fresh").decision == pb.HIT
    finally:
        c.close()


def test_concurrent_decisions_share_messages(coordinator, loop_thread):
    target = coordinator.cfg.listen
    digests = {k: published(target, k).digest for k in ("h0", "h1", "h2")}

    async def body(d: decide.Decider):
        keys = [f"h{i % 3}" for i in range(300)]
        answers = await asyncio.gather(*(d.decide([ask(k)]) for k in keys))
        return keys, answers, d.messages

    keys, answers, messages = loop_thread.run(with_decider(target, body))
    assert [a[0].artifact.digest for a in answers] == [digests[k] for k in keys]
    assert all(a[0].decision == pb.HIT for a in answers)
    assert messages < len(keys) // 10, f"{messages} messages for {len(keys)} decisions"
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_lookups_total", {"result": "hit"}) == 300


def test_requests_asked_within_the_gap_leave_in_one_message(coordinator, loop_thread):
    """After a message, the stream holds what is asked for `gap_s`, then sends
    it in one message; the first request, asked at rest, leaves at once.
    Without a gap, requests asked 20 ms apart each leave alone."""
    target = coordinator.cfg.listen
    digest = published(target, "g").digest

    async def spaced(gap_s: float, spacing_s: float):
        channel = aio_channel(target, None)
        d = decide.Decider(rpc.CompileCacheStub(channel), timeout_s=30, gap_s=gap_s)
        try:
            # At rest: the first decision does not wait out the gap.
            first = await asyncio.wait_for(d.decide([ask("g")]), gap_s * 0.9 or 10)
            asks = []
            for _ in range(6):
                asks.append(asyncio.ensure_future(d.decide([ask("g")])))
                await asyncio.sleep(spacing_s)
            answers = [first, *await asyncio.gather(*asks)]
            return answers, d.messages
        finally:
            await d.close()
            await channel.close()

    held, held_messages = loop_thread.run(spaced(6.0, 0.02))
    alone, alone_messages = loop_thread.run(spaced(0.0, 0.02))
    for answers in (held, alone):
        assert [a[0].decision for a in answers] == [pb.HIT] * 7
        assert {a[0].artifact.digest for a in answers} == {digest}
    assert held_messages == 2, held_messages
    assert alone_messages > 2, alone_messages


def test_a_bad_message_is_refused_alone(coordinator, loop_thread):
    """A client that does not check its requests: the message with the bad key
    gets INVALID_ARGUMENT; the stream and the message after it carry on."""
    target = coordinator.cfg.listen
    published(target, "good")

    async def body():
        channel = aio_channel(target, None)
        try:
            call = rpc.CompileCacheStub(channel).Decide()
            await call.write(pb.DecideRequest(id=1, requests=[ask("bad key!")]))
            await call.write(pb.DecideRequest(id=2, requests=[ask("good")]))
            answers = {}
            async for answer in call:
                answers[answer.id] = answer
                if len(answers) == 2:
                    break
            call.cancel()
            return answers
        finally:
            await channel.close()

    answers = loop_thread.run(body())
    assert answers[1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "bad key!" in answers[1].error_message and not answers[1].responses
    assert answers[2].error_code == 0 and answers[2].responses[0].decision == pb.HIT


def test_the_decider_checks_requests_before_they_share_a_message(coordinator, loop_thread):
    async def body(d: decide.Decider):
        with pytest.raises(InvalidRequest):
            await d.decide([ask("ok"), ask("not/ok")])
        return d.messages

    assert loop_thread.run(with_decider(coordinator.cfg.listen, body)) == 0


def test_an_undecodable_message_ends_the_stream_with_invalid_argument(coordinator, loop_thread):
    async def body():
        channel = aio_channel(coordinator.cfg.listen, None)
        try:
            call = channel.stream_stream("/compilecast.v1.CompileCache/Decide")()
            await call.write(b"\xff\xff\xff")
            await call.done_writing()
            return await call.code(), await call.details()
        finally:
            await channel.close()

    code, details = loop_thread.run(body())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "DecideRequest" in details


def test_stream_is_authenticated_and_scoped(start_coordinator, tokens_file, loop_thread):

    coord = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    target = coord.cfg.listen

    async def decide_as(token: str, key: str):
        async def body(d: decide.Decider):
            return (await d.decide([ask(key)]))[0]

        return await with_decider(target, body, bearer(token))

    with pytest.raises(UpstreamError) as info:
        loop_thread.run(decide_as("", "k"))
    assert info.value.status == Status.UNAUTHENTICATED
    assert loop_thread.run(decide_as("a-read", "k")).decision == pb.COMPILE_LOCALLY
    granted = loop_thread.run(decide_as("a-pub", "k"))
    assert granted.decision == pb.COMPILE
    # Another tenant's stream does not see team-a's claim.
    assert loop_thread.run(decide_as("b-pub", "k")).decision == pb.COMPILE


def test_stream_failure_fails_its_decisions_and_the_next_one_reconnects(
        start_coordinator, started, loop_thread):
    from compilecast.coordinator.server import Coordinator

    coord = start_coordinator()
    target = coord.cfg.listen
    channel = loop_thread.run(_channel(target))
    decider = decide.Decider(rpc.CompileCacheStub(channel), timeout_s=3)
    try:
        first = loop_thread.run(decider.decide([ask("r")]))[0]
        assert first.decision == pb.COMPILE
        assert coord.registry.get_sample_value("compilecast_coordinator_decide_streams") == 1
        coord.stop()
        with pytest.raises(UpstreamError) as info:
            loop_thread.run(decider.decide([ask("r")]))
        assert info.value.status in (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED)
        again = started(Coordinator(coord.cfg))  # same port, same etcd state
        for _ in range(50):  # the channel reconnects after its backoff
            try:
                second = loop_thread.run(decider.decide([ask("r", client="other")]))[0]
                break
            except UpstreamError as exc:
                assert exc.status == Status.UNAVAILABLE
                time.sleep(0.2)
        assert second.decision == pb.WAIT  # the first lease still holds the key
        assert again.registry.get_sample_value("compilecast_coordinator_decide_streams") == 1
    finally:
        loop_thread.run(decider.close())
        loop_thread.run(channel.close())


async def _channel(target: str) -> grpc.aio.Channel:
    return aio_channel(target, None)


def test_worker_decides_over_one_stream(coordinator, start_worker, loop_thread):
    target = coordinator.cfg.listen
    w = start_worker(target)
    info = published(target, "on-coordinator")
    procs = [CacheClient(w.cfg.listen, identity=Identity(client=f"p{i}")) for i in range(4)]
    try:
        answers = [p.acquire("on-coordinator") for p in procs]
        assert {a.artifact.digest for a in answers} == {info.digest}
        assert procs[0].acquire("new").decision == pb.COMPILE
        assert procs[1].acquire("new").decision == pb.WAIT
        assert [a.decision for a in procs[2].acquire_many(["new", "on-coordinator"])] == [
            pb.WAIT, pb.HIT]
        # Every one of those decisions went over the worker's one stream.
        reg = coordinator.registry
        assert reg.get_sample_value("compilecast_coordinator_decide_streams") == 1
        assert hashlib.sha256(DATA).hexdigest() == info.digest
    finally:
        for p in procs:
            p.close()


def test_decisions_made_at_once_count_once(coordinator, loop_thread):
    """Decisions from the coordinator's memory (hits from its index, waits on
    claims its watch reported), through Decide, AcquireMany and Acquire,
    count each decision and its saved compile time exactly once, also for a
    message answered in parts (its hit at once, its miss the usual way)."""
    target = coordinator.cfg.listen
    info = published(target, "known")  # compile_time_seconds 1.0

    async def body(d: decide.Decider):
        alone = await d.decide([ask("known")])
        mixed = await d.decide([ask("known"), ask("unknown", client="a")])
        waits = [await d.decide([ask("unknown", client="b")]) for _ in range(3)]
        return alone, mixed, waits

    alone, mixed, waits = loop_thread.run(with_decider(target, body))
    c = CacheClient(target)
    try:
        unary = c.acquire("known")
        many = c.acquire_many(["known", "known"])
    finally:
        c.close()
    assert alone[0].decision == pb.HIT and alone[0].artifact.digest == info.digest
    assert [r.decision for r in mixed] == [pb.HIT, pb.COMPILE]
    assert all(w[0].decision == pb.WAIT and "compiled by a" in w[0].reason for w in waits)
    assert unary.decision == pb.HIT and [r.decision for r in many] == [pb.HIT, pb.HIT]
    reg = coordinator.registry
    hits = reg.get_sample_value("compilecast_coordinator_lookups_total", {"result": "hit"})
    assert hits == 5
    assert reg.get_sample_value("compilecast_coordinator_lookups_total", {"result": "miss"}) == 5  # publishing "known" was one
    assert reg.get_sample_value("compilecast_coordinator_decisions_total",
                                {"decision": "wait"}) == 3
    assert reg.get_sample_value("compilecast_coordinator_saved_compile_seconds_total") == 5.0


def test_a_hit_coalesced_with_a_miss_does_not_wait_for_etcd(tmp_path, prefix, started,
                                                           loop_thread):
    """Two callers' requests in one Decide message, a hit and a miss: the hit
    is answered while etcd (stopped) cannot answer the miss, which is
    decided once etcd is back. A raw message that takes no parts gets its
    answer whole."""
    etcd = EtcdProcess(tmp_path)
    try:
        coord = started(Coordinator(coordinator_config(etcd, tmp_path, prefix)))
        target = coord.cfg.listen
        published(target, "known")

        async def body(d: decide.Decider):
            await d.decide([ask("known")])  # the stream is open
            before = d.messages
            os.kill(etcd.proc.pid, signal.SIGSTOP)
            try:
                hit = asyncio.ensure_future(d.decide([ask("known")]))
                miss = asyncio.ensure_future(d.decide([ask("new", client="a")]))
                got_hit = await asyncio.wait_for(hit, 5)
                miss_pending = not miss.done()
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
            return got_hit, miss_pending, await miss, d.messages - before

        got_hit, miss_pending, got_miss, messages = loop_thread.run(with_decider(target, body))
        assert messages == 1  # both callers' requests went in one message
        assert got_hit[0].decision == pb.HIT and miss_pending
        assert got_miss[0].decision == pb.COMPILE

        async def whole():
            channel = aio_channel(target, None)
            try:
                call = rpc.CompileCacheStub(channel).Decide()
                await call.write(pb.DecideRequest(id=7, requests=[ask("known"), ask("other")]))
                answer = await call.read()
                await call.done_writing()
                return answer
            finally:
                await channel.close()

        answer = loop_thread.run(whole())
        assert answer.id == 7 and not answer.positions
        assert [r.decision for r in answer.responses] == [pb.HIT, pb.COMPILE]
        coord.stop()
    finally:
        etcd.stop()


def test_stopping_the_coordinator_ends_decide_streams_with_ok(start_coordinator, loop_thread):
    coord = start_coordinator()
    published(coord.cfg.listen, "k")

    async def open_stream():
        channel = aio_channel(coord.cfg.listen, None)
        call = rpc.CompileCacheStub(channel).Decide()
        await call.write(pb.DecideRequest(id=1, requests=[ask("k")]))
        answer = await call.read()
        return channel, call, answer

    channel, call, answer = loop_thread.run(open_stream())
    try:
        assert answer.responses[0].decision == pb.HIT
        coord.stop()  # drains, then stops the server

        async def ending():
            return await call.code()

        assert loop_thread.run(ending()) == grpc.StatusCode.OK
    finally:
        loop_thread.run(channel.close())

