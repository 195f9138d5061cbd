"""A host's one stream for its job's waits (coordinator/jobwatch.py): the
host's processes' waits end on what it hears there (a publish, the host's
turn to compile, or "ask for it one by one"), instead of a wait upstream per
key and host.

The stream says which of the job's processes this host serves ranks first.
A key the coordinator says is claimed (the designated process compiles it)
is named nowhere: its publish comes to every host. A key waited for here
that nobody has claimed after NAME_AFTER_S is named upstream, once.

It serves waits of a job's processes that are not the program's designated
process (that one asks for its lease, as always). A wait the stream cannot
serve (not open yet, broken, or the coordinator said "ask" of its key, then
or before) is answered None, and its caller waits upstream as without a stream: a stream is a way
to learn sooner and cheaper, never a reason to hang or to compile.

The stream may be served by the coordinator or by a peer worker that relays
the job's news (compilecast/jobtree.py): the coordinator's first answer
may point it there (`relay_from`), and a relay that fails it sends it back to
the coordinator, to be served there (`direct`). A stream that breaks after it
was open is opened again at once with the last news it heard (its waits are
kept meanwhile): where the news is still held, it resumes after it; where
not, the host names again what it waits for. Only when that reconnect
fails do its waits go upstream, and it is opened again after a pause
(retry.JOB_STREAM). A stream that hears nothing, not even a heartbeat, for
jobtree.SILENT_S is taken for broken the same way; where a relay served it,
the coordinator serves it next (a frozen relay is never waited out). A worker that relays (relay_address) serves its own
subtree of the job's streams (worker/daemon/jobrelay.py): it names its
children's keys upstream once, and says its subtree's first-ranked process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from compilecast import jobtree, retry
from compilecast.errors import CompilecastError
from compilecast.jobtree import NewsLog
from compilecast.v1 import cache_pb2 as pb

from .jobrelay import Subtree
from .upstream import CoordinatorLink

log = logging.getLogger(__name__)

MAX_WAITS = jobtree.MAX_WAITS  # keys a message names (the bound of every node)
# A key nobody has claimed is named upstream after this long: well above the
# longest a stream's news waits for an acknowledgement (jobtree.HOLD_S, 1 s),
# so that a claim reaches every host before any names the key.
NAME_AFTER_S = 3.0
MAX_CLAIMED = 100_000  # claimed keys remembered, and asked ones (past it, the oldest go)
MAX_HOPS = 8  # relays a stream is pointed through before the coordinator serves it
HELD_S = 1.0  # a stream open this long is opened again at once when it breaks


class JobStream:
    """`published`: the job's artifacts as they are published (the host's
    manifest learns them); `known`: a key's artifact where this host knows
    it published (a child's wait answered at once); `relay_address`: where
    this worker serves its subtree of the job's streams ("": it relays
    nothing)."""

    def __init__(self, link: CoordinatorLink, md: tuple, job: str,
                 published: Callable[[list[pb.ArtifactInfo]], None], *,
                 known: Callable[[str], pb.ArtifactInfo | None] = lambda key: None,
                 relay_address: str = "", fanout: int = jobtree.FANOUT) -> None:
        self.link = link
        self.md = md
        self.job = job
        self.published = published
        self.known = known
        self.relay_address = relay_address
        self.log = NewsLog()  # the job's news as heard (what a reconnect resumes after)
        self.subtree = Subtree(job, self, fanout=fanout) if relay_address else None
        self.live = False  # open: the coordinator (or a relay) said so
        self.upstream = ""  # the relay that serves it ("": the coordinator)
        self.opened = 0  # times it opened (status, tests)
        self.resumed = 0  # of them, resuming the news after what it had heard
        self.restarted = 0  # reopened where the news could not resume: waits named again
        self._resuming = False  # broken, opened again at once: its waits are kept
        self._named: dict[str, pb.WaitRequest] = {}  # named upstream, not answered yet
        self._said_first: pb.Requester | None = None  # the rank said on this stream
        self._open = asyncio.Event()  # it opened once
        self._waiting: dict[str, asyncio.Future[pb.WaitEvent | None]] = {}
        self._claimed: dict[str, None] = {}  # (in the order heard)
        self._asked: dict[str, None] = {}  # keys to ask for one by one, as the stream said
        self._first: pb.Requester | None = None  # the first-ranked process here, once said
        self._outbox: list[pb.WaitRequest] = []
        self._more = asyncio.Event()
        self._releases: set[asyncio.Future[None]] = set()
        self._direct = False  # its relay fell silent: opened again at the coordinator
        self._task = asyncio.ensure_future(self._run())

    async def placed(self, within_s: float) -> str:
        """The relay it hangs from ("": the coordinator), once it opened;
        "" too when it has not opened within `within_s`."""
        try:
            await asyncio.wait_for(self._open.wait(), within_s)
        except TimeoutError:
            return ""
        return self.upstream

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def wait(self, request: pb.WaitRequest,
                   until_publishing: bool = False) -> pb.WaitEvent | None:
        """The event that ends this host's wait for `request.key` (a HIT,
        COMPILE: its turn, and with `until_publishing` the start of its
        upload: WAIT with the artifact), or None: wait upstream, as without a
        stream."""
        while True:
            event = await self._next(request)
            if event is None or event.decision != pb.WAIT or until_publishing:
                return event

    async def _next(self, request: pb.WaitRequest) -> pb.WaitEvent | None:
        if not (self.live or self._resuming) or request.key in self._asked:
            return None
        r = request.requester
        if self._first is None or r.process_id < self._first.process_id:
            self._first = pb.Requester()
            self._first.CopyFrom(r)
            self._more.set()
        done = self._waiting.get(request.key)
        if done is None:
            loop = asyncio.get_running_loop()
            done = self._waiting[request.key] = loop.create_future()
            if request.key not in self._claimed:
                loop.call_later(NAME_AFTER_S, self._name, done,
                                pb.WaitRequest(key=request.key, requester=r))
        return await asyncio.shield(done)

    def _name(self, done: asyncio.Future, request: pb.WaitRequest) -> None:
        """Name a key still waited for that nobody has claimed."""
        if (self.live or self._resuming) and self._waiting.get(request.key) is done:
            self.name([request])

    # -- what the subtree asks (worker/daemon/jobrelay.py's Upward) ---------------------
    def name(self, requests: list[pb.WaitRequest]) -> None:
        """Name keys upstream, once each while unanswered (none claimed: its
        publish comes to every host)."""
        for r in requests:
            if r.key not in self._claimed and r.key not in self._named:
                self._named[r.key] = r
                self._outbox.append(r)
        self._more.set()

    def changed(self) -> None:
        """The subtree's first-ranked process or its hosts may have changed:
        said again."""
        self._more.set()

    def _hosts(self) -> int:
        return 1 + (self.subtree.hosts() if self.subtree is not None else 0)

    def _rank(self) -> pb.Requester | None:
        """The first-ranked process of this host and its subtree."""
        below = self.subtree.first() if self.subtree is not None else None
        if self._first is None or (below is not None and
                                   below.process_id < self._first.process_id):
            return below
        return self._first

    # -- the stream ---------------------------------------------------------------------
    async def _run(self) -> None:
        tries = 0  # since it was last open
        while True:
            opened, began = self.opened, time.monotonic()
            try:
                await self._follow()
            except CompilecastError as exc:
                log.info("job %s: its stream ended (%s: %s)", self.job, exc.status.name, exc)
            self.live = False
            if self.opened > opened and time.monotonic() - began >= HELD_S \
                    and not self._resuming:
                self._resuming = True  # opened again at once, its waits kept
                continue
            self._resuming = False
            self._end_all()  # its waits go upstream key by key meanwhile
            tries = 0 if self.opened > opened else tries + 1
            await asyncio.sleep(retry.JOB_STREAM.pause(tries))

    async def _follow(self) -> None:
        """One stream, at the coordinator or at the relay it points to, to its end."""
        target, direct, self._direct = "", self._direct, False
        for hop in range(MAX_HOPS + 1):
            stub = self.link.peer(target) if target else self.link.up
            call = stub.WatchJob(self._requests(direct or hop == MAX_HOPS), metadata=self.md)
            try:
                messages = call.__aiter__()
                try:
                    opening = await messages.__anext__()
                except CompilecastError as exc:
                    if not target:
                        raise
                    log.info("job %s: relay %s failed the stream (%s); the coordinator "
                             "serves it", self.job, target, exc.status.name)
                    target, direct = "", True
                    continue
                if opening.relay_from:  # down the tree
                    target = opening.relay_from
                    continue
                self._opened(opening, target)
                try:
                    async for events in jobtree.heard(messages):
                        self._take(events)
                except jobtree.Silent:
                    if target:  # a frozen relay: its parent serves this stream now
                        log.info("job %s: relay %s fell silent; the coordinator serves "
                                 "the stream", self.job, target)
                        self._direct = True
                    raise
                return
            except StopAsyncIteration:
                return
            finally:
                call.cancel()

    def _opened(self, opening: pb.JobEvents, target: str) -> None:
        asked = bool(self.log.epoch)
        self.live, self._resuming, self.upstream = True, False, target
        self.opened += 1
        self._open.set()
        again = list(self._named.values())  # (the stream that had them may have lost them)
        if opening.resumed:
            self.resumed += 1
        else:
            if asked:  # the news starts anew: what it waits for is named again
                self.restarted += 1
                log.info("job %s: its stream could not resume the news; its %d waits are "
                         "named again", self.job, len(self._waiting))
                self._claimed.clear()
                self._asked.clear()
                again += [pb.WaitRequest(key=k, requester=self._first or pb.Requester())
                          for k in self._waiting if k not in self._named]
                if self.subtree is not None:
                    self.subtree.end_all()  # (its children open theirs again, and do the same)
            self.log.restart(opening.epoch, opening.seq)
        self._named.clear()
        self._outbox = []
        self.name(again)

    def _acked(self) -> int:
        """The news this host and its subtree heard (what goes up as heard)."""
        below = self.subtree.acked() if self.subtree is not None else None
        return self.log.seq if below is None else min(self.log.seq, below)

    async def _requests(self, direct: bool) -> AsyncIterator[pb.JobWatchRequest]:
        rank = self._said_first = self._rank()
        hosts = self._hosts()
        acked = self.log.seq
        yield pb.JobWatchRequest(job=self.job, relay_address=self.relay_address,
                                 since_epoch=self.log.epoch, since_seq=self.log.seq,
                                 direct=direct, requester=rank, hosts=hosts)
        while True:
            try:  # (nothing to say: an empty request, that this host lives)
                async with asyncio.timeout(jobtree.HEARTBEAT_S):
                    await self._more.wait()
            except TimeoutError:
                yield pb.JobWatchRequest()
                continue
            self._more.clear()
            rank, said = self._rank(), pb.JobWatchRequest()
            if rank is not None and (self._said_first is None
                                     or rank.process_id != self._said_first.process_id):
                self._said_first = rank
                said.requester.CopyFrom(rank)
            if self._hosts() != hosts:
                hosts = said.hosts = self._hosts()
            if self.relay_address and self._acked() > acked:  # (its subtree's pace, upward)
                acked = said.since_seq = self._acked()
            if said.hosts or said.HasField("requester") or said.since_seq:
                yield said
            while self._outbox:
                page, self._outbox = self._outbox[:MAX_WAITS], self._outbox[MAX_WAITS:]
                yield pb.JobWatchRequest(waits=page)

    def _take(self, events: pb.JobEvents) -> None:
        if events.seq and self.subtree is not None:  # kept, passed on whole to the subtree
            data = events.SerializeToString()
            self.log.add(events.seq, data)
            self.subtree.news(data, events.seq)
        elif events.seq:
            self.log.heard(events.seq)
        if events.seq:
            self._more.set()  # (acknowledged upward: _requests)
        published = list(events.published)  # (each read once: a message's fields cost a read)
        asked = list(events.ask)
        if self.subtree is not None:
            self.subtree.answered(events)
        for key in events.claimed:
            self._claimed[key] = None
            self._asked.pop(key, None)
        for key in asked:  # (its wait here ended: a claim of it says nothing now)
            self._named.pop(key, None)
            self._claimed.pop(key, None)
            self._asked[key] = None
        for keys in (self._claimed, self._asked):
            while len(keys) > MAX_CLAIMED:
                del keys[next(iter(keys))]
        for info in published:
            key = info.key
            self._named.pop(key, None)
            self._claimed.pop(key, None)
        if published:
            self.published(published)
        for info in events.publishing:
            if info.key in self._waiting:
                self._end(info.key, pb.WaitEvent(decision=pb.WAIT, artifact=info,
                                                 reason="publishing: a fetch streams the bytes"))
        for info in published:
            if info.key in self._waiting:  # (the event made only for a wait here)
                self._end(info.key, pb.WaitEvent(decision=pb.HIT, artifact=info))
        for key in asked:
            self._end(key, None)
        for turn in events.turns:
            if self.upstream:  # a relay's word: taken once the coordinator says it is so
                self._later(self._proven(turn))
            elif not self._turn(turn):  # nobody here or below waits for it now
                self._give_back(turn)

    async def _proven(self, turn: pb.KeyTurn) -> None:
        """A turn a relay passed down, taken only where the coordinator says
        its lease holds the key now (a KeepAlive of it: the lease's id and
        revision checked); else dropped, and the wait goes on: a forged turn
        never makes this host compile beside the holder."""
        try:
            held = await self.link.up.KeepAlive(
                pb.KeepAliveRequest(key=turn.key, lease=turn.event.lease),
                timeout=self.link.rpc_timeout_s, metadata=self.md)
        except CompilecastError as exc:
            log.warning("job %s: a turn at %s from relay %s not taken: its lease could not "
                        "be checked (%s)", self.job, turn.key, self.upstream, exc.status.name)
            return
        if held.ttl_seconds <= 0:
            log.warning("job %s: a turn at %s from relay %s not taken: the coordinator says "
                        "its lease does not hold the key", self.job, turn.key, self.upstream)
            return
        if not self._turn(turn):
            self._give_back(turn)

    def _turn(self, turn: pb.KeyTurn) -> bool:
        """A turn to this host's first-ranked process where it ranks first in
        the subtree and waits for the key, else to the subtree."""
        below = self.subtree.first() if self.subtree is not None else None
        mine = self._first is not None and turn.key in self._waiting and (
            below is None or self._first.process_id <= below.process_id)
        if mine:
            return self._end(turn.key, turn.event)
        if self.subtree is not None and self.subtree.turn(turn):
            return True
        return self._end(turn.key, turn.event)

    def _end(self, key: str, event: pb.WaitEvent | None) -> bool:
        done = self._waiting.pop(key, None)
        if done is None or done.done():
            return False
        done.set_result(event)
        return True

    def _give_back(self, turn: pb.KeyTurn) -> None:
        """A turn to compile that no process here takes: released, so that
        another is given it now rather than when its lease expires."""
        async def release() -> None:
            try:
                await self.link.up.Release(pb.ReleaseRequest(
                    key=turn.key, lease=turn.event.lease, reason=pb.ABANDONED,
                    detail="no process of this host waits for it any more"),
                    timeout=self.link.rpc_timeout_s, metadata=self.md)
            except CompilecastError as exc:
                log.info("job %s: a turn at %s not given back (%s); its lease expires",
                         self.job, turn.key, exc.status.name)

        self._later(release())

    def _later(self, work) -> None:
        """`work` on the loop, held until it ends (a release, a turn's check)."""
        self._releases.add(task := asyncio.ensure_future(work))
        task.add_done_callback(self._releases.discard)

    def _end_all(self) -> None:
        waiting, self._waiting, self._outbox = self._waiting, {}, []
        self._claimed.clear()  # (heard again on the next stream)
        self._asked.clear()
        self._named.clear()
        self.log.restart("", 0)
        if self.subtree is not None:
            self.subtree.end_all()  # (its children open theirs elsewhere)
        for done in waiting.values():
            if not done.done():
                done.set_result(None)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._end_all()
