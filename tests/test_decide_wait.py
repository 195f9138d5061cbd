"""Waits over the Decide stream: a wait is one message, answered by the event
that ends it. Against a real coordinator (etcd, gRPC on loopback), and
`serve` alone with wait functions of our own where a test must hold a wait."""

from __future__ import annotations

import asyncio
import threading

import grpc

from compilecast import decide, decideserve
from compilecast.errors import Status, UpstreamError
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient, Identity
from tests.conftest import eventually, until
from tests.deciding import DATA, against, ask, with_decider
from tests.test_streaming_publish import HeldUpload

MIB = 1 << 20


def wait_for(key: str, timeout_ms: int = 10_000, **requester) -> pb.WaitRequest:
    return pb.WaitRequest(key=key, timeout_ms=timeout_ms,
                          requester=pb.Requester(**(requester or {"client": "waiter"})))


def claimed(target: str, key: str) -> tuple[CacheClient, pb.Lease]:
    holder = CacheClient(target, identity=Identity(client="holder"))
    resp = holder.acquire(key)
    assert resp.decision == pb.COMPILE
    return holder, resp.lease


def waiters(coordinator) -> float:
    return coordinator.registry.get_sample_value("compilecast_coordinator_waiters") or 0


def test_a_wait_on_the_stream_ends_with_the_publish(coordinator, loop_thread):
    target = coordinator.cfg.listen
    holder, lease = claimed(target, "k")

    async def body(d: decide.Decider):
        waiting = asyncio.ensure_future(d.wait(wait_for("k")))
        await until(lambda: waiters(coordinator) == 1, "the wait registered")
        assert not waiting.done()
        await asyncio.to_thread(holder.publish, "k", lease, DATA, 2.0)
        woken = await waiting
        late = await d.wait(wait_for("k", client="late"))  # published already: HIT at once
        return woken, late, d.messages

    try:
        woken, late, messages = loop_thread.run(with_decider(target, body))
    finally:
        holder.close()
    assert woken.decision == pb.HIT and woken.artifact.size == len(DATA)
    assert late.decision == pb.HIT and late.artifact.digest == woken.artifact.digest
    assert messages == 2  # each wait went over the stream, as one message
    reg = coordinator.registry
    assert reg.get_sample_value("compilecast_coordinator_waits_total", {"outcome": "hit"}) == 2
    assert reg.get_sample_value("compilecast_coordinator_waiters") == 0


def test_a_wait_on_the_stream_times_out_and_is_promoted(coordinator, loop_thread):
    target = coordinator.cfg.listen
    holder, lease = claimed(target, "k")

    async def body(d: decide.Decider):
        timed_out = await d.wait(wait_for("k", timeout_ms=300))
        waiting = asyncio.ensure_future(d.wait(wait_for("k")))
        await until(lambda: waiters(coordinator) == 1, "the wait registered")
        await asyncio.to_thread(holder.release, "k", lease, pb.ABANDONED)
        return timed_out, await waiting

    try:
        timed_out, promoted = loop_thread.run(with_decider(target, body))
    finally:
        holder.close()
    assert timed_out.decision == pb.COMPILE_LOCALLY and "timeout" in timed_out.reason
    assert promoted.decision == pb.COMPILE and promoted.lease.id > 0


def test_a_wait_can_end_when_publishing_starts(start_coordinator, loop_thread):
    coordinator = start_coordinator(publish_stream_readers=4)
    holder = CacheClient(coordinator.cfg.listen, identity=Identity(job="j", process_id=0))
    data = b"x" * (5 * MIB)
    up = HeldUpload(holder, "k", holder.acquire("k").lease, data)

    async def body(d: decide.Decider):
        announced = await d.wait(wait_for("k", job="j", process_id=1), until_publishing=True)
        up.go.set()
        return announced, await d.wait(wait_for("k", job="j", process_id=1))

    try:
        announced, hit = loop_thread.run(with_decider(coordinator.cfg.listen, body))
        up.thread.join(10)
    finally:
        holder.close()
    assert announced.decision == pb.WAIT and announced.artifact.size == len(data)
    assert hit.decision == pb.HIT and hit.artifact.digest == announced.artifact.digest


