"""A busy coordinator asks its Decide clients for a longer gap between
messages (DecideResponse.gap_ms), and Deciders follow it: the advice from
how busy the loop's thread is (fake CPU time and clock: our own interface),
`serve` carrying it, a Decider against a server of our own, and a real
coordinator whose loop's thread reads as busy."""

from __future__ import annotations

import asyncio

import pytest

from compilecast import decide, decideserve
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from .conftest import eventually
from .deciding import against, ask, fed, published, with_decider


class Thread:
    """A thread's CPU time and the wall clock, advanced by the test."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.now = 0.0

    def advice(self, max_ms: float, **kw) -> decideserve.GapAdvice:
        return decideserve.GapAdvice(max_ms, cpu=lambda: self.cpu, clock=lambda: self.now, **kw)

    def period(self, advice: decideserve.GapAdvice, used: float, seconds: float = 0.25) -> None:
        """`seconds` pass, of which the thread used `used`; then a sample."""
        self.now += seconds
        self.cpu += seconds * used
        advice.sample()


def test_the_advice_follows_how_busy_the_loop_is():
    t = Thread()
    advice = t.advice(20)
    t.period(advice, 0.1)
    assert advice.gap_ms == 0
    for _ in range(12):
        t.period(advice, 1.0)
    assert advice.gap_ms == 20 and advice.busy > 0.99
    t.period(advice, 0.0)  # smoothed: one idle period halves how busy it looks
    assert 0 < advice.gap_ms < 20 and advice.busy < 0.51
    for _ in range(12):  # halfway between low (0.3) and high (0.6)
        t.period(advice, 0.45)
    assert advice.gap_ms == 10
    for _ in range(12):
        t.period(advice, 0.0)
    assert advice.gap_ms == 0 and advice.busy < 0.01


def test_the_advice_needs_low_under_high():
    with pytest.raises(ValueError):
        decideserve.GapAdvice(10, low=0.8, high=0.4)


def test_serve_carries_the_advice_in_each_answer(loop_thread):
    t = Thread()
    advice = t.advice(12)
    for _ in range(12):
        t.period(advice, 1.0)

    async def fake_decide(requests):
        return [pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in requests]

    async def body(advice):
        inbox, messages = fed()
        answers = decideserve.serve(messages, fake_decide, advice=advice)
        inbox.put_nowait(pb.DecideRequest(id=1, requests=[ask("a")]))
        busy = await anext(answers)
        for _ in range(12):
            if advice is not None:
                t.period(advice, 0.0)
        inbox.put_nowait(pb.DecideRequest(id=2, requests=[ask("b")]))
        idle = await anext(answers)
        inbox.put_nowait(None)
        return busy, idle, [a async for a in answers]

    busy, idle, rest = loop_thread.run(body(advice))
    assert (busy.id, busy.gap_ms, busy.responses[0].reason) == (1, 12, "a")
    assert (idle.id, idle.gap_ms) == (2, 0) and rest == []
    busy, _, _ = loop_thread.run(body(None))
    assert busy.gap_ms == 0


class _Advises(rpc.CompileCacheServicer):
    """Answers every request HIT, each answer asking for `gap_ms`."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    async def Decide(self, request_iterator, context):
        async for msg in request_iterator:
            yield pb.DecideResponse(id=msg.id, gap_ms=self.gap_ms, responses=[
                pb.AcquireResponse(decision=pb.HIT, reason=r.key) for r in msg.requests])


def test_the_decider_follows_the_advice_within_its_cap(loop_thread):
    """With no gap of its own, a Decider whose server asks for more than the
    cap holds requests for the cap (50 ms): eight asked 10 ms apart leave in
    a few messages. Told nothing, it sends them one by one."""

    async def spaced(d: decide.Decider):
        first = await d.decide([ask("first")])  # its answer carries the advice
        asks = []
        for i in range(8):
            asks.append(asyncio.ensure_future(d.decide([ask(f"k{i}")])))
            await asyncio.sleep(0.01)
        answers = [first, *await asyncio.gather(*asks)]
        assert [a[0].reason for a in answers] == ["first"] + [f"k{i}" for i in range(8)]
        return d.messages, d.advised_gap_s, d._gap(asyncio.get_running_loop().time() + 2)

    async def run(gap_ms: int):
        async def body(d: decide.Decider):
            d.gap_s = 0.0
            return await spaced(d)
        return await against(_Advises(gap_ms), body)

    advised, cap, later = loop_thread.run(run(10_000))
    plain, none, _ = loop_thread.run(run(0))
    assert cap == decide.MAX_ADVISED_GAP_S and none == 0.0
    assert later == 0.0  # advice older than ADVICE_S is no longer followed
    assert advised <= 5, advised
    assert plain > advised, (plain, advised)


@pytest.mark.parametrize("busy_gap_ms", [20, 0])
def test_a_busy_coordinator_asks_for_a_longer_gap(start_coordinator, loop_thread, busy_gap_ms):
    """A coordinator whose loop's thread reads as fully busy (its CPU time
    read from the wall clock: the advice's own interface, not this machine's
    load) answers Decide messages with its whole gap and shows it in its
    metric; one configured with 0 never asks."""
    coordinator = start_coordinator(decide_busy_gap_ms=busy_gap_ms)
    target = coordinator.cfg.listen
    published(target, "busy")
    coordinator.advice.cpu = coordinator.advice.clock  # every second used
    eventually(lambda: coordinator.advice.busy > coordinator.advice.high, "the loop reads busy")

    async def body(d: decide.Decider):
        answer = await d.decide([ask("busy")])
        return answer, d.advised_gap_s

    answer, advised = loop_thread.run(with_decider(target, body))
    assert answer[0].decision == pb.HIT
    gauge = coordinator.registry.get_sample_value("compilecast_coordinator_decide_gap_ms")
    assert round(advised * 1000) == busy_gap_ms and gauge == busy_gap_ms, (advised, gauge)
