"""Pre-granted etcd leases for compile claims.

A claim (P/l or P/h) lives on its own etcd lease, so that it vanishes when
its holder stops renewing it. Granting that lease while the client waits
costs a raft write and a round trip on every miss; here a small pool is
granted ahead, in the background and concurrently (etcd batches the
proposals), and a miss takes one. A lease that an attempt did not use (the
key turned out to be taken) goes back into the pool. Leases older than half
of their TTL are not handed out (the old ones are left to expire in etcd),
and a holder is told the whole seconds its lease has left (`ttl_left`, at
least half the TTL): it renews at a third of that, so its first renewal has
two thirds of it, at least a third of the TTL, to land. The pool holds no
more leases than were taken in the last such interval (at most `size`): an
idle coordinator grants nothing ahead, a busy one keeps a full pool.

A requester's claims share one lease. A claim must vanish when its holder
stops renewing it, and a holder is one process: its claims can all live on
its one lease, renewed by any of them, and all vanish when the process stops.
So a take for an owner (tenant, job, process and the process's own name)
hands out the owner's current lease while it is as fresh as a pooled one
would be (granted, or renewed through this replica, within half of the
TTL); a staler one still alive is renewed first, over the one renewal
stream (leader-local in etcd, no raft write), and handed out when that
worked; otherwise a pooled lease becomes the owner's. One grant then serves
a process's misses for as long as it keeps making them, instead of one
grant each. A take that finds the owner's lease past half of that age
still hands it out at once, and renews it in the background: a process
that keeps making misses does not wait for a renewal round trip. Since
another claim may live on it, a claim's lease is never revoked when the
claim ends (the record is deleted; the lease lapses once nobody renews it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Hashable

from compilecast import tracing
from compilecast.errors import Unavailable
from compilecast.serving import cancel_all

from .etcd import EtcdClient

log = logging.getLogger(__name__)


Lease = tuple[int, float]  # (lease id, granted or last renewed at, monotonic)


class LeasePool:
    OWNERS_MAX = 8192  # owners remembered (least recently used forgotten)

    def __init__(self, etcd: EtcdClient, ttl_s: int, *, size: int = 32) -> None:
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.size = size
        self.max_age_s = ttl_s / 2
        self._free: list[Lease] = []  # (lease id, granted at), oldest first
        self._refill: asyncio.Task | None = None
        self._taken: deque[float] = deque()  # when leases were taken, within max_age_s
        self.granted = 0  # for tests and status: leases granted, pooled or not
        self._owned: OrderedDict[Hashable, Lease] = OrderedDict()  # owner -> its lease
        self._owner_of: dict[int, Hashable] = {}  # lease id -> owner
        self._renewing: dict[int, asyncio.Future] = {}  # lease id -> its renewal in flight
        self.renewals = 0  # for tests: owners' leases renewed instead of a grant

    async def _grant(self) -> Lease:
        at = time.monotonic()
        lease_id = await self.etcd.grant(self.ttl_s)
        self.granted += 1
        return lease_id, at

    def _fresh(self, at: float) -> bool:
        return time.monotonic() - at < self.max_age_s

    def ttl_left(self, at: float) -> int:
        """Whole seconds a lease granted (or as fresh as one granted) at
        `at` has left at least: what its holder is told."""
        return max(1, int(self.ttl_s - (time.monotonic() - at)))

    def _target(self) -> int:
        """Leases to keep ready: as many as were taken in the last max_age_s."""
        horizon = time.monotonic() - self.max_age_s
        while self._taken and self._taken[0] < horizon:
            self._taken.popleft()
        return min(self.size, len(self._taken))

    async def _fill(self) -> None:
        try:
            while len(self._free) < self._target():
                want = self._target() - len(self._free)
                got = await asyncio.gather(*(self._grant() for _ in range(want)),
                                           return_exceptions=True)
                fresh = [g for g in got if not isinstance(g, BaseException)]
                if not fresh:
                    return  # etcd is failing: takes grant directly and report it
                self._free.extend(fresh)
        finally:
            self._refill = None

    def _top_up(self) -> None:
        self._taken.append(time.monotonic())
        if self._refill is None and len(self._free) < max(1, self._target() // 2):
            self._refill = asyncio.create_task(self._fill(), context=tracing.untraced())

    async def take(self, owner: Hashable | None = None) -> Lease:
        """(lease id, granted at): a lease with at least half of its TTL left;
        with an owner, the owner's lease when it is that fresh, or once
        renewed (a renewal is no raft write; a grant is)."""
        if owner is not None:
            mine = self._owned.get(owner)
            age = time.monotonic() - mine[1] if mine is not None else 0.0
            if mine is not None and age < self.max_age_s:
                self._owned.move_to_end(owner)
                if age >= self.max_age_s / 2:
                    self._renewal(mine[0])  # ahead: the owner's next take finds it fresh
                return mine
            if mine is not None and age < self.ttl_s:
                renewed = await self._renew(owner, mine[0])
                if renewed is not None:
                    return renewed
        lease = await self._take_pooled()
        if owner is not None:
            self._own(owner, lease)
        return lease

    def _renewal(self, lease_id: int) -> asyncio.Future:
        """The renewal of an owner's lease in flight, started when there is
        none; when it lands, the lease is as fresh as its TTL left says."""
        renewal = self._renewing.get(lease_id)
        if renewal is None:
            renewal = self._renewing[lease_id] = asyncio.ensure_future(
                self.etcd.keepalive_once(lease_id))
            renewal.add_done_callback(functools.partial(self._renewal_done, lease_id))
            self.renewals += 1
        return renewal

    def _renewal_done(self, lease_id: int, renewal: asyncio.Future) -> None:
        self._renewing.pop(lease_id, None)
        if not renewal.cancelled() and renewal.exception() is None:
            self.renewed(lease_id, renewal.result())

    async def _renew(self, owner: Hashable, lease_id: int) -> Lease | None:
        """Renew an owner's lease that is no longer fresh, once for all of
        its concurrent takes; the lease, fresh again, or None (gone, or etcd
        failed: a pooled one then)."""
        try:
            await asyncio.shield(self._renewal(lease_id))  # renewed() has run
        except Unavailable:
            return None
        now = self._owned.get(owner)
        return now if now is not None and now[0] == lease_id and self._fresh(now[1]) else None

    def _own(self, owner: Hashable, lease: Lease) -> None:
        old = self._owned.pop(owner, None)
        if old is not None:
            self._owner_of.pop(old[0], None)
        self._owned[owner] = lease
        self._owner_of[lease[0]] = owner
        while len(self._owned) > self.OWNERS_MAX:
            _, dropped = self._owned.popitem(last=False)
            self._owner_of.pop(dropped[0], None)

    def renewed(self, lease_id: int, ttl_left_s: int) -> None:
        """A holder renewed `lease_id` through this replica; it had
        `ttl_left_s` left (0: it is gone)."""
        owner = self._owner_of.get(lease_id)
        if owner is None:
            return
        if ttl_left_s <= 0:
            del self._owner_of[lease_id]
            self._owned.pop(owner, None)
            return
        # As fresh as a lease granted when this one had its whole TTL left.
        self._owned[owner] = (lease_id, time.monotonic() - max(0, self.ttl_s - ttl_left_s))

    async def _take_pooled(self) -> Lease:
        while self._free:
            lease = self._free.pop()  # the newest
            if self._fresh(lease[1]):
                self._top_up()
                return lease
            self._free.clear()  # everything older is staler still
        self._top_up()
        return await self._grant()

    def give_back(self, lease: Lease) -> None:
        """A lease from take() that no claim used. An owner's lease stays
        the owner's: another of its claims may live on it."""
        if lease[0] in self._owner_of:
            return
        if self._fresh(lease[1]) and len(self._free) < self.size:
            self._free.append(lease)
            self._free.sort(key=lambda e: e[1])

    async def close(self) -> None:
        await cancel_all([t for t in (self._refill, *self._renewing.values()) if t is not None])
        free, self._free = self._free, []
        await asyncio.gather(*(self.etcd.revoke(i) for i, _ in free), return_exceptions=True)


