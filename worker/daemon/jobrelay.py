"""A worker's subtree of a job's news (compilecast/jobtree.py): the peer
workers whose job streams it serves, as the replica serves its own.

A worker that relays (relay_listen) says so on its job's stream; the
replica, or a relay above it, may then point other hosts' streams here
(RelayService.WatchJob). Each is served what this worker's own stream hears:

- the job's news (a numbered message to every stream), as it came (joined
  with the next where a child has not acknowledged the last: jobtree.Outbox),
  and kept in the job's NewsLog so that a stream that opens again resumes
  after what it heard; what every child's subtree acknowledged goes up with
  this worker's own (the tree's acknowledgement, the news's pace);
- a key a child names: answered at once where this host knows it published,
  else named upstream once for the whole subtree; what comes back for it
  (its publish, or "ask") goes to the children that named it;
- a turn to compile, given to this worker's stream in its subtree's name:
  passed to the child whose subtree ranks first (the lowest process id, of
  those that named the key where any did).

A child presents the credential this worker's stream of the job goes up
with, so it may do what this worker may. Bounds: `fanout` children (later
ones are pointed at a child that relays: down the tree), QUEUED unsent
messages a child (past it, it is ended and opens again elsewhere),
MAX_WAITS keys a message, MAX_NAMED keys named for children.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from compilecast import jobtree, validate
from compilecast.errors import NotFound, TooMany
from compilecast.jobtree import Branch, NewsLog, Outbox
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)

MAX_NAMED = 100_000  # keys children named that are still waited for


@dataclass(eq=False)
class _Child:
    branch: Branch
    outbox: Outbox = field(default_factory=Outbox)
    first: pb.Requester | None = None  # the first-ranked process of its subtree
    hosts: int = 1  # of its subtree

    @property
    def open(self) -> bool:
        return self.outbox.open

    def send(self, message: bytes | pb.JobEvents, seq: int = 0) -> None:
        self.outbox.send(message, seq)

    def end(self) -> None:
        self.outbox.end()


class Upward(Protocol):
    """What a subtree asks of the stream it hangs from (worker/daemon/jobstream.py)."""

    log: NewsLog  # the job's news as heard
    known: Callable[[str], pb.ArtifactInfo | None]  # a key published, as this host knows

    def name(self, requests: list[pb.WaitRequest]) -> None: ...

    def changed(self) -> None: ...  # the subtree's first-ranked process or hosts may have


class Subtree:
    def __init__(self, job: str, up: Upward, *, fanout: int = jobtree.FANOUT) -> None:
        self.job = job
        self.up = up
        self.fanout = fanout
        self.children: set[_Child] = set()
        self._named: dict[str, set[_Child]] = {}  # key -> children waiting for it
        self.redirected = 0  # children pointed further down

    def hosts(self) -> int:
        """The hosts below this one (its open children's subtrees)."""
        return sum(c.hosts for c in self.children if c.open)

    def first(self) -> pb.Requester | None:
        """The subtree's first-ranked process (of the open children)."""
        said = [c.first for c in self.children if c.open and c.first is not None]
        return min(said, key=lambda r: r.process_id) if said else None

    async def serve(self, first: pb.JobWatchRequest,
                    requests: AsyncIterator[pb.JobWatchRequest]
                    ) -> AsyncIterator[bytes | pb.JobEvents]:
        """A child's stream (its first message read): its events, to its end."""
        if first.relay_address:
            validate.relay_address(first.relay_address)
        if not first.direct:
            below = jobtree.place([c.branch for c in self.children if c.open], self.fanout)
            if below is not None:
                self.redirected += 1
                yield pb.JobEvents(relay_from=below.address)
                return
        if len(self.children) >= self.fanout * 2:  # (direct ones past the fanout: a bound)
            raise TooMany(f"this worker relays job {self.job!r} to {len(self.children)} "
                          "peers; open the stream at the coordinator")
        me = _Child(Branch(first.relay_address), Outbox(gated=bool(first.relay_address)))
        self.children.add(me)
        opening = jobtree.opened(self.up.log, first, me.outbox)
        reader = asyncio.ensure_future(self._read(me, first,
                                                  jobtree.requests_of(first, requests).__aiter__()))
        try:
            yield opening
            async for data in jobtree.sent(me.outbox, reader, "open the stream again"):
                yield data
        finally:
            me.end()
            jobtree.stop(reader)
            self.children.discard(me)
            for waiting in self._named.values():
                waiting.discard(me)
            self.up.changed()

    async def _read(self, me: _Child, first: pb.JobWatchRequest,
                    it: AsyncIterator[pb.JobWatchRequest]) -> None:
        try:
            message = first
            while True:
                if hosts := jobtree.checked(message, self.job):
                    me.hosts = hosts
                    self.up.changed()
                if message is not first and message.since_seq:
                    before = self.acked()
                    jobtree.acked(message, me.outbox)
                    if self.acked() != before:  # (the subtree's acknowledgement goes up)
                        self.up.changed()
                if message.HasField("requester"):
                    me.first = message.requester
                    self.up.changed()
                self._want(me, message.waits)
                try:
                    message = await it.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            me.end()

    def _want(self, me: _Child, waits) -> None:
        upward = []
        for w in waits:
            info = self.up.known(w.key)
            if info is not None:
                me.send(pb.JobEvents(published=[info]))
                continue
            named = self._named.get(w.key)
            if named is None:
                if len(self._named) >= MAX_NAMED:
                    me.send(pb.JobEvents(ask=[w.key]))
                    continue
                named = self._named[w.key] = set()
                upward.append(w)
            named.add(me)
        if upward:
            self.up.name(upward)

    def named(self) -> list[str]:
        """Keys children named that are still waited for (named upstream again
        when the news starts anew)."""
        return list(self._named)

    # -- what comes down ------------------------------------------------------------
    def news(self, data: bytes, seq: int) -> None:
        """A numbered message of the job's news: to every child, as it came
        (or joined with the next, where a child has not acknowledged the last)."""
        for c in list(self.children):
            c.send(data, seq)

    def acked(self) -> int | None:
        """The news every open relaying child's subtree heard (None: none;
        a child that relays nothing is never held, and acknowledges nothing)."""
        said = [c.outbox.acked for c in self.children if c.open and c.outbox.gated]
        return min(said) if said else None

    def answered(self, events: pb.JobEvents) -> None:
        """The job's news, or a message to this stream alone: the children that
        named a key it answers hear of it (a numbered message reached them
        whole already, through news())."""
        single = not events.seq
        for info in events.published:
            for c in self._named.pop(info.key, ()):
                if single:
                    c.send(pb.JobEvents(published=[info]))
        for key in events.ask:
            for c in self._named.pop(key, ()):
                if single:
                    c.send(pb.JobEvents(ask=[key]))

    def turn(self, turn: pb.KeyTurn) -> bool:
        """Give a turn to compile to the child that ranks first (of those that
        named its key, where any did); False: no child to give it."""
        named = [(c.first.process_id, c) for c in self._named.get(turn.key, ())
                 if c.open and c.first is not None]
        ranked = named or [(c.first.process_id, c) for c in self.children
                           if c.open and c.first is not None]
        if not ranked:
            return False
        min(ranked, key=lambda rc: rc[0])[1].send(pb.JobEvents(turns=[turn]))
        return True

    def end_all(self) -> None:
        """The news starts anew, or stops here: every child opens its stream
        again (and asks again for what it waits for)."""
        for c in list(self.children):
            c.end()
        self._named.clear()


async def watch(requests: AsyncIterator[pb.JobWatchRequest],
                subtree_of: Callable[[str], Subtree | None]
                ) -> AsyncIterator[bytes | pb.JobEvents]:
    """A peer's WatchJob at a relaying worker: served by the subtree of the
    job its first message names (`subtree_of`; None: this worker relays no
    news of it, NOT_FOUND, and the peer opens its stream at the coordinator)."""
    it = requests.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return
    validate.job(first.job)
    subtree = subtree_of(first.job)
    if subtree is None:
        raise NotFound(f"this worker relays no news of job {first.job!r} for this "
                       "credential; open the stream at the coordinator")
    async for events in subtree.serve(first, it):
        yield events