def test_a_caller_that_gives_up_ends_its_wait_on_the_coordinator(coordinator, loop_thread):
    target = coordinator.cfg.listen
    holder, _ = claimed(target, "k")
    reg = coordinator.registry

    async def body(d: decide.Decider):
        try:
            await asyncio.wait_for(d.wait(wait_for("k", timeout_ms=60_000)), 0.5)
        except TimeoutError:
            pass
        # The stream lives on: its waiter is gone, its decisions still come.
        await asyncio.to_thread(eventually,
                                lambda: reg.get_sample_value("compilecast_coordinator_waiters")
                                == 0, "the abandoned wait ended", 5)
        answer = (await d.decide([ask("k", client="other")]))[0]
        return answer, d.messages, reg.get_sample_value("compilecast_coordinator_decide_streams")

    try:
        answer, messages, streams = loop_thread.run(with_decider(target, body))
    finally:
        holder.close()
    assert answer.decision == pb.WAIT
    assert messages == 3 and streams == 1  # the wait, its cancel, the decision: one stream


def test_a_process_waiting_behind_a_worker_waits_on_its_stream(coordinator, start_worker):
    target = coordinator.cfg.listen
    w = start_worker(target, job_streams=False)  # (its job's own stream: test_job_streams.py)
    holder, lease = claimed(target, "k")
    proc = CacheClient(w.cfg.listen, identity=Identity(job="j", process_id=1), timeout_s=10)
    try:
        assert proc.acquire("k").decision == pb.WAIT
        threading.Timer(0.3, holder.publish, ("k", lease, DATA, 1.0)).start()
        event = proc.wait("k", 10)
        assert event.decision == pb.HIT and event.artifact.size == len(DATA)
        # The acquire and the wait went over the worker's one stream.
        assert sum(d.messages for d in w.parts.deciders.open.values()) == 2
        assert coordinator.registry.get_sample_value(
            "compilecast_coordinator_decide_streams") == 1
    finally:
        proc.close()
        holder.close()


class _NoEventForWaits(rpc.CompileCacheServicer):
    """A server that answers a wait message with no event (it reads it as an
    empty batch of decisions)."""

    async def Decide(self, request_iterator, context):
        async def decided(requests):
            return [pb.AcquireResponse(decision=pb.WAIT) for _ in requests]

        async for answer in decideserve.serve(request_iterator, decided):
            yield answer


def test_a_wait_answered_without_an_event_fails_as_a_call_would(loop_thread):
    async def once(d: decide.Decider):
        try:
            await d.wait(wait_for("a"))
        except UpstreamError as exc:
            return exc.status, str(exc)
        return None, ""

    code, details = loop_thread.run(against(_NoEventForWaits(), once))
    assert code == Status.INTERNAL and "no event" in details, details


async def _inbox_stream():
    inbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (msg := await inbox.get()) is not None:
            yield msg

    return inbox, messages()


def test_serve_refuses_waits_past_its_limit_and_cancels_on_request(loop_thread):
    release = asyncio.Event()
    ended: list[str] = []

    async def held_wait(request, until_publishing):
        try:
            await release.wait()
        finally:
            ended.append(request.key)
        return pb.WaitEvent(decision=pb.HIT, reason=request.key)

    async def no_decisions(requests):
        raise AssertionError("no decisions were sent")

    async def body():
        inbox, messages = await _inbox_stream()
        answers = decideserve.serve(messages, no_decisions, wait=held_wait, max_waits=2)
        for i, key in enumerate(["a", "b", "c"], 1):
            inbox.put_nowait(pb.DecideRequest(id=i, wait=wait_for(key)))
        refused = await anext(answers)
        inbox.put_nowait(pb.DecideRequest(id=4, cancel=[1]))
        await until(lambda: ended, "the cancelled wait ended")
        cancelled = list(ended)
        release.set()
        rest = await anext(answers)
        inbox.put_nowait(None)
        return refused, cancelled, rest, [a async for a in answers]

    refused, cancelled, rest, tail = loop_thread.run(body())
    assert refused.id == 3 and refused.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert cancelled == ["a"]  # message 1's wait ended; nothing answers it
    assert (rest.id, rest.event.reason) == (2, "b") and tail == []


