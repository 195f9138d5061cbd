"""The coordinator's waits: a process waiting for a key someone else
compiles, woken by the key's publish (one prefix watch per replica), hedging a
holder far past the program's expected compile time, promoted in order when
the key is free; and the P/w records that order waiters across replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from compilecast import validate
from compilecast.deadline import Deadline
from compilecast.errors import (
    Unavailable,
)
from compilecast.serving import Background
from compilecast.v1 import cache_pb2 as pb

from .claims import Claims
from .etcd import LeaseGone, WriteBatcher
from .keystate import (
    KeyState,
    KeyWaiters,
    holder_name,
    local_verdict,
    lowest_rank,
)
from .keyview import Keyspace
from .records import (
    DEFAULT_TENANT,
    plain,
    scope,
    tenant_of,
)
from .uploads import Uploads

log = logging.getLogger("compilecast.coordinator.state")

WAIT_HEARTBEAT_S = 2.0
PROMOTION_STAGGER_S = 0.5
# How long a change of a replica's waiters of a key waits to be written with
# the changes after it (a pod's job start brings a thousand in a few tenths).
WAITER_FLUSH_S = 0.02
LEASE_RETRIES = 3  # a waiter record written again on a new session lease, at most


@dataclass
class _Wait:
    """One wait's state between its looks at the key."""

    sk: str
    req: pb.Requester
    may_publish: bool
    start: float
    rank: str  # its place among the key's waiters: a job's process id, else arrival
    outcome: str = "compile_locally"
    seen_holder: bool = False
    announced: object = None  # the upload already announced to it
    expected: list[float | None] = field(default_factory=list)  # the program's compile time
    free_since: float | None = None  # the key free, with nobody holding it, since


@dataclass(frozen=True)
class WaitSettings:
    share_binary_between_hosts_timeout_ms: int = 20 * 60 * 1000  # a wait's longest
    publish_stream_readers: int = 0  # waiters an upload in progress streams to (0: none)
    hedge_factor: float = 3.0  # hedge a holder compiling this many times the longest known (0: never)
    hedge_min_s: float = 120.0  # never a holder younger than this
    designated_grace_s: float = 10.0  # a job's waiter waits this long for its designated process


class WaitMetrics(Protocol):
    """What the waits record (CoordinatorMetrics is one)."""

    @property
    def compiles(self) -> Any: ...

    @property
    def wait_seconds(self) -> Any: ...

    @property
    def waiters(self) -> Any: ...

    @property
    def waits(self) -> Any: ...


