"""A job's news down a tree (docs/architecture/pod-start.md, "The tree"): what
the replica (coordinator/jobwatch.py) and every relaying worker
(worker/daemon/jobrelay.py) share.

A job's streams form a tree: the replica serves at most `fanout` of a job's
streams itself, and points any later one (its first message answered with
`relay_from`) at the stream of a host whose worker relays the job's news
(it said a relay_address); that worker serves `fanout` children and points
later ones further down, the same way. Three levels of 32 cover 32,768
hosts; the replica's streams, its work and its bytes for a job do not grow
with the job's hosts.

The news is numbered where it starts (the replica: an epoch for its run of
the job, a seq a message) and every node keeps the last of it (NewsLog): a
stream that breaks (its relay died) opens again, anywhere in the tree, with
the last seq it heard, and gets what followed: nothing replayed, nothing
skipped. A node that no longer holds what followed says so, and the host
asks again for what it still waits for: a relay's death costs its subtree
a reconnect, never an answer.

A node that stops without closing its connections (a VM paused, a process
stopped, a partition) says nothing more, so every stream says something
while it lives: a node with nothing to send sends an empty message after
HEARTBEAT_S (its outbox's `next`), and a host with nothing to ask sends an
empty request as often. A host that hears nothing on its stream for
SILENT_S (`heard`) takes its relay for frozen and opens its stream again at
the coordinator with the last news it heard; a node that hears nothing for
as long from a child that relays ends that child's stream, so that no
newcomer is placed under it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from compilecast import validate
from compilecast.errors import InvalidRequest, TooMany, Unavailable
from compilecast.v1 import cache_pb2 as pb

FANOUT = 32  # a node's streams of one job (then newcomers go down the tree)
LOG_MESSAGES = 4096  # the job's last news held by a node, for streams that resume
LOG_BYTES = 16 << 20  # and at most these bytes of it
QUEUED = 1024  # messages a stream has not sent yet; past it the stream is ended
MAX_WAITS = 1000  # keys a stream's message may name
MAX_HOSTS = 1 << 20  # hosts a stream may say it serves
HEARTBEAT_S = 3.0  # a stream with nothing to say this long says an empty message
SILENT_S = 10.0  # a stream that heard nothing at all this long: its peer is taken for frozen
HEARTBEAT = b""  # (an empty JobEvents: nothing, but from a node that lives)
HOLD_S = 1.0  # news unacknowledged this long: the next leaves anyway (a peer that never acks)


class Silent(Unavailable):
    """Nothing heard on a stream for SILENT_S: its peer lives no more as far
    as the stream can tell (frozen, or cut off without a close)."""


_T = TypeVar("_T")


async def heard(messages: AsyncIterator[_T], silent_s: float = SILENT_S) -> AsyncIterator[_T]:
    """`messages` as they come; Silent where none came for `silent_s`."""
    it = messages.__aiter__()
    while True:
        try:  # (asyncio.timeout, not wait_for: 3.11's wait_for may swallow a cancel)
            async with asyncio.timeout(silent_s):
                message = await it.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Silent(f"nothing heard on the stream for {silent_s:.0f}s: its peer is "
                         "taken for frozen") from None
        yield message


class NewsLog:
    """The last news of a job, numbered: (epoch, seq) -> the message's bytes."""

    def __init__(self, epoch: str = "", *, messages: int = LOG_MESSAGES,
                 max_bytes: int = LOG_BYTES) -> None:
        self.epoch = epoch
        self.seq = 0  # the last message's
        self.max_messages = messages
        self.max_bytes = max_bytes
        self._held: collections.deque[tuple[int, bytes]] = collections.deque()
        self._bytes = 0

    def restart(self, epoch: str, seq: int) -> None:
        """The news is numbered anew (another epoch) from `seq`: nothing held resumes."""
        self.epoch, self.seq = epoch, seq
        self._held.clear()
        self._bytes = 0

    def heard(self, seq: int) -> None:
        """The news up to `seq` was heard, and is not kept (a node that relays nothing)."""
        self.seq = seq

    def add(self, seq: int, data: bytes) -> None:
        self.seq = seq
        self._held.append((seq, data))
        self._bytes += len(data)
        while self._held and (len(self._held) > self.max_messages
                              or self._bytes > self.max_bytes):
            self._bytes -= len(self._held.popleft()[1])

    def after(self, epoch: str, seq: int) -> list[tuple[int, bytes]] | None:
        """The messages that followed (epoch, seq), in order (each with its
        seq); None where this
        log cannot say: another epoch, what followed no longer held, or a seq
        inside a message held (news joined on its way here: what follows
        that seq alone is not a message of its own)."""
        if not epoch or epoch != self.epoch or not 0 <= seq <= self.seq:
            return None
        if seq == self.seq:
            return []
        held = list(self._held)
        for i, (s, _) in enumerate(held):
            if s == seq:
                return held[i + 1:]
        return None


