"""The Decide stream, the server's end: a stream's messages decided
concurrently and answered as each is decided (bundled under load), its waits,
the gap a busy server asks of its clients, and a drain at shutdown. The
client's end (Decider) and what both ends share are in compilecast/decide.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

from compilecast.decide import check_batch
from compilecast.errors import CompilecastError, InvalidRequest, TooMany, status_of
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger("compilecast.decide")

IN_FLIGHT = 64  # messages of one stream decided at once; reading pauses beyond
MAX_STREAM_WAITS = 10_000  # waits of one stream at once; beyond, a wait is refused
MAX_BUNDLE = 64  # answers sent in one DecideResponse (takes_bundles)


class GapAdvice:
    """The gap a server asks of its Decide clients (DecideResponse.gap_ms),
    from how busy its event loop's thread is: no advice while that thread
    uses at most `low` of its core, `max_ms` from `high` on, in proportion
    between. Busy means messages queue; a longer gap puts more decisions in
    each message, and a message costs the server more than a decision does,
    so the same decisions then cost it less. An idle stream still sends a
    request at once (the gap only follows a message).

    `sample()` runs every `period_s` on the loop (`run()`); the thread's CPU
    use over each period is smoothed (half the last period's, half before).
    `cpu` and `clock` are the thread's CPU time and the wall clock, in
    seconds (tests pass their own)."""

    def __init__(self, max_ms: float, *, low: float = 0.3, high: float = 0.6,
                 period_s: float = 0.25, cpu: Callable[[], float] = time.thread_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= low < high:
            raise ValueError("GapAdvice needs 0 <= low < high")
        self.max_ms = max_ms
        self.low, self.high = low, high
        self.period_s = period_s
        self.cpu, self.clock = cpu, clock
        self._last = (cpu(), clock())
        self.busy = 0.0  # smoothed share of a core the loop's thread used
        self.gap_ms = 0  # the advice now (0: none)

    def sample(self) -> None:
        cpu, now = self.cpu(), self.clock()
        spent, elapsed = cpu - self._last[0], now - self._last[1]
        self._last = (cpu, now)
        if elapsed <= 0:
            return
        self.busy = 0.5 * self.busy + 0.5 * min(spent / elapsed, 1.0)
        share = (self.busy - self.low) / (self.high - self.low)
        self.gap_ms = round(self.max_ms * min(max(share, 0.0), 1.0))

    async def run(self) -> None:
        """Sample every period_s, on the loop whose thread is measured."""
        self._last = (self.cpu(), self.clock())
        while True:
            await asyncio.sleep(self.period_s)
            self.sample()


Decide = Callable[[Sequence[pb.AcquireRequest]], Awaitable[list[pb.AcquireResponse]]]
# A checked batch decided without waiting for anything (every key one the
# server already knows: a hit, a claim someone holds), or None: the message
# then goes the way of Decide.
# With partial (the client takes parts), the list may hold None for the keys
# that need more, and is None only when no key is known.
DecideNow = Callable[[Sequence[pb.AcquireRequest], bool],
                     list[pb.AcquireResponse | None] | None]
# A wait on the stream: the request and until_publishing in, the event that ends it out.
WaitOnce = Callable[[pb.WaitRequest, bool], Awaitable[pb.WaitEvent]]


def _valid(requests: Sequence[pb.AcquireRequest]) -> bool:
    """check_batch as a yes or no (the task deciding a bad batch refuses it)."""
    try:
        check_batch(requests)
    except InvalidRequest:
        return False
    return True


def _decided_now(decide_now: DecideNow, requests: Sequence[pb.AcquireRequest],
                 partial: bool) -> list[pb.AcquireResponse | None] | None:
    """`decide_now`'s answer for a checked batch; None for an empty batch and
    when it has none (or fails: the batch then goes the usual way)."""
    if not requests:
        return None
    try:
        return decide_now(requests, partial)
    except Exception:
        log.exception("deciding a Decide message at once failed; deciding it the usual way")
        return None


def _refusal(msg_id: int, exc: BaseException, positions: Sequence[int] = ()
             ) -> pb.DecideResponse:
    """The answer to a message (or the part at `positions`) that failed: its
    status, the stream carries on."""
    if not isinstance(exc, CompilecastError):
        log.error("Decide message %d failed", msg_id, exc_info=exc)
    status, message = status_of(exc, "Decide")
    return pb.DecideResponse(id=msg_id, error_code=status, error_message=message,
                             positions=positions)


def _bundled(first: pb.DecideResponse,
             answers: asyncio.Queue[pb.DecideResponse | None]) -> pb.DecideResponse:
    """`first` with the answers queued behind it (at most MAX_BUNDLE in
    all) in its `more`: under load, answers queue while one is written, and
    one message then carries them, as a Decider's requests do. The end of
    the stream (None) stays queued."""
    rest: list[pb.DecideResponse] = []
    while len(rest) < MAX_BUNDLE - 1 and not answers.empty():
        answer = answers.get_nowait()
        if answer is None:
            answers.put_nowait(None)
            break
        rest.append(answer)
    first.more.extend(rest)
    return first


class Streams:
    """The Decide streams a server is running, so that a shutdown can end
    them cleanly: `drain()` stops every stream reading; each answers what it
    has read and ends with OK, and the clients send whatever it did not read
    again on a new stream (to another replica)."""

    def __init__(self) -> None:
        self.draining = False
        self._readers: set[asyncio.Task[Any]] = set()

    def drain(self) -> None:
        self.draining = True
        for reader in list(self._readers):
            reader.cancel()


class _Serving:
    """The server end of one Decide stream: what `serve` reads, runs and
    answers."""

    def __init__(self, decide: Decide, wait: WaitOnce | None, in_flight: int, max_waits: int,
                 streams: Streams | None, decide_now: DecideNow | None) -> None:
        self.decide, self.wait, self.decide_now = decide, wait, decide_now
        self.max_waits, self.streams = max_waits, streams
        self.answers: asyncio.Queue[pb.DecideResponse | None] = asyncio.Queue()
        self.slots = asyncio.Semaphore(in_flight)
        self.running: set[asyncio.Task[None]] = set()
        self.waiting: dict[int, asyncio.Task[None]] = {}
        self.bundles = False  # the client takes answers bundled

    async def one(self, msg: pb.DecideRequest, checked: bool = False,
                  positions: list[int] | None = None) -> None:
        # positions: decide only those requests (the others were answered).
        try:
            if not checked:
                check_batch(msg.requests)
            requests = (msg.requests if positions is None
                        else [msg.requests[i] for i in positions])
            answer = pb.DecideResponse(id=msg.id, responses=await self.decide(requests),
                                       positions=positions or ())
        except Exception as exc:
            answer = _refusal(msg.id, exc, positions or ())
        finally:
            self.slots.release()
        self.answers.put_nowait(answer)

    def answer_known(self, msg: pb.DecideRequest) -> list[int] | None:
        """Answer what is known of a checked message at once: None when that
        was all of it, else the positions still to decide."""
        got = (_decided_now(self.decide_now, msg.requests, msg.answer_in_parts)
               if self.decide_now is not None else None)
        if got is None:
            return []
        known = [i for i, a in enumerate(got) if a is not None]
        if not known or (len(known) < len(got) and not msg.answer_in_parts):
            return []
        answers = [a for a in got if a is not None]
        if len(answers) == len(got):
            self.answers.put_nowait(pb.DecideResponse(id=msg.id, responses=answers))
            return None
        self.answers.put_nowait(pb.DecideResponse(id=msg.id, responses=answers,
                                                  positions=known))
        return [i for i, a in enumerate(got) if a is None]

    async def wait_one(self, msg: pb.DecideRequest) -> None:
        # Cancelled (by the client, or by a drain): no answer at all.
        try:
            if self.wait is None:
                answer = pb.DecideResponse(id=msg.id)
            else:
                answer = pb.DecideResponse(id=msg.id,
                                           event=await self.wait(msg.wait, msg.until_publishing))
        except Exception as exc:
            answer = _refusal(msg.id, exc)
        finally:
            if self.waiting.get(msg.id) is asyncio.current_task():
                del self.waiting[msg.id]
        self.answers.put_nowait(answer)

    def start(self, coro: Coroutine[Any, Any, None], msg_id: int | None = None) -> None:
        task = asyncio.create_task(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        if msg_id is not None:
            self.waiting[msg_id] = task

    async def take(self, msg: pb.DecideRequest) -> None:
        """One message read: its cancels, its wait, or its decisions."""
        self.bundles = msg.takes_bundles
        for gone in msg.cancel:
            if (task := self.waiting.pop(gone, None)) is not None:
                task.cancel()
        if msg.HasField("wait") and len(self.waiting) >= self.max_waits:
            self.answers.put_nowait(_refusal(msg.id, TooMany(
                f"at most {self.max_waits} waits per Decide stream; use Wait")))
        elif msg.HasField("wait"):
            self.start(self.wait_one(msg), msg.id)
        elif msg.requests or not msg.cancel:
            checked = self.decide_now is not None and _valid(msg.requests)
            rest = self.answer_known(msg) if checked else []
            if rest is None:
                return
            await self.slots.acquire()
            # [] decides the whole message (answered whole, as a client that
            # takes no parts expects).
            self.start(self.one(msg, checked, rest or None))

    async def read(self, messages: AsyncIterator[pb.DecideRequest]) -> None:
        try:
            try:
                async for msg in messages:
                    await self.take(msg)
            except asyncio.CancelledError:
                if self.streams is None or not self.streams.draining:
                    raise
                for task in self.waiting.values():  # cut short: the client sends them again
                    task.cancel()
            while self.running:  # the client finished writing, or a drain: answer what was read
                await asyncio.wait(set(self.running))
        finally:
            self.answers.put_nowait(None)


async def serve(messages: AsyncIterator[pb.DecideRequest], decide: Decide, *,
                wait: WaitOnce | None = None, in_flight: int = IN_FLIGHT,
                max_waits: int = MAX_STREAM_WAITS, streams: Streams | None = None,
                decide_now: DecideNow | None = None,
                advice: GapAdvice | None = None) -> AsyncIterator[pb.DecideResponse]:
    """Answer the messages of a Decide stream with `decide` (a checked batch
    in, one response per request out), each as soon as it is decided, and
    its wait messages with `wait` (without it, with no event: the client
    then uses Wait). With `decide_now`, a message it can decide at once
    (known hits and claims) is answered as it is read, without a task of its
    own; one the client takes in parts gets what is known at once and the
    rest later. With `streams`, a drain ends the stream after answering every
    decision read; the waits it cuts short go unanswered, so that the client
    sends them again. With `advice`, each answer message carries its gap
    (DecideResponse.gap_ms)."""
    s = _Serving(decide, wait, in_flight, max_waits, streams, decide_now)
    reader = asyncio.create_task(s.read(messages))
    if streams is not None:
        streams._readers.add(reader)
        reader.add_done_callback(streams._readers.discard)
        if streams.draining:
            reader.cancel()
    try:
        while (answer := await s.answers.get()) is not None:
            out = _bundled(answer, s.answers) if s.bundles and not s.answers.empty() else answer
            if advice is not None and advice.gap_ms:
                out.gap_ms = advice.gap_ms
            yield out
        await reader  # raises what ended the reading (an undecodable message)
    finally:
        reader.cancel()
        for task in list(s.running):
            task.cancel()