class Session:
    """A replica's session: its id among the replicas, and the etcd lease
    its own records (the P/w waiter records) live on, kept alive while the
    replica runs and revoked when it stops."""

    def __init__(self, etcd: EtcdClient, ttl_s: int) -> None:
        self.etcd = etcd
        self.ttl_s = max(ttl_s, 5)
        self.replica = uuid.uuid4().hex[:16]
        self._lease = 0

    async def lease(self) -> int:
        if not self._lease:
            self._lease = await self.etcd.grant(self.ttl_s)
        return self._lease

    async def lost(self, lease_id: int) -> bool:
        """A write on `lease_id` was refused for want of its lease: whether
        it is gone (it expired while the replica's loop was busy past its
        TTL; the next write takes a new one) and this caller is the first to
        say so (it writes the replica's records again). A lease still there
        (a write of the same batch named an older one) is kept."""
        if self._lease != lease_id:
            return False
        try:
            gone = await self.etcd.keepalive_once(lease_id) <= 0
        except Exception:  # (etcd unreachable: the write's caller hears that itself)
            return False
        if not gone or self._lease != lease_id:
            return False
        log.warning("the replica's lease expired; its records are written again on a new one")
        self._lease = 0
        return True

    async def keep(self) -> None:
        """Keep the lease alive (a task of the replica's, until cancelled)."""
        while True:
            try:
                if not self._lease:
                    self._lease = await self.etcd.grant(self.ttl_s)
                left = await self.etcd.keepalive_once(self._lease)
                if left <= 0:
                    self._lease = 0
                    continue
            except Exception as exc:
                log.warning("session lease keepalive failed: %s", exc)
            await asyncio.sleep(self.ttl_s / 3)

    async def close(self) -> None:
        if self._lease:
            with contextlib.suppress(Exception):
                await self.etcd.revoke(self._lease)