@dataclass(eq=False)
class Branch:
    """A stream a node serves, as placement sees it."""

    address: str  # where its worker relays the job's news ("": it does not)
    placed: int = 0  # newcomers pointed at it


def place(branches: Iterable[Branch], fanout: int) -> Branch | None:
    """Where a newcomer goes: None while the node serves fewer than `fanout`
    streams (or none of them relays: it serves the newcomer itself), else
    the relaying branch that was given the fewest."""
    branches = list(branches)
    if fanout <= 0 or len(branches) < fanout:
        return None
    relays = [b for b in branches if b.address]
    if not relays:
        return None
    best = min(relays, key=lambda b: b.placed)
    best.placed += 1
    return best


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...


class Outbox:
    """A stream's messages not sent yet: the job's news (serialized once for
    every stream) and messages to this stream alone (a turn, an answer).

    News leaves when its stream needs it, as TCP sends (Nagle): at once
    while the stream has no news in flight (all it was sent, its peer
    acknowledged: `acked`, its subtree's too), else when the acknowledgement
    comes, joined with all that waited meanwhile: a protobuf's serialized
    messages, concatenated, parse as their merge (each list the lists in
    order, the seq the last one's). So a job's news costs one message a
    round trip of its tree (and, news that came while some was in flight,
    no sooner than `gap_s` after the last: the replica's bound on a burst),
    however fast it comes, and a program in a job that runs in lockstep is
    heard at once. A peer that never acknowledges (an older worker) gets
    news at most `hold_s` apart. A stream whose host relays nothing is never
    held (`gated` False): it has no subtree to pace, and acknowledges nothing. A message to the
    stream alone is never joined to news (a relay passes news on whole, and
    what is this stream's alone must not go further), and nothing overtakes
    what was queued before it. Past `bound` messages the stream is ended
    (`behind`): its host reads too slowly."""

    def __init__(self, bound: int = QUEUED, *, hold_s: float = HOLD_S,
                 gated: bool = True) -> None:
        self.bound = bound
        self.hold_s = hold_s
        self.gated = gated  # (a stream whose host relays nothing is never held: it acks nothing)
        self.gap_s = 0.0  # while news is in flight, the next leaves no sooner than this after it
        self.open = True
        self.behind = False
        self.sent_bytes = 0
        self.sent_seq = 0  # the last news written
        self.acked = 0  # the last news its peer (and its subtree) acknowledged
        self._sent_at = float("-inf")
        self._busy = False  # news came while some was in flight
        self._items: collections.deque[tuple[int, bytes] | Message] = collections.deque()
        self._ready = asyncio.Event()

    def send(self, message: bytes | Message, seq: int = 0) -> None:
        """Queue `message`: news (bytes, numbered `seq`), or a message to
        this stream alone."""
        if not self.open:
            return
        if len(self._items) >= self.bound:
            self.behind = True
            self.end()
            return
        if isinstance(message, bytes):
            self._busy = self._busy or self.acked < self.sent_seq
            self._items.append((seq, message))
        else:
            self._items.append(message)
        self._ready.set()

    def opened_at(self, seq: int) -> None:
        """The stream opens with the news up to `seq` heard (nothing in flight)."""
        self.sent_seq = self.acked = seq

    def acked_to(self, seq: int) -> None:
        """Its peer (and its subtree) heard the news up to `seq`."""
        if seq > self.acked:
            self.acked = seq
            self._ready.set()

    def end(self) -> None:
        self.open = False
        self._ready.set()

    def _held_s(self) -> float:
        """How long the news at its head waits yet (0: it leaves now): until
        what is in flight is acknowledged and `gap_s` has passed since it
        left, or `hold_s` has."""
        if not self.gated or not self.open or not self._items \
                or not isinstance(self._items[0], tuple):
            return 0.0
        now = asyncio.get_running_loop().time()
        if self.acked >= self.sent_seq:  # (news that came while some was in flight: the gap)
            return max(0.0, self._sent_at + self.gap_s - now) if self._busy else 0.0
        return max(0.0, self._sent_at + self.hold_s - now)

    async def _ready_within(self, seconds: float) -> bool:
        self._ready.clear()
        try:
            async with asyncio.timeout(seconds):
                await self._ready.wait()
        except TimeoutError:
            return False
        return True

    async def next(self, heartbeat_s: float | None = None) -> bytes | None:
        """What to write next (news waiting joined), or None: the stream ends
        (what was queued before its end is written first); HEARTBEAT where
        nothing came for `heartbeat_s`."""
        while True:
            if not self._items:
                if not self.open:
                    return None
                if heartbeat_s is None:
                    self._ready.clear()
                    await self._ready.wait()
                elif not await self._ready_within(heartbeat_s):
                    return HEARTBEAT
                continue
            held = self._held_s()
            if held <= 0:
                break
            await self._ready_within(held)  # (an acknowledgement, more to send, the end)
        first = self._items.popleft()
        if not isinstance(first, tuple):
            data = first.SerializeToString()
        else:
            seq, data = first
            run = [data]
            while self._items and isinstance(more := self._items[0], tuple):
                self._items.popleft()
                seq = max(seq, more[0])
                run.append(more[1])
            data = b"".join(run)
            if seq:
                self.sent_seq, self._sent_at = seq, asyncio.get_running_loop().time()
                self._busy = False
        self.sent_bytes += len(data)
        return data