class Waiting:
    """Wait, and this replica's waiter records."""

    def __init__(self, settings: WaitSettings, keys: Keyspace, claims: Claims,
                 metrics: WaitMetrics, uploads: Uploads, background: Background) -> None:
        self.settings = settings
        self.view = keys.view
        self.claims = claims
        self.session = keys.session
        self.etcd = keys.etcd
        self.hub = keys.view.hub
        self.metrics = metrics
        self.records = keys.records
        self.uploads = uploads
        self.background = background
        self._waiter_writes = WriteBatcher(keys.etcd)  # waiter records, put and deleted together
        # This replica's waiters, by key: one P/w record per key and replica
        # says how many there are (a pod's job start writes a few per key, not
        # two per waiter). Its id names that record.
        self._waiting: dict[str, KeyWaiters] = {}
        # Writes of those records waiting to start, by key: the changes that
        # arrive meanwhile go with them (done once the write has landed).
        self._waiter_flushes: dict[str, asyncio.Future[None]] = {}

    def here(self, tenant: str) -> list[tuple[str, dict[str, int]]]:
        """This replica's waiters of the tenant's keys as they are now (its
        records land up to WAITER_FLUSH_S later): (key, waiters by job)."""
        return [(plain(sk), dict(here.jobs)) for sk, here in self._waiting.items()
                if tenant_of(sk) == tenant]

    def deadline(self, key: str, req: pb.Requester, timeout_ms: int) -> Deadline:
        """When a wait a request asks (`timeout_ms` of it; 0: this replica's
        share-binary timeout) ends; InvalidRequest when it cannot be waited
        with. (The replica's edge: from here the wait carries the deadline.)"""
        validate.key(key)
        validate.requester(req)
        return Deadline.asked(timeout_ms, self.settings.share_binary_between_hosts_timeout_ms)

    async def wait(self, key: str, req: pb.Requester, within: int | Deadline, *,
                   tenant: str = DEFAULT_TENANT, may_publish: bool = True
                   ) -> AsyncGenerator[pb.WaitEvent, None]:
        """A wait's events by `within` (a deadline, or a request's
        timeout_ms: see `deadline`)."""
        deadline = within if isinstance(within, Deadline) else self.deadline(key, req, within)
        start = time.monotonic()
        w = _Wait(scope(tenant, key), req, may_publish, start,
                  f"{req.process_id:010d}" if req.job else f"9{time.time_ns():019d}")
        sub = self.hub.subscribe(w.sk)
        self.metrics.waiters.inc()
        registered = False
        try:
            cached = self.view.cached_artifact(w.sk)
            if cached is not None:  # published already: no registration, no read
                self.view.hit(tenant_of(w.sk), cached)
                w.outcome = "hit"
                yield pb.WaitEvent(decision=pb.HIT, artifact=cached)
                return
            registered = True  # counted here from now on: no longer at the end
            self._waiting.setdefault(w.sk, KeyWaiters()).add(w.rank, req.job)
            try:
                await self._write_waiters(w.sk)
            except Unavailable as exc:
                yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=self.view.etcd_down(exc))
                return
            while True:
                sub.clear()
                try:
                    # Woken by a publish: the watch has put the entry in memory.
                    st, events, ended = await self._look(w)
                    for event in events:
                        yield event
                    if ended:
                        return
                    assert st is not None  # (read: no cached HIT ended it)
                    taken = await self._take_over(w, st)
                    if isinstance(taken, pb.WaitEvent):
                        yield taken
                        return
                    if taken == "again":
                        continue
                except Unavailable as exc:
                    yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=self.view.etcd_down(exc))
                    return
                if deadline.passed:
                    w.outcome = "timeout"
                    yield pb.WaitEvent(
                        decision=pb.COMPILE_LOCALLY,
                        reason=f"share-binary timeout of {deadline.said()} passed; compile "
                               "locally",
                    )
                    return
                nap = min(deadline.left_s(), WAIT_HEARTBEAT_S)
                if w.free_since is not None:
                    nap = min(nap, PROMOTION_STAGGER_S)
                if not await sub.wait(nap):
                    yield pb.WaitEvent(decision=pb.WAIT, reason="still compiling")
        finally:
            self.hub.unsubscribe(w.sk, sub)
            self.metrics.waiters.dec()
            self.metrics.waits.labels(w.outcome).inc()
            self.metrics.wait_seconds.observe(time.monotonic() - start)
            if registered:
                here = self._waiting[w.sk]
                here.remove(w.rank, req.job)
                if not here.count:
                    del self._waiting[w.sk]
                self.background.spawn(self._rewrite(w.sk))

    async def _look(self, w: _Wait) -> tuple[KeyState | None, list[pb.WaitEvent], bool]:
        """What the waited key is now: its state, the events to send (a HIT,
        a verdict, an upload to stream), and whether they end the wait."""
        st = None
        info = self.view.cached_artifact(w.sk)
        if info is None:
            st = await self.view.read_shared(w.sk, fresh=True)
            info = await self.view.usable_artifact(w.sk, st)
        if info is not None:
            self.view.hit(tenant_of(w.sk), info)
            w.outcome = "hit"
            return st, [pb.WaitEvent(decision=pb.HIT, artifact=info)], True
        assert st is not None
        if st.local:
            return st, [pb.WaitEvent(decision=pb.COMPILE_LOCALLY, **local_verdict(st.local))], True
        upload = self.uploads.get(w.sk) if self.settings.publish_stream_readers else None
        if upload is not None and upload is not w.announced:
            w.announced = upload  # once per upload: fetching it streams it
            return st, [pb.WaitEvent(decision=pb.WAIT, artifact=upload.info,
                                     reason="publishing: a fetch streams the bytes as they "
                                            "upload")], False
        return st, [], False

    async def _take_over(self, w: _Wait, st: KeyState) -> pb.WaitEvent | str | None:
        """A waiter's turn to compile: a hedge of a holder far past its
        expected compile time, or the promotion of the next waiter of a free
        key (staggered by position). The COMPILE event, "again" (look again
        at once), or None."""
        now = time.monotonic()
        if st.lease or st.hedge:
            w.seen_holder, w.free_since = True, None
            lease = await self._maybe_hedge(w.sk, w.rank, w.req, st, w.may_publish, w.expected)
            if lease is None:
                return None
            w.outcome = "hedged"
            return pb.WaitEvent(decision=pb.COMPILE, lease=lease,
                                reason="the holder is far past the expected compile time: "
                                       "compile too; the first publish wins")
        if not self._may_take(w, now):
            return None
        w.free_since = w.free_since or now
        position = await self._waiter_position(w.sk, w.rank)
        if now - w.free_since < PROMOTION_STAGGER_S * position:
            return None
        lease = await self.claims.try_take(w.sk, w.req)
        if lease is None:
            return "again"
        w.outcome = "promoted"
        self.metrics.compiles.labels("promoted").inc()
        log.info("promoted %s to compile %s", w.req.client or w.req.job, plain(w.sk),
                 extra={"key": w.sk, "job": w.req.job, "process_id": w.req.process_id})
        return pb.WaitEvent(decision=pb.COMPILE, lease=lease)

    def _may_take(self, w: _Wait, now: float) -> bool:
        """Whether a waiter of a free key may claim it: outside a job, or the
        designated process, or once the designated process held it, or after
        the designated grace, or when its claim ended lately."""
        req = w.req
        return w.may_publish and (
            not req.job or w.seen_holder or req.process_id == req.designated_process
            or now - w.start >= self.settings.designated_grace_s
            or self.view.released_lately(w.sk, now))

    async def _maybe_hedge(self, sk: str, rank: str, req: pb.Requester, st: KeyState,
                           may_publish: bool, expected: list[float | None]) -> pb.Lease | None:
        """Hedge a holder that runs far past the program's expected compile
        time: the lowest waiter gets a hedge lease (P/h) and compiles too."""
        factor = self.settings.hedge_factor
        if factor <= 0 or not may_publish or st.lease is None or st.hedge is not None:
            return None
        if not expected:
            expected.append(await self.records.expected_compile_s(tenant_of(sk),
                                                           st.lease.get("program", "")))
        if expected[0] is None:
            return None  # never seen this program compile: nothing to compare with
        age = time.time() - st.lease.get("granted", time.time())
        if age < max(self.settings.hedge_min_s, factor * expected[0]):
            return None
        if await self._waiter_position(sk, rank) != 0:
            return None
        lease = await self.claims.try_take(sk, req, st.lease.get("program", ""),
                                     hedge_of=st.lease_rev)
        if lease is not None:
            self.metrics.compiles.labels("hedge").inc()
            log.warning("hedging %s: holder %s compiles for %.0fs, expected %.0fs", sk,
                        holder_name(st.lease), age, expected[0])
        return lease

    def _waiters_key(self, sk: str) -> bytes:
        return self.view.k("w", sk) + f"/{self.session.replica}".encode()

    def _write_waiters(self, sk: str) -> asyncio.Future:
        """Write this replica's P/w record of `sk` as its waiters will be in
        WAITER_FLUSH_S (deleted when none are left); done once written (or
        failed with Unavailable). The changes that arrive before that write
        starts go with it: a thousand waiters arriving (or leaving) together
        cost a few writes, not two each."""
        flush = self._waiter_flushes.get(sk)
        if flush is None:
            flush = self._waiter_flushes[sk] = asyncio.get_running_loop().create_future()
            self.background.spawn(self._flush_waiters(sk, flush))
        return asyncio.shield(flush)  # one waiter cancelled does not cancel it for all

    async def _flush_waiters(self, sk: str, flush: asyncio.Future) -> None:
        try:
            await asyncio.sleep(WAITER_FLUSH_S)
            lease = await self.session.lease()
            if self._waiter_flushes.get(sk) is flush:  # later changes make a write of their own
                del self._waiter_flushes[sk]
            for attempt in range(LEASE_RETRIES + 1):
                here = self._waiting.get(sk)
                try:
                    if here is None:
                        await self._waiter_writes.delete(self._waiters_key(sk),
                                                         written_before=True)
                    else:
                        await self._waiter_writes.put(self._waiters_key(sk), here.record(),
                                                      lease=lease)
                    break
                except LeaseGone:
                    # The replica's lease expired under a burst (the loop fell
                    # behind its keepalive), or a write of this batch still
                    # named it: written again on the new one.
                    if attempt == LEASE_RETRIES:
                        raise
                    if await self.session.lost(lease):  # every record of the replica's went too
                        for other in self._waiting:
                            if other != sk:
                                self.background.spawn(self._rewrite(other))
                    lease = await self.session.lease()
        except Exception as exc:  # Unavailable (or a bug): the waiters hear of it
            if not flush.done():
                flush.set_exception(exc)
                flush.exception()  # retrieved: the waiters that left do not await it
        else:
            if not flush.done():
                flush.set_result(None)
        finally:
            if not flush.done():  # cancelled (a stop): its waiters are ending too
                flush.cancel()
            if self._waiter_flushes.get(sk) is flush:
                del self._waiter_flushes[sk]

    async def _rewrite(self, sk: str) -> None:
        with contextlib.suppress(Exception):
            await self._write_waiters(sk)

    async def _waiter_position(self, sk: str, rank: str) -> int:
        """How many waiters go before a waiter of this replica with `rank`
        when the key is free: those here with a lower rank, and each other
        replica whose lowest waiter's rank is lower. The lowest waiter of all
        gets 0 (it alone goes first; the others follow it, staggered)."""
        here = self._waiting.get(sk)
        position = here.below(rank) if here is not None else 0
        mine = self._waiters_key(sk)
        for kv in await self.etcd.get_prefix(self.view.k("w", sk) + b"/"):
            if kv.key != mine and (lowest := lowest_rank(kv)) is not None and lowest < rank:
                position += 1
        return position
