"""A pod's cold start: one stream per host and job (WatchJob), not a
request and a wait per host and program (docs/architecture/pod-start.md, "A pod's
cold start").

A host's worker opens one stream for its job and says on it which of the
job's processes it serves ranks first (the lowest process id, JAX's order
among a program's waiters). When the job's designated process is granted a
key's lease (an Acquire naming the job), this replica tells every stream of
the job that the key is being compiled ("claimed") and waits for it once,
whatever the number of hosts, in the name of the first-ranked stream; a
host's process that waits for a claimed key names nothing upstream. A key
nobody claimed (the designated process never asked for it) is named by the
hosts that wait for it, and waited for the same way. The wait is
`Waiting.wait`, the one a process's Wait call has, so the rules of who
compiles are the same, and so is failover (its waiter record in etcd, its
promotion when the holder dies, its hedge of a holder far past its time).
Its end goes to the hosts:

- an upload's start (a coordinator that streams uploads to waiters): the
  artifact goes to every stream as `publishing`, and the wait goes on;
- HIT: the artifact goes to every stream of the job (the job's news,
  serialized once for all of them, a numbered message of what came in one
  turn of the event loop; each stream sends it at once where its host, and
  the host's subtree, acknowledged all it was sent, else joined with what
  follows when they do: jobtree.Outbox);
- COMPILE (a promotion or a hedge): to the first-ranked stream alone, as a
  KeyTurn with the lease; the key is then waited for again (the new holder's
  publish is the HIT everyone gets). A host whose waiter left meanwhile gives
  the lease back; a second turn for the same stream, or a turn for a stream
  that is gone, ends the key's wait here (below);
- anything else (the holder's compile failed, the key is compiled locally,
  the share-binary timeout passed): the key goes to every stream as one to
  ask for one by one, as without a stream, and the replica stops waiting for
  it.

The tree (compilecast/jobtree.py): the replica serves `fanout` of a job's
streams; a later one, from a host whose worker relays the job's news
(relay_address), is pointed at a served stream of the same identity that
relays (`relay_from`), and its worker serves it or points it further down
(worker/daemon/jobrelay.py). A relay's stream is a host's stream as this
replica sees it: it names its subtree's keys once and says its subtree's
first-ranked process, so a turn given to it is passed down to that
process's host. The news sent to every stream is numbered (the job's
NewsLog: an epoch for this replica's run of the job, a seq a message), and
a stream that opens again with the last it heard resumes after it.

Bounds: MAX_STREAMS streams on a replica, TENANT_STREAMS of them a tenant's,
IDENTITY_STREAMS an identity's (READER_STREAMS one that may only read),
MAX_KEYS keys waited for a job, a stream's unsent messages (QUEUED: a host
that reads too slowly is ended with RESOURCE_EXHAUSTED and asks key by key),
MAX_WAITS keys a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from compilecast import jobtree, validate
from compilecast.errors import InvalidRequest, TooMany
from compilecast.grpcutil import one_line
from compilecast.jobtree import Branch, NewsLog, Outbox
from compilecast.v1 import cache_pb2 as pb

from .keyview import KeyView
from .manifests import MAX_KEYS
from .metrics import CoordinatorMetrics
from .records import scope
from .waiting import Waiting

log = logging.getLogger(__name__)

MAX_STREAMS = 20_000  # job streams held by a replica
TENANT_STREAMS = 15_000  # of them by one tenant (the others keep a quarter)
IDENTITY_STREAMS = TENANT_STREAMS  # by one identity that may publish (a job's worker token)
READER_STREAMS = 1_000  # by one identity that may only read
MAX_WAITS = jobtree.MAX_WAITS  # keys a message may name
LINGER_S = 30.0  # a job whose streams all ended is kept this long (its news, its waits)
MAX_LINGERING = 1024  # jobs kept so at once
GAP_S = (0.02, 1.0)  # a burst's news leaves a relaying stream at least, at most this far apart
# This long a host of the job: every host reads every message (~0.1 ms of a
# core, a relay's sends included), so a burst of news costs the job's fleet
# about a core at most, however many hosts it has.
SEND_S = 1e-4


def gap_s(hosts: int) -> float:
    """How far apart a burst's news leaves a relaying stream of a job of `hosts`."""
    return min(GAP_S[1], max(GAP_S[0], hosts * SEND_S))


