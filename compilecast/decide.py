"""Decisions over one long-lived stream (the Decide RPC): the client's end
(`Decider`) and what both ends share; the server's end (`serve`, `Streams`,
`GapAdvice`) is compilecast/decideserve.py.

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
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from compilecast import tracing, validate
from compilecast.errors import InvalidRequest, Status, UpstreamError
from compilecast.grpcutil import status
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # requests per message, as for AcquireMany
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



def check_batch(requests: Sequence[pb.AcquireRequest]) -> None:
    """Refuse a batch (AcquireMany, or one Decide message) before any of it is
    decided: a bad request fails its batch and nothing else."""
    if len(requests) > MAX_BATCH:
        raise InvalidRequest(f"at most {MAX_BATCH} requests per batch")
    for r in requests:
        validate.acquire_request(r)


def ends_wait(event: pb.WaitEvent, until_publishing: bool) -> bool:
    """Whether `event` ends a wait for its caller: any decision but WAIT (a
    heartbeat), and with until_publishing also the WAIT that says the holder
    has started to publish (it carries the artifact)."""
    return event.decision != pb.WAIT or (until_publishing and event.HasField("artifact"))


async def ending_event(events: AsyncIterator[pb.WaitEvent],
                       until_publishing: bool) -> pb.WaitEvent:
    """The event of a Wait stream that ends it (`ends_wait`). The stream is
    closed at once, so that its waiter record goes with it."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]  # (an async generator)
        async for event in events:
            if ends_wait(event, until_publishing):
                return event
    return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason="the wait ended without a decision")


def failed(code: Status, details: str) -> UpstreamError:
    """How a Decider's caller learns that a decision or a wait failed: the
    status the coordinator (or the stream to it) ended it with. The stream's
    gRPC errors become these here, at its one edge."""
    return UpstreamError(code, details)


def _of_call(exc: BaseException) -> BaseException:
    """A failure of the stream's call, as a caller gets it."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return failed(status(exc.code()), exc.details() or "")
    return exc


class _Entry:
    """One caller's decisions (or one wait) on their way through a Decider."""

    __slots__ = ("done", "got", "left", "msg_id", "requests", "sent", "start",
                 "until_publishing", "wait")

    def __init__(self, done: asyncio.Future[Any], requests: Sequence[pb.AcquireRequest] = (),
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
    again, once, on a new stream. A wait the stream has no room for (its
    server's per-stream limit) goes to Wait.
    """

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...] = (), *,
                 timeout_s: float = 5.0,
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
        self._runner: asyncio.Task[None] | None = None
        self.messages = 0  # messages written (fewer than decide calls under load)
        self.advised_gap_s = 0.0  # the server's advice (DecideResponse.gap_ms), capped
        self._advised_at = 0.0  # loop time of the answer that carried it

    async def _ask(self, entry: _Entry, limit_s: float | None) -> Any:
        """Queue `entry`, wake the writer and wait for its answer."""
        self._queue.append(entry)
        self._wake.set()
        if self._runner is None:
            self._runner = asyncio.create_task(self._run(), context=tracing.untraced())
        try:
            return await asyncio.wait_for(entry.done, limit_s)
        except TimeoutError:
            raise failed(Status.DEADLINE_EXCEEDED,
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
        """One response per request, in order. Raises UpstreamError with
        the status AcquireMany would end with, and InvalidRequest for a bad request (checked
        here, so that it never shares a message with anyone else's)."""
        check_batch(requests)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        entry = _Entry(asyncio.get_running_loop().create_future(), requests)
        responses: list[pb.AcquireResponse] = await self._ask(entry, timeout)
        return responses

    async def wait(self, request: pb.WaitRequest, *,
                   until_publishing: bool = False) -> pb.WaitEvent:
        """The event that ends a wait for `request.key`: HIT, COMPILE
        (promoted) or COMPILE_LOCALLY, or with `until_publishing` also the
        WAIT that says the holder has started to publish. Raises
        UpstreamError with the status Wait would end with; a caller that is cancelled or
        times out ends the wait on the server too."""
        timeout = (request.timeout_ms / 1000.0 + self.timeout_s
                   if request.timeout_ms > 0 else None)
        entry = _Entry(asyncio.get_running_loop().create_future(), wait=request,
                       until_publishing=until_publishing)
        try:
            event: pb.WaitEvent = await self._ask(entry, timeout)
            return event
        except UpstreamError as exc:
            if exc.status != Status.RESOURCE_EXHAUSTED:  # else the stream is full
                raise
        call = self._stub.Wait(request, timeout=timeout, metadata=self._metadata)
        try:
            async for streamed in call:
                if ends_wait(streamed, until_publishing):
                    got: pb.WaitEvent = streamed
                    return got
        except grpc.RpcError as exc:
            raise _of_call(exc) from None
        finally:
            call.cancel()
        raise failed(Status.UNAVAILABLE, "the Wait stream ended without a decision")

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
        error: BaseException = failed(Status.UNAVAILABLE, "the Decide stream ended")
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
            if (broke := reader.exception()) is not None:
                error = _of_call(broke)
            else:
                clean = True
        except grpc.aio.AioRpcError as exc:
            # A write on a call the server already ended (an UNAUTHENTICATED stream,
            # say) fails with a status of its own (INTERNAL, "execute_batch"): the
            # call's own status is the one its reader ends with.
            await asyncio.wait({reader}, timeout=1.0)
            ended = reader.exception() if reader.done() and not reader.cancelled() else None
            error = _of_call(ended if isinstance(ended, grpc.aio.AioRpcError) else exc)
        except Exception as exc:  # a write on a call that already ended
            await asyncio.wait({reader}, timeout=1.0)
            if reader.done() and not reader.cancelled() and reader.exception() is None:
                clean = True  # ended with OK: a drain
            else:
                log.warning("Decide stream failed: %s", exc)
                error = failed(Status.UNAVAILABLE,
                                  f"the Decide stream failed: {exc}")
        except asyncio.CancelledError:
            error = failed(Status.CANCELLED, "the Decider was closed")
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
                    self._runner = asyncio.create_task(self._run(),
                                                       context=tracing.untraced())
            else:
                self._fail_all(error)

    def _gap(self, now: float) -> float:
        """The gap before the next message: our own, or the server's advice
        while it is recent and longer."""
        if now - self._advised_at < ADVICE_S:
            return max(self.gap_s, self.advised_gap_s)
        return self.gap_s

    async def _read(self, call: Any) -> None:
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
            self._fail(entries, failed(Status.of_number(answer.error_code),
                                       answer.error_message))
            return
        if entries[0].wait is not None:
            if not entries[0].done.done():
                if answer.HasField("event"):
                    entries[0].done.set_result(answer.event)
                else:
                    entries[0].done.set_exception(failed(Status.INTERNAL, f"Decide answer {answer.id} to a wait has "
                                                  "no event"))
            return
        responses = list(answer.responses)
        if len(responses) != sum(len(e.requests) for e in entries):
            raise failed(Status.INTERNAL,
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
            error = failed(Status.of_number(answer.error_code), answer.error_message)
        elif len(answer.responses) != len(answer.positions):
            raise failed(Status.INTERNAL,
                            f"Decide answer {answer.id} has {len(answer.responses)} "
                            f"responses for {len(answer.positions)} positions")
        starts = [e.start for e in entries]
        total = entries[-1].start + len(entries[-1].requests)
        for j, pos in enumerate(answer.positions):
            if pos >= total:
                raise failed(Status.INTERNAL,
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
