"""Decisions over one long-lived stream (the Decide RPC), both ends.

A unary Acquire costs gRPC Python about half a millisecond of CPU on each
side for the call alone (BENCHMARKS.md, "Decisions per second"); a message on
an open stream costs about half of that, and one message can carry many
decisions. A worker daemon therefore keeps one
Decide stream per credential to the coordinator and sends every decision its
processes ask for over it:

- `Decider` (the client) coalesces: while one message is being written, the
  requests that arrive queue up and leave together in the next one (at most
  MAX_BATCH requests), so under load one message carries many decisions, and
  at rest each request leaves at once.
- `serve` (the server) decides each message as it arrives, concurrently (a
  slow miss that waits on etcd never holds up the hits behind it), and answers
  it when it is decided; ids match answers to messages.

A message that is refused (a bad key from a client that does not validate)
gets its status in its answer; the stream and the other messages carry on.
A stopping server drains its streams (`Streams.drain`): each answers what it
has read and ends with OK, and the client sends the rest again elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from compilecast import validate
from compilecast.errors import CompilecastError, InvalidRequest
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # requests per message, as for AcquireMany
IN_FLIGHT = 64  # messages of one stream decided at once; reading pauses beyond

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def check_batch(requests: Sequence[pb.AcquireRequest]) -> None:
    """Refuse a batch (AcquireMany, or one Decide message) before any of it is
    decided: a bad request fails its batch and nothing else."""
    if len(requests) > MAX_BATCH:
        raise InvalidRequest(f"at most {MAX_BATCH} requests per batch")
    for r in requests:
        validate.acquire_request(r)


Decide = Callable[[Sequence[pb.AcquireRequest]], Awaitable[list[pb.AcquireResponse]]]


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


async def serve(messages: AsyncIterator[pb.DecideRequest], decide: Decide, *,
                in_flight: int = IN_FLIGHT, streams: Streams | None = None
                ) -> AsyncIterator[pb.DecideResponse]:
    """Answer the messages of a Decide stream with `decide` (a checked batch
    in, one response per request out), each as soon as it is decided. With
    `streams`, a drain ends the stream after answering every message read."""
    answers: asyncio.Queue[pb.DecideResponse | None] = asyncio.Queue()
    slots = asyncio.Semaphore(in_flight)
    running: set[asyncio.Task] = set()

    async def one(msg: pb.DecideRequest) -> None:
        try:
            check_batch(msg.requests)
            answer = pb.DecideResponse(id=msg.id, responses=await decide(msg.requests))
        except CompilecastError as exc:
            answer = pb.DecideResponse(id=msg.id, error_code=exc.code.value[0],
                                       error_message=str(exc))
        except Exception:
            log.exception("Decide message %d failed", msg.id)
            answer = pb.DecideResponse(id=msg.id, error_code=grpc.StatusCode.INTERNAL.value[0],
                                       error_message="Decide: internal error")
        finally:
            slots.release()
        answers.put_nowait(answer)

    async def read() -> None:
        try:
            try:
                async for msg in messages:
                    await slots.acquire()
                    task = asyncio.create_task(one(msg))
                    running.add(task)
                    task.add_done_callback(running.discard)
            except asyncio.CancelledError:
                if streams is None or not streams.draining:
                    raise
            while running:  # the client finished writing, or a drain: answer what was read
                await asyncio.wait(set(running))
        finally:
            answers.put_nowait(None)

    reader = asyncio.create_task(read())
    if streams is not None:
        streams._readers.add(reader)
        reader.add_done_callback(streams._readers.discard)
        if streams.draining:
            reader.cancel()
    try:
        while (answer := await answers.get()) is not None:
            yield answer
        await reader  # raises what ended the reading (an undecodable message)
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error as a unary call would have raised it, for callers of Decider."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Decider:
    """The client end: `await decide(requests)` from any number of tasks of
    one event loop; all of it travels over one Decide stream of `stub`.

    The stream opens on first use and again after it fails; a failure fails
    the decisions in flight with the stream's status (each caller then does
    what it does when a unary call fails: the worker compiles locally). A
    stream the server ends with OK (a draining replica) has answered every
    message it read, so what it left unanswered is sent again, once, on a new
    stream. Against a server without Decide, it falls back to AcquireMany,
    one call per `decide`.
    """

    def __init__(self, stub, metadata: tuple = (), *, timeout_s: float = 5.0) -> None:
        self._stub = stub
        self._metadata = metadata
        self.timeout_s = timeout_s
        # Entries: [requests, future, times sent]; queued, then sent by message id.
        self._queue: collections.deque[list] = collections.deque()
        self._wake = asyncio.Event()
        self._sent: dict[int, list[list]] = {}
        self._ids = itertools.count(1)
        self._runner: asyncio.Task | None = None
        self._unary = False  # the server has no Decide
        self.messages = 0  # messages written (fewer than decide calls under load)

    async def decide(self, requests: Sequence[pb.AcquireRequest],
                     timeout_s: float | None = None) -> list[pb.AcquireResponse]:
        """One response per request, in order. Raises grpc.aio.AioRpcError
        as AcquireMany would, and InvalidRequest for a bad request (checked
        here, so that it never shares a message with anyone else's)."""
        check_batch(requests)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self._unary:
            done = asyncio.get_running_loop().create_future()
            self._queue.append([requests, done, 0])
            self._wake.set()
            if self._runner is None:
                self._runner = asyncio.create_task(self._run())
            try:
                return await asyncio.wait_for(done, timeout)
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no decision within {timeout:.1f} s") from None
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the server has no Decide stream; using AcquireMany")
                self._unary = True
        resp = await self._stub.AcquireMany(pb.AcquireManyRequest(requests=requests),
                                            timeout=timeout, metadata=self._metadata)
        return list(resp.responses)

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    def _next_message(self) -> pb.DecideRequest:
        """Everything queued, up to MAX_BATCH requests, as one message."""
        msg = pb.DecideRequest(id=next(self._ids))
        entries = []
        while self._queue and (not entries or
                               len(msg.requests) + len(self._queue[0][0]) <= MAX_BATCH):
            entry = self._queue.popleft()
            if entry[1].done():  # its caller gave up before it was sent
                continue
            entry[2] += 1
            msg.requests.extend(entry[0])
            entries.append(entry)
        self._sent[msg.id] = entries
        return msg

    async def _run(self) -> None:
        call = self._stub.Decide(metadata=self._metadata)
        reader = asyncio.create_task(self._read(call))
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the Decide stream ended")
        clean = False  # the server ended the stream with OK
        try:
            while not reader.done():
                if not self._queue:
                    self._wake.clear()
                    woken = asyncio.create_task(self._wake.wait())
                    try:
                        await asyncio.wait({woken, reader}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        woken.cancel()
                    continue
                msg = self._next_message()
                if msg.requests:
                    await call.write(msg)
                    self.messages += 1
            if reader.exception() is not None:
                error = reader.exception()
            else:
                clean = True
        except grpc.aio.AioRpcError as exc:
            error = exc
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
            if clean:  # unanswered means unread: send it again (once) on a new stream
                unread = [e for entries in self._sent.values() for e in entries]
                self._sent.clear()
                self._queue.extendleft(reversed([e for e in unread if e[2] < 2]))
                self._fail([e for e in unread if e[2] >= 2], error)
                if self._queue:
                    self._runner = asyncio.create_task(self._run())
            else:
                self._fail_all(error)

    async def _read(self, call) -> None:
        async for answer in call:
            entries = self._sent.pop(answer.id, None)
            if entries is None:
                continue
            if answer.error_code:
                code = _CODES.get(answer.error_code, grpc.StatusCode.UNKNOWN)
                self._fail(entries, rpc_error(code, answer.error_message))
                continue
            responses = list(answer.responses)
            if len(responses) != sum(len(e[0]) for e in entries):
                raise rpc_error(grpc.StatusCode.INTERNAL,
                                f"Decide answer {answer.id} has {len(responses)} responses")
            start = 0
            for requests, done, _ in entries:
                if not done.done():
                    done.set_result(responses[start:start + len(requests)])
                start += len(requests)

    def _fail_all(self, error: BaseException) -> None:
        entries = [e for sent in self._sent.values() for e in sent] + list(self._queue)
        self._sent.clear()
        self._queue.clear()
        self._fail(entries, error)

    @staticmethod
    def _fail(entries: list[list], error: BaseException) -> None:
        for _, done, _ in entries:
            if not done.done():
                done.set_exception(error)
