"""The Decide stream: decisions over one long-lived stream, against a real
coordinator (etcd, gRPC on loopback); `serve` alone with a decide function of
our own where the test needs to hold a decision back."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

import grpc
import pytest

from compilecast import decide, decideserve
from compilecast.coordinator.server import Coordinator
from compilecast.errors import InvalidRequest
from compilecast.grpcutil import aio_channel, bearer
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.client import CacheClient, Identity

from .conftest import EtcdProcess, coordinator_config

DATA = b"decided" * 10_000


def ask(key: str, **requester) -> pb.AcquireRequest:
    return pb.AcquireRequest(key=key, requester=pb.Requester(**requester))


def published(target: str, key: str) -> pb.ArtifactInfo:
    c = CacheClient(target)
    try:
        return c.publish(key, c.acquire(key).lease, DATA, 1.0)
    finally:
        c.close()


def fed():
    """A queue to put Decide messages in (None ends the stream) and the
    stream `serve` reads them from."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (msg := await inbox.get()) is not None:
            yield msg

    return inbox, messages()


async def with_decider(target: str, body, metadata: tuple = ()):
    channel = aio_channel(target, None)
    decider = decide.Decider(rpc.CompileCacheStub(channel), metadata, timeout_s=10)
    try:
        return await body(decider)
    finally:
        await decider.close()
        await channel.close()


