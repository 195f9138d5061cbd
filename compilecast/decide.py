"""Decisions over one long-lived stream (the Decide RPC), both ends.

A unary Acquire costs gRPC Python about half a millisecond of CPU on each
side for the call alone (BENCHMARKS.md, "Decisions per second"); a message on
an open stream costs about half of that, and one message can carry many
decisions. A worker daemon therefore keeps one
Decide stream per credential to the coordinator and sends every decision its
processes ask for over it:

- `Decider` (the client) coalesces: while one message is being written, and
  for `gap_s` after it was sent (GAP_S by default), the requests that arrive
  queue up and leave together in the next one (at most MAX_BATCH requests).
  So under load one message carries many decisions and the stream sends at
  most one message per gap, while at rest (nothing sent within the gap) a
  request leaves at once.
- `serve` (the server) decides each message as it arrives, concurrently (a
  slow miss that waits on etcd never holds up the hits behind it), and answers
  it when it is decided; ids match answers to messages. A message the client
  takes in parts (`answer_in_parts`, which Decider always sets) is answered
  in two: what the server knows at once (hits from its index), then the rest.
  So a hit that shares a message with a miss (the client coalesced the two
  callers' requests) does not wait for the miss's etcd write. Answers
  coalesce too: those that queue while one is written leave together in one
  message (`takes_bundles`, which Decider always sets), since gRPC's cost
  is per message.

A message that is refused (a bad key from a client that does not validate)
gets its status in its answer; the stream and the other messages carry on.
A stopping server drains its streams (`Streams.drain`): each answers what it
has read and ends with OK, and the client sends the rest again elsewhere.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from compilecast import validate
from compilecast.errors import CompilecastError, InvalidRequest, TooMany
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # requests per message, as for AcquireMany
IN_FLIGHT = 64  # messages of one stream decided at once; reading pauses beyond
MAX_WAITS = 10_000  # waits of one stream at once; beyond, a wait is refused
MAX_BUNDLE = 64  # answers sent in one DecideResponse (takes_bundles)
# A stream's messages are at least this far apart. A message costs the
# coordinator about twice what a decision in it does (gRPC Python's per-message
# floor), so under load holding requests a few milliseconds to share one
# message halves the messages; at 5,000 mixed decisions a second over 8 streams
# it gave back a tenth to a sixth of the coordinator's core (BENCHMARKS.md,
# "Decisions per second").
GAP_S = 0.005
# A busy server asks for a longer gap (DecideResponse.gap_ms, GapAdvice): at
# 5,000 mixed decisions a second it took the coordinator's CPU a decision from
# a median of 168 to 140 us (BENCHMARKS.md, "Decisions per second"). A client
# follows the advice for ADVICE_S after the answer that carried it, and never
# waits longer than MAX_ADVISED_GAP_S whatever a server asks.
ADVICE_S = 1.0
MAX_ADVISED_GAP_S = 0.05

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def check_batch(requests: Sequence[pb.AcquireRequest]) -> None:
    """Refuse a batch (AcquireMany, or one Decide message) before any of it is
    decided: a bad request fails its batch and nothing else."""
    if len(requests) > MAX_BATCH:
        raise InvalidRequest(f"at most {MAX_BATCH} requests per batch")
    for r in requests:
        validate.acquire_request(r)


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


def ends_wait(event: pb.WaitEvent, until_publishing: bool) -> bool:
    """Whether `event` ends a wait for its caller: any decision but WAIT (a
    heartbeat), and with until_publishing also the WAIT that says the holder
    has started to publish (it carries the artifact)."""
    return event.decision != pb.WAIT or (until_publishing and event.HasField("artifact"))


async def ending_event(events: AsyncIterator[pb.WaitEvent],
                       until_publishing: bool) -> pb.WaitEvent:
    """The event of a Wait stream that ends it (`ends_wait`). The stream is
    closed at once, so that its waiter record goes with it."""
    async with contextlib.aclosing(events):
        async for event in events:
            if ends_wait(event, until_publishing):
                return event
    return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason="the wait ended without a decision")


def _refusal(msg_id: int, exc: BaseException, positions: Sequence[int] = ()
             ) -> pb.DecideResponse:
    """The answer to a message (or the part at `positions`) that failed: its
    status, the stream carries on."""
    if isinstance(exc, CompilecastError):
        return pb.DecideResponse(id=msg_id, error_code=exc.code.value[0], error_message=str(exc),
                                 positions=positions)
    log.error("Decide message %d failed", msg_id, exc_info=exc)
    return pb.DecideResponse(id=msg_id, error_code=grpc.StatusCode.INTERNAL.value[0],
                             error_message="Decide: internal error", positions=positions)


def _bundled(first: pb.DecideResponse, answers: asyncio.Queue) -> pb.DecideResponse:
    """`first` with the answers queued behind it (at most MAX_BUNDLE in
    all) in its `more`: under load, answers queue while one is written, and
    one message then carries them, as a Decider's requests do. The end of
    the stream (None) stays queued."""
    rest = []
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
        self._readers: set[asyncio.Task] = set()

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
        self.running: set[asyncio.Task] = set()
        self.waiting: dict[int, asyncio.Task] = {}
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
        got = _decided_now(self.decide_now, msg.requests, msg.answer_in_parts)
        known = [i for i, a in enumerate(got or ()) if a is not None]
        if not known or (len(known) < len(got) and not msg.answer_in_parts):
            return []
        if len(known) == len(got):
            self.answers.put_nowait(pb.DecideResponse(id=msg.id, responses=got))
            return None
        self.answers.put_nowait(pb.DecideResponse(
            id=msg.id, responses=[got[i] for i in known], positions=known))
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

    def start(self, coro, msg_id: int | None = None) -> None:
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
                max_waits: int = MAX_WAITS, streams: Streams | None = None,
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


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error as a unary call would have raised it, for callers of Decider."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class _NoWaits(Exception):
    """The server answered a wait message with no event: it predates them."""


class _Entry:
    """One caller's decisions (or one wait) on their way through a Decider."""

    __slots__ = ("done", "got", "left", "msg_id", "requests", "sent", "start",
                 "until_publishing", "wait")

    def __init__(self, done: asyncio.Future, requests: Sequence[pb.AcquireRequest] = (),
                 wait: pb.WaitRequest | None = None, until_publishing: bool = False) -> None:
        self.requests = requests
        self.wait = wait
        self.until_publishing = until_publishing
        self.done = done
        self.sent = 0  # times written (at most twice: once more after a drain)
        self.msg_id = 0  # the message that carried it last
        self.start = 0  # where its requests begin in that message
        self.got: list[pb.AcquireResponse | None] = []  # answers in parts so far
        self.left = 0  # requests not answered yet