def test_a_drain_cuts_waits_short_unanswered_and_answers_decisions(loop_thread):
    streams = decideserve.Streams()
    release = asyncio.Event()

    async def held_wait(request, until_publishing):
        await asyncio.Event().wait()  # never ends by itself

    async def held_decide(requests):
        await release.wait()
        return [pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in requests]

    async def body():
        inbox, messages = await _inbox_stream()
        answers = decideserve.serve(messages, held_decide, wait=held_wait, streams=streams)
        inbox.put_nowait(pb.DecideRequest(id=1, wait=wait_for("w")))
        inbox.put_nowait(pb.DecideRequest(id=2, requests=[ask("d")]))
        first = asyncio.ensure_future(anext(answers))
        await asyncio.sleep(0.05)
        streams.drain()
        release.set()
        return [await first] + [a async for a in answers]

    got = loop_thread.run(body())
    assert [(a.id, a.responses[0].reason) for a in got] == [(2, "d")]


def test_a_worker_retiring_a_stream_lets_its_waits_end(start_coordinator, tokens_file,
                                                       start_worker, monkeypatch):
    """A worker keeps a bounded number of upstream streams (one per caller
    credential); the one it evicts is closed only once its waits have ended."""
    from compilecast.worker.daemon import decisions

    monkeypatch.setattr(decisions, "MAX_DECIDERS", 1)
    coordinator = start_coordinator(auth_tokens_file=str(tokens_file),
                                    allow_unauthenticated=False)
    w = start_worker(coordinator.cfg.listen)
    holder = CacheClient(coordinator.cfg.listen, token="a-pub", identity=Identity(client="h"))
    waiter = CacheClient(w.cfg.listen, token="a-pub", identity=Identity(client="w"),
                         timeout_s=10)
    other = CacheClient(w.cfg.listen, token="b-pub", identity=Identity(client="o"))
    try:
        lease = holder.acquire("k").lease
        assert waiter.acquire("k").decision == pb.WAIT
        got: list[pb.WaitEvent] = []
        waiting = threading.Thread(target=lambda: got.append(waiter.wait("k", 10)))
        waiting.start()
        eventually(lambda: coordinator.registry.get_sample_value(
            "compilecast_coordinator_waiters") == 1, "the wait reached the coordinator")
        assert other.acquire("elsewhere").decision == pb.COMPILE  # evicts team-a's stream
        assert len(w.parts.deciders.retiring) == 1
        holder.publish("k", lease, DATA, 1.0)
        waiting.join(10)
        assert got and got[0].decision == pb.HIT
        eventually(lambda: not w.parts.deciders.retiring, "the retired stream closed", 5)
    finally:
        for c in (holder, waiter, other):
            c.close()


def test_a_designated_process_that_came_and_went_leaves_no_waiter_its_grace(start_coordinator):
    """The job's designated process claimed the key and let it go (its
    publish failed) before process 1 even asked: process 1 is promoted
    instead of waiting out the designated grace for a process that will
    not come back."""
    coordinator = start_coordinator(designated_grace_s=600)
    target = coordinator.cfg.listen
    designated = CacheClient(target, identity=Identity(job="j", process_id=0,
                                                       designated_process=0))
    waiter = CacheClient(target, identity=Identity(job="j", process_id=1, designated_process=0))
    lease = designated.acquire("k").lease
    designated.release("k", lease, pb.ABANDONED, "its publish failed")
    assert waiter.acquire("k").decision == pb.WAIT  # not the designated: it waits first
    event = waiter.wait("k", 30)
    assert event.decision == pb.COMPILE, event  # well before the 600 s grace, and its timeout
    designated.close()
    waiter.close()