@dataclass(eq=False)
class _Stream:
    may_publish: bool
    identity: str = ""
    branch: Branch = field(default_factory=lambda: Branch(""))  # where it relays the news
    outbox: Outbox = field(default_factory=Outbox)
    first: First | None = None  # the first-ranked process its host serves, once said
    hosts: int = 1  # it serves (a relay: its subtree's)

    @property
    def open(self) -> bool:
        return self.outbox.open

    def send(self, message: pb.JobEvents | bytes, seq: int = 0) -> None:
        self.outbox.send(message, seq)  # (past its bound: ended, and its host asks key by key)

    def end(self) -> None:
        self.outbox.end()


First = tuple[int, _Stream, pb.Requester]  # a stream whose host's process ranks first


@dataclass(eq=False)
class _Key:
    first: First | None  # of the streams that named the key
    task: asyncio.Task | None = None
    turned: set[_Stream] = field(default_factory=set)  # streams given a turn at the key


@dataclass(eq=False)
class _Job:
    tenant: str
    job: str
    streams: set[_Stream] = field(default_factory=set)
    first: First | None = None  # of all its streams
    ranked: asyncio.Event = field(default_factory=asyncio.Event)  # first is an open stream
    keys: dict[str, _Key] = field(default_factory=dict)
    published: list[pb.ArtifactInfo] = field(default_factory=list)
    ask: list[str] = field(default_factory=list)
    claimed: list[str] = field(default_factory=list)
    publishing: list[pb.ArtifactInfo] = field(default_factory=list)
    flush: asyncio.Handle | None = None  # (its news leaves at the loop's next turn)
    linger: asyncio.TimerHandle | None = None  # its streams all ended: dropped then
    log: NewsLog = field(default_factory=lambda: NewsLog(os.urandom(8).hex()))

    def said(self, stream: _Stream, first: First) -> None:
        """A stream said which process its host (a relay: its subtree) serves
        first, in place of what it said before."""
        was, stream.first = stream.first, first
        if _before(first[0], self.first):
            self.first = first
        elif was is not None and self.first is was:  # its first went: counted again
            said = [s.first for s in self.streams if s.open and s.first is not None]
            self.first = min(said, key=lambda f: f[0])
        self.ranked.set()

    def first_open(self) -> First | None:
        """Its first-ranked open stream that said whom it serves (counted
        again, over its streams, only when the one it had has ended)."""
        if self.first is not None and not self.first[1].open:
            said = [s.first for s in self.streams if s.open and s.first is not None]
            self.first = min(said, key=lambda f: f[0]) if said else None
            if self.first is None:
                self.ranked.clear()
        return self.first


def _ended() -> Outbox:
    outbox = Outbox()
    outbox.end()
    return outbox


def _before(rank: int, first: First | None) -> bool:
    """Whether a process of `rank` goes before `first` (or there is none, or it ended)."""
    return first is None or rank < first[0] or not first[1].open