class Decider:
    """The client end: `await decide(requests)` and `await wait(request)`
    from any number of tasks of one event loop; all of it travels over one
    Decide stream of `stub`.

    A message leaves at least `gap_s` after the one before it (GAP_S; 0:
    as soon as the one before is written); what is asked meanwhile shares it.

    The stream opens on first use and again after it fails; a failure fails
    the decisions and waits in flight with the stream's status (each caller
    then does what it does when a unary call fails: the worker compiles
    locally). A stream the server ends with OK (a draining replica) has
    answered every decision it read, so what it left unanswered is sent
    again, once, on a new stream. Against a server without Decide, it falls
    back to AcquireMany, one call per `decide`, and to Wait; against one
    that predates waits on the stream, to Wait.
    """

    def __init__(self, stub, metadata: tuple = (), *, timeout_s: float = 5.0,
                 gap_s: float = GAP_S) -> None:
        self._stub = stub
        self._metadata = metadata
        self.timeout_s = timeout_s
        self.gap_s = gap_s  # at least this long between two messages (0: none)
        self._queue: collections.deque[_Entry] = collections.deque()
        self._cancels: list[int] = []  # ids of sent waits nobody wants answered any more
        self._wake = asyncio.Event()
        self._sent: dict[int, list[_Entry]] = {}
        self._ids = itertools.count(1)
        self._runner: asyncio.Task | None = None
        self._unary = False  # the server has no Decide
        self._no_waits = False  # the server answers no waits on the stream
        self.messages = 0  # messages written (fewer than decide calls under load)
        self.advised_gap_s = 0.0  # the server's advice (DecideResponse.gap_ms), capped
        self._advised_at = 0.0  # loop time of the answer that carried it

    async def _ask(self, entry: _Entry, limit_s: float | None):
        """Queue `entry`, wake the writer and wait for its answer."""
        self._queue.append(entry)
        self._wake.set()
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        try:
            return await asyncio.wait_for(entry.done, limit_s)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer within {limit_s:.1f} s") from None
        finally:
            if entry.wait is not None and entry.done.cancelled():  # given up unanswered
                self._give_up(entry)

    def _give_up(self, entry: _Entry) -> None:
        """A caller stopped waiting: a wait already sent is cancelled upstream."""
        if entry.wait is not None and self._sent.pop(entry.msg_id, None) is not None:
            self._cancels.append(entry.msg_id)
            self._wake.set()

    async def decide(self, requests: Sequence[pb.AcquireRequest],
                     timeout_s: float | None = None) -> list[pb.AcquireResponse]:
        """One response per request, in order. Raises grpc.aio.AioRpcError
        as AcquireMany would, and InvalidRequest for a bad request (checked
        here, so that it never shares a message with anyone else's)."""
        check_batch(requests)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self._unary:
            entry = _Entry(asyncio.get_running_loop().create_future(), requests)
            try:
                return await self._ask(entry, timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the server has no Decide stream; using AcquireMany")
                self._unary = True
        resp = await self._stub.AcquireMany(pb.AcquireManyRequest(requests=requests),
                                            timeout=timeout, metadata=self._metadata)
        return list(resp.responses)

    async def wait(self, request: pb.WaitRequest, *,
                   until_publishing: bool = False) -> pb.WaitEvent:
        """The event that ends a wait for `request.key`: HIT, COMPILE
        (promoted) or COMPILE_LOCALLY, or with `until_publishing` also the
        WAIT that says the holder has started to publish. Raises
        grpc.aio.AioRpcError as Wait would; a caller that is cancelled or
        times out ends the wait on the server too."""
        timeout = (request.timeout_ms / 1000.0 + self.timeout_s
                   if request.timeout_ms > 0 else None)
        if not (self._unary or self._no_waits):
            entry = _Entry(asyncio.get_running_loop().create_future(), wait=request,
                           until_publishing=until_publishing)
            try:
                return await self._ask(entry, timeout)
            except _NoWaits:
                log.info("the server answers no waits on the Decide stream; using Wait")
                self._no_waits = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNIMPLEMENTED,
                                      grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
        call = self._stub.Wait(request, timeout=timeout, metadata=self._metadata)
        try:
            async for event in call:
                if ends_wait(event, until_publishing):
                    return event
        finally:
            call.cancel()
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the Wait stream ended without a decision")

    async def close(self, *, when_idle: bool = False) -> None:
        """Close the stream; with when_idle, once every decision and wait
        asked so far is answered (a worker retiring a stream it no longer
        uses must not cut the long waits on it short)."""
        asked = {e.done for e in self._queue} | {
            e.done for sent in self._sent.values() for e in sent}
        if when_idle and asked:
            await asyncio.wait(asked)
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    def _next_message(self) -> pb.DecideRequest:
        """A wait alone, or the decisions queued up to the next wait (at most
        MAX_BATCH requests), as one message, with the cancels pending."""
        msg = pb.DecideRequest(id=next(self._ids), cancel=self._cancels, takes_bundles=True)
        self._cancels.clear()
        entries: list[_Entry] = []
        while self._queue:
            entry = self._queue[0]
            if entries and (entry.wait is not None
                            or len(msg.requests) + len(entry.requests) > MAX_BATCH):
                break
            self._queue.popleft()
            if entry.done.done():  # its caller gave up before it was sent
                continue
            entry.sent += 1
            entry.msg_id = msg.id
            entries.append(entry)
            if entry.wait is not None:
                msg.wait.CopyFrom(entry.wait)
                msg.until_publishing = entry.until_publishing
                break
            entry.start, entry.left = len(msg.requests), len(entry.requests)
            entry.got = [None] * entry.left
            msg.requests.extend(entry.requests)
            msg.answer_in_parts = True
        if entries:
            self._sent[msg.id] = entries
        return msg

    async def _run(self) -> None:
        call = self._stub.Decide(metadata=self._metadata)
        loop = asyncio.get_running_loop()
        reader = asyncio.create_task(self._read(call))
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the Decide stream ended")
        clean = False  # the server ended the stream with OK
        try:
            while not reader.done():
                if not self._queue and not self._cancels:
                    self._wake.clear()
                    woken = asyncio.create_task(self._wake.wait())
                    try:
                        await asyncio.wait({woken, reader}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        woken.cancel()
                    continue
                msg = self._next_message()
                if msg.requests or msg.HasField("wait") or msg.cancel:
                    sent_at = loop.time()
                    await call.write(msg)
                    self.messages += 1
                    if (rest := self._gap(loop.time()) - (loop.time() - sent_at)) > 0:
                        # What arrives meanwhile leaves in the next message.
                        await asyncio.wait({reader}, timeout=rest)
            if reader.exception() is not None:
                error = reader.exception()
            else:
                clean = True
        except grpc.aio.AioRpcError as exc:
            # A write on a call the server already ended (an UNAUTHENTICATED stream,
            # say) fails with a status of its own (INTERNAL, "execute_batch"): the
            # call's own status is the one its reader ends with.
            await asyncio.wait({reader}, timeout=1.0)
            ended = reader.exception() if reader.done() and not reader.cancelled() else None
            error = ended if isinstance(ended, grpc.aio.AioRpcError) else exc
        except Exception as exc:  # a write on a call that already ended
            await asyncio.wait({reader}, timeout=1.0)
            if reader.done() and not reader.cancelled() and reader.exception() is None:
                clean = True  # ended with OK: a drain
            else:
                log.warning("Decide stream failed: %s", exc)
                error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"the Decide stream failed: {exc}")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the Decider was closed")
            raise
        finally:
            reader.cancel()
            call.cancel()
            self._runner = None
            self._cancels.clear()  # their stream is gone, and their waits with it
            if clean:  # unanswered means unread: send it again (once) on a new stream
                unread = [e for entries in self._sent.values() for e in entries]
                self._sent.clear()
                self._queue.extendleft(reversed([e for e in unread if e.sent < 2]))
                self._fail([e for e in unread if e.sent >= 2], error)
                if self._queue:
                    self._runner = asyncio.create_task(self._run())
            else:
                self._fail_all(error)

    def _gap(self, now: float) -> float:
        """The gap before the next message: our own, or the server's advice
        while it is recent and longer."""
        if now - self._advised_at < ADVICE_S:
            return max(self.gap_s, self.advised_gap_s)
        return self.gap_s

    async def _read(self, call) -> None:
        loop = asyncio.get_running_loop()
        async for answer in call:
            self.advised_gap_s = min(answer.gap_ms / 1000, MAX_ADVISED_GAP_S)
            self._advised_at = loop.time()
            self._answer(answer)
            for more in answer.more:
                self._answer(more)

    def _answer(self, answer: pb.DecideResponse) -> None:
        """Settle what one answer (or one of a bundle) answers."""
        if answer.positions:
            self._part(answer)
            return
        entries = self._sent.pop(answer.id, None)
        if entries is None:
            return
        if answer.error_code:
            code = _CODES.get(answer.error_code, grpc.StatusCode.UNKNOWN)
            self._fail(entries, rpc_error(code, answer.error_message))
            return
        if entries[0].wait is not None:
            if not entries[0].done.done():
                if answer.HasField("event"):
                    entries[0].done.set_result(answer.event)
                else:
                    entries[0].done.set_exception(_NoWaits())
            return
        responses = list(answer.responses)
        if len(responses) != sum(len(e.requests) for e in entries):
            raise rpc_error(grpc.StatusCode.INTERNAL,
                            f"Decide answer {answer.id} has {len(responses)} responses")
        start = 0
        for entry in entries:
            if not entry.done.done():
                entry.done.set_result(responses[start:start + len(entry.requests)])
            start += len(entry.requests)

    def _part(self, answer: pb.DecideResponse) -> None:
        """An answer to some of a message's requests: each caller is answered
        once all of its own requests are."""
        entries = self._sent.get(answer.id)
        if entries is None or entries[0].wait is not None:
            return
        error = None
        if answer.error_code:
            error = rpc_error(_CODES.get(answer.error_code, grpc.StatusCode.UNKNOWN),
                              answer.error_message)
        elif len(answer.responses) != len(answer.positions):
            raise rpc_error(grpc.StatusCode.INTERNAL,
                            f"Decide answer {answer.id} has {len(answer.responses)} "
                            f"responses for {len(answer.positions)} positions")
        starts = [e.start for e in entries]
        total = entries[-1].start + len(entries[-1].requests)
        for j, pos in enumerate(answer.positions):
            if pos >= total:
                raise rpc_error(grpc.StatusCode.INTERNAL,
                                f"Decide answer {answer.id} answers position {pos} of {total}")
            entry = entries[bisect.bisect_right(starts, pos) - 1]
            if entry.left == 0:
                continue
            if error is not None:
                entry.left = 0
                if not entry.done.done():
                    entry.done.set_exception(error)
                continue
            if entry.got[pos - entry.start] is None:
                entry.got[pos - entry.start] = answer.responses[j]
                entry.left -= 1
                if entry.left == 0 and not entry.done.done():
                    entry.done.set_result(entry.got)
        if all(e.left == 0 for e in entries):
            del self._sent[answer.id]

    def _fail_all(self, error: BaseException) -> None:
        entries = [e for sent in self._sent.values() for e in sent] + list(self._queue)
        self._sent.clear()
        self._queue.clear()
        self._fail(entries, error)

    @staticmethod
    def _fail(entries: list[_Entry], error: BaseException) -> None:
        for entry in entries:
            if not entry.done.done():
                entry.done.set_exception(error)
