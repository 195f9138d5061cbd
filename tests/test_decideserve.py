"""`serve`, the Decide stream's server half, alone: with a decide function of
our own where the test needs to hold a decision back, and odd servers that
answer in bundles or read one message per stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from compilecast import decide, decideserve
from compilecast.errors import InvalidRequest, Status, UpstreamError
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from .conftest import until
from .deciding import against, ask, fed


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
        await until(lambda: d.messages == 1, "the first message sent")
        second = asyncio.ensure_future(d.decide([ask("b0"), ask("b1"), ask("b2")]))
        await until(lambda: d.messages == 2, "the second message sent")
        third = asyncio.ensure_future(d.decide([ask("c")]))
        await until(lambda: d.messages == 3, "the third message sent")
        fourth = asyncio.ensure_future(d.decide([ask("d0"), ask("d1")]))
        got = await asyncio.gather(first, second, fourth)
        with pytest.raises(UpstreamError) as refused:
            await third
        return got, refused.value.status, d.messages

    got, code, messages = loop_thread.run(against(_AnswersInBundles(4), body))
    assert messages == 4
    assert [[(r.decision, r.reason) for r in rs] for rs in got] == [
        [(pb.HIT, "a")], [(pb.HIT, "b0"), (pb.WAIT, "b1"), (pb.WAIT, "b2")],
        [(pb.HIT, "d0"), (pb.WAIT, "d1")]]
    assert code == Status.RESOURCE_EXHAUSTED