def opened(log: NewsLog, first: pb.JobWatchRequest, outbox: Outbox) -> pb.JobEvents:
    """A stream's first message (the news follows from its seq), the news
    it missed queued behind it where it asked to resume and `log` holds
    what followed (`resumed`)."""
    news = log.after(first.since_epoch, first.since_seq) if first.since_epoch else None
    seq = first.since_seq if news is not None else log.seq
    outbox.opened_at(seq)
    for s, message in news or ():
        outbox.send(message, s)
    return pb.JobEvents(epoch=log.epoch, resumed=news is not None, seq=seq)


def acked(message: pb.JobWatchRequest, outbox: Outbox) -> None:
    """A later request's since_seq: its host (and its subtree) heard the
    news up to it (the first request's says where it resumes)."""
    if message.since_seq:
        outbox.acked_to(message.since_seq)


async def sent(outbox: Outbox, reader: asyncio.Future, slow: str) -> AsyncIterator[bytes]:
    """A stream's messages to its end (a HEARTBEAT after HEARTBEAT_S of
    nothing); then what ended its `reader` (its requests), or TooMany where
    its reader fell `outbox.bound` behind (`slow`: what its host is to do)."""
    while (data := await outbox.next(HEARTBEAT_S)) is not None:
        yield data
    if reader.done() and not reader.cancelled() and (exc := reader.exception()) is not None:
        raise exc
    if outbox.behind:
        raise TooMany(f"the stream was read too slowly ({outbox.bound} messages unsent); {slow}")


def requests_of(first: pb.JobWatchRequest, it: AsyncIterator[pb.JobWatchRequest]
                ) -> AsyncIterator[pb.JobWatchRequest]:
    """A child's requests after its first, as a node reads them: a child that
    relays (others hang from it) and says nothing for SILENT_S is Silent."""
    return heard(it) if first.relay_address else it


def stop(reader: asyncio.Future) -> None:
    """A stream's reader of its requests, stopped as the stream ends; what
    ended it is read here (raised to the stream's caller already, by `sent`,
    or moot: the call ended under it)."""
    reader.cancel()
    reader.add_done_callback(lambda r: r.cancelled() or r.exception())


def checked(message: pb.JobWatchRequest, job: str) -> int:
    """A stream's request, checked as the replica and every relay check it
    (InvalidRequest); the hosts it says it serves, bounded (0: it says none)."""
    if message.job and message.job != job:
        raise InvalidRequest("a stream watches one job")
    if len(message.waits) > MAX_WAITS:
        raise InvalidRequest(f"at most {MAX_WAITS} keys a message")
    for w in message.waits:
        validate.key(w.key)
        validate.requester(w.requester)
    if message.HasField("requester"):
        validate.requester(message.requester)
        if message.requester.job != job:
            raise InvalidRequest("the stream's requester runs another job")
    return min(max(1, message.hosts), MAX_HOSTS) if message.hosts else 0