async def against(servicer, body):
    """with_decider against a server of the test's own (an odd coordinator)."""
    server = grpc.aio.server()
    rpc.add_CompileCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await with_decider(f"127.0.0.1:{port}", body)
    finally:
        await server.stop(0)


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

    with pytest.raises(grpc.aio.AioRpcError) as info:
        loop_thread.run(decide_as("", "k"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
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
        with pytest.raises(grpc.aio.AioRpcError) as info:
            loop_thread.run(decider.decide([ask("r")]))
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
        again = started(Coordinator(coord.cfg))  # same port, same etcd state
        for _ in range(50):  # the channel reconnects after its backoff
            try:
                second = loop_thread.run(decider.decide([ask("r", client="other")]))[0]
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
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


def test_serve_answers_each_message_when_it_is_decided(loop_thread):
    """A message held back (a miss waiting on etcd) does not hold up the
    answers to the messages after it."""
    release = asyncio.Event()

    async def fake_decide(requests):
        if requests[0].key == "slow":
            await release.wait()
        return [pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in requests]

    async def body():
        inbox, messages = fed()
        answers = decideserve.serve(messages, fake_decide)
        for i, key in enumerate(["slow", "fast", "faster"], 1):
            inbox.put_nowait(pb.DecideRequest(id=i, requests=[ask(key)]))
        order = [(await anext(answers)).id, (await anext(answers)).id]
        release.set()
        order.append((await anext(answers)).id)
        inbox.put_nowait(None)
        rest = [a async for a in answers]
        return order, rest

    order, rest = loop_thread.run(body())
    assert sorted(order[:2]) == [2, 3] and order[2] == 1 and rest == []


def test_serve_answers_what_it_can_decide_at_once_as_it_reads(loop_thread):
    """decide_now's answers go out as their messages are read, past a held
    message; what it declines, what fails in it and bad batches go the usual
    way (the last refused there, never shown to decide_now)."""
    release = asyncio.Event()
    decided, shown = [], []

    async def fake_decide(requests):
        decided.append(requests[0].key)
        if requests[0].key == "held":
            await release.wait()
        return [pb.AcquireResponse(decision=pb.COMPILE, reason=r.key) for r in requests]

    def fake_now(requests, partial):
        assert not partial  # these messages do not take parts
        shown.append(requests[0].key)
        if requests[0].key == "broken":
            raise RuntimeError("a bug in the fast path")
        if all(r.key.startswith("hit") for r in requests):
            return [pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in requests]
        return None

    async def body():
        inbox, messages = fed()
        answers = decideserve.serve(messages, fake_decide, decide_now=fake_now)
        batches = [["held"], ["hit-a", "hit-b"], ["hit-c", "miss"], ["broken"], ["bad key!"]]
        for i, keys in enumerate(batches, 1):
            inbox.put_nowait(pb.DecideRequest(id=i, requests=[ask(k) for k in keys]))
        got = {}
        for _ in range(4):  # all but the held message
            a = await anext(answers)
            got[a.id] = a
        release.set()
        inbox.put_nowait(None)
        got.update({a.id: a async for a in answers})
        return got

    got = loop_thread.run(body())
    assert [(r.decision, r.reason) for r in got[2].responses] == [
        (pb.HIT, "hit-a"), (pb.HIT, "hit-b")]
    assert [r.decision for r in got[3].responses] == [pb.COMPILE, pb.COMPILE]
    assert [r.decision for r in got[4].responses] == [pb.COMPILE]
    assert got[5].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert got[1].responses[0].reason == "held"
    assert sorted(decided) == ["broken", "held", "hit-c"]
    assert sorted(shown) == ["broken", "held", "hit-a", "hit-c"]


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


def test_a_message_taken_in_parts_gets_what_is_known_at_once(loop_thread):
    """With answer_in_parts, the known requests of a message are answered as
    it is read (their positions given) while its others are decided; a
    failure there refuses those positions only. Without it, the message is
    decided and answered whole."""
    release = asyncio.Event()
    decided: list[list[str]] = []

    async def fake_decide(requests):
        decided.append([r.key for r in requests])
        if any(r.key == "boom" for r in requests):
            raise InvalidRequest("boom is refused")
        await release.wait()
        return [pb.AcquireResponse(decision=pb.COMPILE, reason=r.key) for r in requests]

    def fake_now(requests, partial):
        got = [pb.AcquireResponse(decision=pb.HIT, reason=r.key)
               if r.key.startswith("hit") else None for r in requests]
        if all(a is None for a in got) or (None in got and not partial):
            return None
        return got

    async def body():
        inbox, messages = fed()
        answers = decideserve.serve(messages, fake_decide, decide_now=fake_now)
        for i, (keys, parts) in enumerate([(["hit-a", "miss", "hit-b"], True),
                                           (["hit-c", "miss"], False),
                                           (["hit-d", "boom"], True)], 1):
            inbox.put_nowait(pb.DecideRequest(id=i, requests=[ask(k) for k in keys],
                                              answer_in_parts=parts))
        early = [await anext(answers) for _ in range(3)]  # before any miss is decided
        release.set()
        inbox.put_nowait(None)
        return early, [a async for a in answers]

    early, late = loop_thread.run(body())

    def seen(a):
        return (a.id, list(a.positions), [r.reason for r in a.responses], a.error_code)

    refused = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert sorted(map(seen, early)) == [(1, [0, 2], ["hit-a", "hit-b"], 0),
                                        (3, [0], ["hit-d"], 0), (3, [1], [], refused)]
    assert sorted(map(seen, late)) == [(1, [1], ["miss"], 0),
                                       (2, [], ["hit-c", "miss"], 0)]
    assert sorted(decided) == [["boom"], ["hit-c", "miss"], ["miss"]]


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


def test_a_drain_answers_what_was_read_and_reads_no_more(loop_thread):
    release = asyncio.Event()
    streams = decideserve.Streams()

    async def fake_decide(requests):
        await release.wait()
        return [pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in requests]

    async def body():
        inbox: asyncio.Queue = asyncio.Queue()
        read: list[int] = []

        async def messages():
            while (msg := await inbox.get()) is not None:
                read.append(msg.id)
                yield msg

        answers = decideserve.serve(messages(), fake_decide, streams=streams)
        inbox.put_nowait(pb.DecideRequest(id=1, requests=[ask("held")]))
        first = asyncio.ensure_future(anext(answers))
        await asyncio.sleep(0.05)  # message 1 is read and being decided
        streams.drain()
        inbox.put_nowait(pb.DecideRequest(id=2, requests=[ask("after")]))
        release.set()
        got = [await first] + [a async for a in answers]
        return got, read

    got, read = loop_thread.run(body())
    assert [(a.id, a.responses[0].reason) for a in got] == [(1, "held")]
    assert read == [1]


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


class _ReadsOneMessagePerStream(rpc.CompileCacheServicer):
    """A replica that drains after each message: it answers the first message
    of every stream (slowly) and ends the stream with OK."""

    def __init__(self) -> None:
        self.streams = 0

    async def Decide(self, request_iterator, context):
        self.streams += 1
        async for msg in request_iterator:
            await asyncio.sleep(0.3)
            yield pb.DecideResponse(id=msg.id, responses=[
                pb.AcquireResponse(decision=pb.WAIT, reason=f"stream {self.streams}: {r.key}")
                for r in msg.requests])
            return


def test_what_a_drained_stream_did_not_read_goes_again_on_a_new_one(loop_thread):
    servicer = _ReadsOneMessagePerStream()

    async def two(d: decide.Decider):
        first = asyncio.ensure_future(d.decide([ask("a")]))
        await asyncio.sleep(0.05)  # "a" is on the wire: "b" goes in a second message
        second = await d.decide([ask("b")])
        return (await first) + second, d.messages

    answers, messages = loop_thread.run(against(servicer, two))
    # "b" went out on stream 1, was not read there, and was answered on stream 2.
    assert [a.reason for a in answers] == ["stream 1: a", "stream 2: b"]
    assert servicer.streams == 2 and messages >= 2


def test_answers_that_queue_leave_in_one_message(loop_thread):
    """A client that takes bundles gets the answers queued behind the one
    being written in that one's `more`, each once and as it would have been
    alone (parts and refusals included); a held answer leaves on its own
    later. Without takes_bundles, every answer is a message of its own."""
    release: list[asyncio.Event] = []

    async def fake_decide(requests):
        if requests[0].key == "held":
            await release[-1].wait()
        return [pb.AcquireResponse(decision=pb.COMPILE, reason=r.key) for r in requests]

    def fake_now(requests, partial):
        got = [pb.AcquireResponse(decision=pb.HIT, reason=r.key)
               if r.key.startswith("hit") else None for r in requests]
        return None if all(a is None for a in got) else got

    async def body(bundles: bool):
        release.append(asyncio.Event())
        inbox, messages = fed()
        answers = decideserve.serve(messages, fake_decide, decide_now=fake_now)
        keys = [["held"], ["bad key!"], ["hit-a", "miss"]] + [[f"hit-{i}"] for i in range(20)]
        for i, k in enumerate(keys, 1):
            inbox.put_nowait(pb.DecideRequest(id=i, requests=[ask(x) for x in k],
                                              answer_in_parts=True, takes_bundles=bundles))
        sent = [await anext(answers)]
        while sum(1 + len(a.more) for a in sent) < len(keys):  # all but the held one
            sent.append(await anext(answers))
        release[-1].set()
        inbox.put_nowait(None)
        sent += [a async for a in answers]
        return sent

    def each(sent):
        return [(a.id, list(a.positions), [r.reason for r in a.responses], a.error_code)
                for m in sent for a in (m, *m.more)]

    for bundles in (True, False):
        sent = loop_thread.run(body(bundles))
        got = each(sent)
        refused = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert sorted(got) == sorted(
            [(1, [], ["held"], 0), (2, [], [], refused), (3, [0], ["hit-a"], 0),
             (3, [1], ["miss"], 0)] + [(i, [], [f"hit-{i - 4}"], 0) for i in range(4, 24)])
        assert got[-1][0] == 1, got  # the held answer came last
        assert all(not a.more for m in sent for a in m.more)
        if bundles:
            assert len(sent) < 8, f"{len(sent)} messages for {len(got)} answers"
        else:
            assert len(sent) == len(got)


class _AnswersInBundles(rpc.CompileCacheServicer):
    """A server that reads `n` messages and then answers them all in one
    DecideResponse: the first whole, each later one in two parts (the
    second's first request HIT, the rest WAIT), the third refused."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def Decide(self, request_iterator, context):
        read = []
        async for msg in request_iterator:
            assert msg.takes_bundles
            read.append(msg)
            if len(read) < self.n:
                continue
            answers = [pb.DecideResponse(id=read[0].id, responses=[
                pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in read[0].requests])]
            for i, m in enumerate(read[1:], 1):
                if i == 2:
                    answers.append(pb.DecideResponse(
                        id=m.id, error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                        error_message="too many"))
                    continue
                answers.append(pb.DecideResponse(id=m.id, positions=[0], responses=[
                    pb.AcquireResponse(decision=pb.HIT, reason=m.requests[0].key)]))
                answers.append(pb.DecideResponse(
                    id=m.id, positions=range(1, len(m.requests)), responses=[
                        pb.AcquireResponse(decision=pb.WAIT, reason=r.key)
                        for r in m.requests[1:]]))
            yield pb.DecideResponse(id=answers[0].id, responses=answers[0].responses,
                                    more=answers[1:])
            read = []


def test_the_decider_takes_answers_in_bundles(loop_thread):
    """Every answer of a bundle settles its own callers: whole, in parts, or
    refused."""
    async def body(d: decide.Decider):
        # One at a time, so that each call is a message of its own.
        first = asyncio.ensure_future(d.decide([ask("a")]))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(d.decide([ask("b0"), ask("b1"), ask("b2")]))
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(d.decide([ask("c")]))
        await asyncio.sleep(0.05)
        fourth = asyncio.ensure_future(d.decide([ask("d0"), ask("d1")]))
        got = await asyncio.gather(first, second, fourth)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await third
        return got, refused.value.code(), d.messages

    got, code, messages = loop_thread.run(against(_AnswersInBundles(4), body))
    assert messages == 4
    assert [[(r.decision, r.reason) for r in rs] for rs in got] == [
        [(pb.HIT, "a")], [(pb.HIT, "b0"), (pb.WAIT, "b1"), (pb.WAIT, "b2")],
        [(pb.HIT, "d0"), (pb.WAIT, "d1")]]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