async def _end_of(events: AsyncIterator[pb.WaitEvent], until: asyncio.Event | None,
                  publishing: Callable[[pb.ArtifactInfo], None]) -> pb.WaitEvent | None:
    """The event that ends a wait (an upload's start told to `publishing`);
    None when `until` is set first."""

    async def ending() -> pb.WaitEvent:
        async for event in events:
            if event.decision != pb.WAIT:
                return event
            if event.HasField("artifact"):
                publishing(event.artifact)
        return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason="the wait ended")

    if until is None:
        return await ending()
    end, ranked = asyncio.ensure_future(ending()), asyncio.ensure_future(until.wait())
    try:
        await asyncio.wait({end, ranked}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (end, ranked):
            task.cancel()
        await asyncio.gather(end, ranked, return_exceptions=True)
    return end.result() if end.done() and not end.cancelled() else None


# A turn nobody takes (its host's stream ended), given back: (key, lease, tenant)
GiveBack = Callable[[str, pb.Lease, str], Awaitable[None]]


class JobWatches:
    """`fanout`: streams of a job served here before newcomers go down the
    tree (0: all of them here)."""

    def __init__(self, waiting: Waiting, view: KeyView, give_back: GiveBack,
                 metrics: CoordinatorMetrics, *, fanout: int = jobtree.FANOUT) -> None:
        self.waiting = waiting
        self.view = view
        self.give_back = give_back
        self.metrics = metrics
        self.fanout = fanout
        metrics.job_streams.set_function(lambda: self.streams)
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._held: dict[str | tuple[str, str], int] = {}  # open streams by tenant, identity
        self.streams = 0  # open now (Status, tests)
        self.turns = 0  # keys given to a stream's host to compile
        self.named = 0  # keys hosts named (nobody had claimed them that they knew of)
        self.redirected = 0  # streams pointed down the tree
        self.resumed = 0  # streams that resumed the news after what they had heard
        self.sent_bytes = 0  # the news's bytes sent on every stream (egress)
        self.lingering = 0  # jobs whose streams all ended, kept a while
        self.closed = False

    def _admit(self, tenant: str, identity: str, may_publish: bool) -> None:
        """TooMany past a bound: the replica's, its tenant's, its identity's
        (a reader's is smaller: it holds a stream of news and takes no turn)."""
        if self.streams >= MAX_STREAMS:
            raise TooMany(f"{MAX_STREAMS} job streams are open on this replica; "
                          "ask key by key")
        if self._held.get(tenant, 0) >= TENANT_STREAMS:
            raise TooMany(f"tenant {tenant!r} holds {TENANT_STREAMS} job streams on this "
                          "replica; ask key by key")
        most = IDENTITY_STREAMS if may_publish else READER_STREAMS
        if self._held.get((tenant, identity), 0) >= most:
            raise TooMany(f"{identity!r} holds {most} job streams on this replica"
                          f"{'' if may_publish else ' (it may not publish)'}; ask key by key")

    async def serve(self, requests: AsyncIterator[pb.JobWatchRequest], *, tenant: str,
                    identity: str = "", may_publish: bool) -> AsyncIterator[pb.JobEvents | bytes]:
        """The stream's events, to the end of `requests` (or past its bound)."""
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if not first.job:
            raise InvalidRequest("name the job to watch in the stream's first message")
        validate.job(first.job)
        if first.relay_address:
            validate.relay_address(first.relay_address)
        job = self._jobs.get((tenant, first.job))
        if job is not None and job.linger is not None:  # its streams come back
            job.linger.cancel()
            job.linger = None
            self.lingering -= 1
        if job is not None and not first.direct:
            relay = jobtree.place([s.branch for s in job.streams if s.open and
                                   s.identity == identity and s.may_publish == may_publish],
                                  self.fanout)
            if relay is not None:  # down the tree: its worker serves the newcomer
                self.redirected += 1
                self.metrics.job_stream_events.labels("redirected").inc()
                yield pb.JobEvents(relay_from=relay.address)
                return
        self._admit(tenant, identity, may_publish)
        if job is None:
            job = self._jobs[(tenant, first.job)] = _Job(tenant, first.job)
        me = _Stream(may_publish, identity, Branch(first.relay_address),
                     Outbox(gated=bool(first.relay_address)))
        job.streams.add(me)
        self.streams += 1
        held = (tenant, identity)
        self._held[tenant] = self._held.get(tenant, 0) + 1
        self._held[held] = self._held.get(held, 0) + 1
        opening = jobtree.opened(job.log, first, me.outbox)
        if opening.resumed:
            self.resumed += 1
            self.metrics.job_stream_events.labels("resumed").inc()
        reader = asyncio.ensure_future(self._read(job, me, first,
                                                  jobtree.requests_of(first, it).__aiter__()))
        try:
            yield opening
            async for data in jobtree.sent(me.outbox, reader, "open the stream again, and "
                                                              "ask key by key meanwhile"):
                self.sent_bytes += len(data)
                self.metrics.job_news_bytes.inc(len(data))
                yield data
        finally:
            me.end()
            jobtree.stop(reader)
            self.streams -= 1
            for k in (tenant, held):
                self._held[k] -= 1
                if not self._held[k]:
                    del self._held[k]
            job.streams.discard(me)
            if not job.streams:
                self._linger(job)

    async def _read(self, job: _Job, me: _Stream, first: pb.JobWatchRequest,
                    it: AsyncIterator[pb.JobWatchRequest]) -> None:
        try:
            message = first
            while True:
                if hosts := jobtree.checked(message, job.job):
                    me.hosts = hosts
                if message is not first:
                    jobtree.acked(message, me.outbox)
                if message.HasField("requester"):
                    r = message.requester
                    # A stream that may not publish ranks nowhere: a wait in its
                    # name is never promoted, so a turn must never wait on it.
                    if me.may_publish:
                        job.said(me, (r.process_id, me, r))
                if message.waits:
                    self.named += len(message.waits)
                    self.metrics.job_stream_events.labels("named").inc(len(message.waits))
                for w in message.waits:
                    self._want(job, me, w)
                try:
                    message = await it.__anext__()
                except StopAsyncIteration:
                    break
        finally:
            me.end()

    def _want(self, job: _Job, me: _Stream, w: pb.WaitRequest) -> None:
        """The host of `me` waits for `w.key`."""
        info = self.view.cached_artifact(scope(job.tenant, w.key))
        if info is not None:  # published already: to this stream alone (its host counts it)
            me.send(pb.JobEvents(published=[info]))
            return
        rank = w.requester.process_id
        mine = (rank, me, w.requester) if me.may_publish else None  # (a reader ranks nowhere)
        k = job.keys.get(w.key)
        if k is None:
            if not self._watch(job, w.key, mine):
                me.send(pb.JobEvents(ask=[w.key]))
        elif mine is not None and _before(rank, k.first):
            k.first = mine

    def _watch(self, job: _Job, key: str, first: First | None) -> bool:
        """Wait for `key` here (False past MAX_KEYS)."""
        if len(job.keys) >= MAX_KEYS:
            return False
        k = job.keys[key] = _Key(first)
        k.task = asyncio.ensure_future(self._wait(job, key, k))
        return True

    def noted(self, tenant: str, requests, answers) -> None:
        """Acquires answered (service.py): a key of a job with streams whose
        lease was granted is claimed, and waited for here."""
        if not self._jobs or answers is None:
            return
        for r, a in zip(requests, answers, strict=False):
            if a is None or a.decision != pb.COMPILE:
                continue
            job = self._jobs.get((tenant, r.manifest_job or r.requester.job))
            if job is None or r.key in job.keys:
                continue
            if self._watch(job, r.key, None):
                self._news(job, claimed=r.key)

    async def _wait(self, job: _Job, key: str, k: _Key) -> None:
        """Wait for `key` in the name of its first-ranked stream until it is
        published, or until the hosts are to ask for it one by one."""
        try:
            while True:
                first = k.first if k.first is not None and k.first[1].open else job.first_open()
                if first is None:  # no host said who it serves yet: one that takes no turn
                    first = (-1, _Stream(False, outbox=_ended()),
                             pb.Requester(job=job.job, process_id=(1 << 31) - 1,
                                          designated_process=0, client="a job's stream"))
                _, stream, requester = first
                async with contextlib.aclosing(self.waiting.wait(
                        key, requester, 0, tenant=job.tenant,
                        may_publish=stream.may_publish)) as events:
                    end = await _end_of(events, None if stream.open else job.ranked,
                                        lambda info: self._news(job, publishing=info))
                if end is None:  # a host said who it serves: wait in its name
                    continue
                if end.decision == pb.HIT:
                    self._news(job, published=end.artifact)
                    return
                if end.decision != pb.COMPILE:
                    log.info("job %s: hosts ask for %s one by one (%s: %s)", job.job, key,
                             pb.Decision.Name(end.decision), end.reason)
                    self._news(job, ask=key)
                    return
                if not stream.open or stream in k.turned:
                    # Its host went, or had the turn already (its process left
                    # since): the hosts ask for the key one by one.
                    with contextlib.suppress(Exception):  # (else it expires)
                        await self.give_back(key, end.lease, job.tenant)
                    self._news(job, ask=key)
                    return
                k.turned.add(stream)
                self.turns += 1
                stream.send(pb.JobEvents(turns=[pb.KeyTurn(key=key, event=end)]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (etcd gone, a bug): the hosts ask key by key
            log.info("job %s: the wait for %s failed (%s); its hosts ask for it", job.job, key,
                     one_line(exc))
            self._news(job, ask=key)
        finally:
            if job.keys.get(key) is k:
                del job.keys[key]

    def _news(self, job: _Job, *, published: pb.ArtifactInfo | None = None,
              ask: str | None = None, claimed: str | None = None,
              publishing: pb.ArtifactInfo | None = None) -> None:
        if published is not None:
            job.published.append(published)
        if publishing is not None:
            job.publishing.append(publishing)
        if ask is not None:
            job.ask.append(ask)
        if claimed is not None:
            job.claimed.append(claimed)
        if job.flush is None:
            job.flush = asyncio.get_running_loop().call_soon(self._flush, job)

    def _flush(self, job: _Job) -> None:
        job.flush = None
        seq = job.log.seq + 1
        message = pb.JobEvents(published=job.published, ask=job.ask, claimed=job.claimed,
                               publishing=job.publishing, seq=seq,
                               epoch=job.log.epoch).SerializeToString()
        job.log.add(seq, message)
        job.published, job.ask, job.claimed, job.publishing = [], [], [], []
        gap = gap_s(sum(s.hosts for s in job.streams))
        for s in list(job.streams):
            s.outbox.gap_s = gap
            s.send(message, seq)  # (serialized once, sent to every host: wire.SERIALIZED)

    def _linger(self, job: _Job) -> None:
        """The job's last stream ended: its news and waits are kept LINGER_S
        for a stream that opens again (its relay died) to resume, then dropped
        (at once past MAX_LINGERING jobs)."""
        if self.closed or self.lingering >= MAX_LINGERING:
            self._drop(job)
            return
        self.lingering += 1
        job.linger = asyncio.get_running_loop().call_later(LINGER_S, self._drop, job)

    def _drop(self, job: _Job) -> None:
        """The job's last stream ended (LINGER_S ago): its waits end too."""
        if job.linger is not None:
            job.linger.cancel()
            job.linger = None
            self.lingering -= 1
        if self._jobs.get((job.tenant, job.job)) is job:
            del self._jobs[(job.tenant, job.job)]
        for k in list(job.keys.values()):
            if k.task is not None:
                k.task.cancel()
        if job.flush is not None:
            job.flush.cancel()

    def close(self) -> None:
        """Every stream ends (this replica stops): their hosts open them again
        elsewhere, and ask key by key meanwhile."""
        self.closed = True
        for job in list(self._jobs.values()):
            for s in list(job.streams):
                s.end()
            self._drop(job)
