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
to learn sooner and cheaper, never a reason to hang or to compile. A broken
stream is opened again after a pause (retry.JOB_STREAM).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from compilecast import retry
from compilecast.errors import CompilecastError
from compilecast.v1 import cache_pb2 as pb

from .upstream import CoordinatorLink

log = logging.getLogger(__name__)

MAX_WAITS = 1000  # keys a message names (the coordinator's bound)
# A key nobody has claimed is named upstream after this long: well above the
# longest a replica gathers a job's news (jobwatch.FLUSH_S, 1 s at 10,000
# streams), so that a claim reaches every host before any names the key.
NAME_AFTER_S = 3.0
MAX_CLAIMED = 100_000  # claimed keys remembered, and asked ones (past it, the oldest go)


class JobStream:
    """`published`: the job's artifacts as they are published (the host's
    manifest learns them)."""

    def __init__(self, link: CoordinatorLink, md: tuple, job: str,
                 published: Callable[[list[pb.ArtifactInfo]], None]) -> None:
        self.link = link
        self.md = md
        self.job = job
        self.published = published
        self.live = False  # open: the coordinator said so
        self.opened = 0  # times it opened (status, tests)
        self._waiting: dict[str, asyncio.Future[pb.WaitEvent | None]] = {}
        self._claimed: dict[str, None] = {}  # (in the order heard)
        self._asked: dict[str, None] = {}  # keys to ask for one by one, as the stream said
        self._first: pb.Requester | None = None  # the first-ranked process here, once said
        self._said = False
        self._outbox: list[pb.WaitRequest] = []
        self._more = asyncio.Event()
        self._releases: set[asyncio.Future[None]] = set()
        self._task = asyncio.ensure_future(self._run())

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
        if not self.live or request.key in self._asked:
            return None
        r = request.requester
        if self._first is None or r.process_id < self._first.process_id:
            self._first, self._said = pb.Requester(), False
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
        if self.live and self._waiting.get(request.key) is done and \
                request.key not in self._claimed:
            self._outbox.append(request)
            self._more.set()

    async def _run(self) -> None:
        tries = 0  # since it was last open
        while True:
            opened = self.opened
            try:
                await self._follow()
            except CompilecastError as exc:
                log.info("job %s: its stream ended (%s: %s); its waits go upstream key by "
                         "key", self.job, exc.status.name, exc)
            finally:
                self.live = False
                self._end_all()
            tries = 0 if self.opened > opened else tries + 1
            await asyncio.sleep(retry.JOB_STREAM.pause(tries))

    async def _follow(self) -> None:
        call = self.link.up.WatchJob(self._requests(), metadata=self.md)
        try:
            async for events in call:
                if not self.live:
                    self.live = True
                    self.opened += 1
                    continue
                self._take(events)
        finally:
            call.cancel()

    async def _requests(self) -> AsyncIterator[pb.JobWatchRequest]:
        yield pb.JobWatchRequest(job=self.job)
        while True:
            await self._more.wait()
            self._more.clear()
            if self._first is not None and not self._said:
                self._said = True
                yield pb.JobWatchRequest(requester=self._first)
            while self._outbox:
                page, self._outbox = self._outbox[:MAX_WAITS], self._outbox[MAX_WAITS:]
                yield pb.JobWatchRequest(waits=page)

    def _take(self, events: pb.JobEvents) -> None:
        for key in events.claimed:
            self._claimed[key] = None
            self._asked.pop(key, None)
        for key in events.ask:  # (its wait here ended: a claim of it says nothing now)
            self._claimed.pop(key, None)
            self._asked[key] = None
        for keys in (self._claimed, self._asked):
            while len(keys) > MAX_CLAIMED:
                del keys[next(iter(keys))]
        for info in events.published:
            self._claimed.pop(info.key, None)
        if events.published:
            self.published(list(events.published))
        for info in events.publishing:
            self._end(info.key, pb.WaitEvent(decision=pb.WAIT, artifact=info,
                                             reason="publishing: a fetch streams the bytes"))
        for info in events.published:
            self._end(info.key, pb.WaitEvent(decision=pb.HIT, artifact=info))
        for key in events.ask:
            self._end(key, None)
        for turn in events.turns:
            if not self._end(turn.key, turn.event):  # nobody here waits for it now
                self._give_back(turn)

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

        self._releases.add(task := asyncio.ensure_future(release()))
        task.add_done_callback(self._releases.discard)

    def _end_all(self) -> None:
        waiting, self._waiting, self._outbox = self._waiting, {}, []
        self._claimed.clear()  # (heard again on the next stream)
        self._asked.clear()
        self._said = False
        self._more.set()  # (the next stream says who ranks first here)
        for done in waiting.values():
            if not done.done():
                done.set_result(None)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._end_all()
