"""A replica's view of the keys: where each record lives in etcd, the
published entries it remembers, the claims the watch reported, and the reads
of a key's records, shared by the decisions, the waits, the publishes and the
operations built on it.

etcd layout under the prefix P (KEY is the scoped key TENANT/KEY): see
coordinator/state.py's opening.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from compilecast.errors import Unavailable
from compilecast.v1 import cache_pb2 as pb

from .etcd import KV, EtcdClient, cmp_mod_revision, op_delete
from .keystate import RECORD_KINDS, RECORDS, KeyState, holder_name
from .leases import LeasePool, Session
from .presence import Presence
from .records import KeyRecords, json_dict, plain, read_info, scope
from .watch import WatchHub

log = logging.getLogger("compilecast.coordinator.state")

# Published entries each replica keeps in memory (~0.5 KB each), oldest out first.
INDEX_MAX = 200_000
RELEASED_KEPT = 100_000  # keys whose claim's end is remembered (for waiters)


@dataclass(frozen=True)
class ViewSettings:
    designated_grace_s: float = 10.0  # a job's waiter that never saw the claim waits this long


class ViewMetrics(Protocol):
    """What the key view records (CoordinatorMetrics is one)."""

    @property
    def etcd_unavailable(self) -> Any: ...

    def saved(self, tenant: str, seconds: float) -> None: ...


class KeyView:
    """What this replica knows of each key, and how it reads what it does not."""

    def __init__(self, settings: ViewSettings, etcd: EtcdClient, hub: WatchHub, presence: Presence,
                 metrics: ViewMetrics) -> None:
        self.settings = settings
        self.etcd = etcd
        self.hub = hub
        self.presence = presence
        self.metrics = metrics
        self.prefix = hub.prefix
        # Published entries are write-once, so a HIT can be answered from
        # memory. The watch reports every entry put (so a waiter woken by a
        # publish on any replica finds it here). An entry leaves only when its
        # blob proves corrupt or missing; the watch reports such deletes (and
        # gaps, after which we forget all).
        self.index: dict[str, tuple[pb.ArtifactInfo, int]] = {}
        self.index_max = INDEX_MAX
        self._index_deleted: dict[str, int] = {}
        # Keys with a compile lease record, as the watch reports them (in
        # revision order, so no older read can undo a newer event): key -> why
        # to WAIT. A key claimed here is a WAIT for everyone else without an
        # etcd round trip; the view may lag etcd by the watch's delay, and an
        # answer from a stale entry is a WAIT whose Wait re-reads etcd at once.
        self.claimed: dict[str, str | bytes] = {}  # its reason, or the record unread
        # When the watch last saw a claim of a key end (published, released or
        # lapsed): a job's waiter that never saw the claim knows its
        # designated process came and went, and does not sit out the grace.
        self._released: collections.OrderedDict[str, float] = collections.OrderedDict()
        # etcd reads in flight, by key, with the watch's event count at their start.
        self._reads: dict[str, tuple[asyncio.Future[KeyState], int]] = {}
        hub.on_artifact.append(self.published)
        hub.on_artifact_deleted.append(self.forget_artifact)
        hub.on_claim.append(self.note_claim)
        hub.on_gap.append(self.index.clear)
        hub.on_gap.append(self.claimed.clear)
        hub.on_gap.append(self._released.clear)

    # -- etcd keys -------------------------------------------------------
    def k(self, kind: str, sk: str) -> bytes:
        """etcd key of a scoped key (tenant/key)."""
        return self.prefix + f"/{kind}/{sk}".encode()

    def revocation(self, tenant: str, digest: str) -> bytes:
        """P/v/TENANT/DIGEST: the tenant revoked these bytes."""
        return self.k("v", scope(tenant, digest))

    def state_keys(self, sk: str) -> list[bytes]:
        return [self.k(kind, sk) for kind in RECORDS]

    # -- the in-memory index of published entries --------------------------
    def forget_artifact(self, sk: str, revision: int) -> None:
        self.index.pop(sk, None)
        self._index_deleted[sk] = revision

    def remember_artifact(self, sk: str, info: pb.ArtifactInfo, revision: int) -> None:
        if self._index_deleted.get(sk, 0) < revision:
            if sk not in self.index and len(self.index) >= self.index_max:
                # The oldest remembered entry goes (a HIT on it reads etcd again).
                self.index.pop(next(iter(self.index)))
            self.index[sk] = (info, revision)

    def published(self, sk: str, value: bytes, revision: int) -> None:
        info = read_info(plain(sk), value)
        if info is None:  # what etcd now holds is not what was remembered
            log.warning("unreadable index entry for %s at revision %d", sk, revision)
            self.forget_artifact(sk, revision)
            return
        self.remember_artifact(sk, info, revision)

    def cached_artifact(self, sk: str) -> pb.ArtifactInfo | None:
        entry = self.index.get(sk)
        if entry is None:
            return None
        present = self.presence.known(entry[0].digest)  # a stat; the blob may be gone
        if present is None:  # only a bucket request can tell: not on this path
            return None
        if not present:
            self.index.pop(sk, None)
            return None
        return entry[0]

    # -- claims the watch reported ---------------------------------------
    def note_claim(self, sk: str, record: bytes | None) -> None:
        if record is None:
            self.claimed.pop(sk, None)
            self._released[sk] = time.monotonic()
            self._released.move_to_end(sk)
            if len(self._released) > RELEASED_KEPT:
                self._released.popitem(last=False)
            return
        # Read when a WAIT first needs it: most claims end before anyone asks
        # (a miss's own claim), and reading each cost the watch ~2 % of the
        # coordinator's CPU at 5,000 decisions a second (BENCHMARKS.md).
        self.claimed[sk] = record

    def released_lately(self, sk: str, now: float) -> bool:
        """Whether a claim of `sk` ended within the designated grace: its
        designated process came and went (a failed publish, a release), and
        nobody holds it now."""
        ended = self._released.get(sk)
        return ended is not None and now - ended < self.settings.designated_grace_s

    def claim_reason(self, sk: str) -> str | None:
        """The WAIT reason for a claim the watch reported, or None (none, or
        a record that is not ours to read: ask etcd)."""
        held = self.claimed.get(sk)
        if not isinstance(held, bytes):
            return held
        try:
            reason = self.claimed[sk] = f"compiled by {holder_name(json.loads(held))}"
        except (ValueError, AttributeError):
            self.claimed.pop(sk, None)
            return None
        return reason

    # -- reads -----------------------------------------------------------
    async def read(self, sk: str) -> KeyState:
        return await self.readable_state(sk, await self.etcd.get_many(self.state_keys(sk)))

    async def readable_state(self, sk: str, kvs: list[KV | None]) -> KeyState:
        """The key's state from its records as read (in RECORDS order), each
        parsed once; one it cannot read is dropped and reads as absent."""
        parsed: list[tuple[KV | None, Any]] = []
        for kind, kv in zip(RECORDS, kvs, strict=True):
            value = None
            if kv is not None:
                value = read_info(plain(sk), kv.value) if kind == "a" else json_dict(kv.value)
                if value is None:
                    await self.drop_unreadable(sk, kind, kv)
            parsed.append((kv, value))
        (a, artifact), (lrec, lease), (_, local), (_, hedge) = parsed
        artifact_rev = a.mod_revision if a is not None and artifact is not None else 0
        if artifact is not None:
            self.remember_artifact(sk, artifact, artifact_rev)
        return KeyState(
            artifact=artifact,
            artifact_rev=artifact_rev,
            lease=lease,
            lease_rev=lrec.mod_revision if lrec is not None and lease is not None else 0,
            local=local,
            hedge=hedge,
        )

    async def drop_unreadable(self, sk: str, kind: str, kv: KV) -> None:
        """A record of the key that is not ours to read (an operator's `etcdctl
        put`, a damaged value) is dropped, as long as it is still that one:
        the key then reads as if it were absent (a miss compiles again),
        instead of failing every call for it."""
        log.warning("the %s record of %s cannot be read (damaged, or written by something "
                    "else); dropping it", RECORD_KINDS[kind], sk, extra={"key": sk})
        if kind == "a":
            self.forget_artifact(sk, kv.mod_revision + 1)
        await self.etcd.txn([cmp_mod_revision(self.k(kind, sk), kv.mod_revision)],
                            [op_delete(self.k(kind, sk))])

    async def read_shared(self, sk: str, *, fresh: bool = False) -> KeyState:
        """`read`, shared by concurrent callers on one key (the hosts of a pod
        asking for the same program at once): one etcd read for all of them.

        For Acquire (fresh=False) any read in flight will do. Its answer may
        predate a request by the read's few milliseconds, which can only turn
        a HIT or COMPILE_LOCALLY into a WAIT whose Wait reads again, or a WAIT
        into COMPILE_LOCALLY for an identity that may not publish.
        For Wait (fresh=True) the read must not miss an event its cleared
        subscription would have seen: it joins a read in flight only if the
        watch has delivered no event at all since that read started.
        """
        entry = self._reads.get(sk)
        if entry is None or (fresh and entry[1] != self.hub.events):
            read = asyncio.ensure_future(self.read(sk))
            entry = (read, self.hub.events)
            if sk not in self._reads:  # a fresher read never replaces one in flight
                self._reads[sk] = entry
                read.add_done_callback(lambda _: self._reads.pop(sk, None))
        return await asyncio.shield(entry[0])

    async def usable_artifact(self, sk: str, st: KeyState) -> pb.ArtifactInfo | None:
        """The artifact if its blob is present; a dangling entry is dropped."""
        if st.artifact is None:
            return None
        present = await self.presence.check(st.artifact.digest)
        if present or present is None:  # (None: a bucket that cannot tell now; the fetch will)
            return st.artifact
        log.warning("index entry %s points at missing blob %s (evicted from a bounded store, "
                    "or deleted); dropping it: the key compiles again",
                    st.artifact.key, st.artifact.digest)
        self.forget_artifact(sk, st.artifact_rev + 1)
        await self.etcd.txn([cmp_mod_revision(self.k("a", sk), st.artifact_rev)],
                            [op_delete(self.k("a", sk))])
        return None

    # -- what decisions count --------------------------------------------
    def etcd_down(self, exc: Unavailable) -> str:
        """A decision that etcd's absence turns into compile-locally: counted
        (the alert's metric) and explained."""
        self.metrics.etcd_unavailable.inc()
        return f"coordinator: {exc}"

    def hit(self, tenant: str, *infos: pb.ArtifactInfo) -> None:
        """Count the compile time that `tenant`'s hits on `infos` saved (one
        increment)."""
        saved = sum(max(info.compile_time_seconds, 0.0) for info in infos)
        if saved:
            self.metrics.saved(tenant, saved)


@dataclass(frozen=True)
class Keyspace:
    """The keys as the components that read and write them work over them:
    etcd (`etcd`), this replica's view of it (`view`), the key records
    (`records`), and the etcd leases: the claims' (`leases`) and this
    replica's own (`session`)."""

    etcd: EtcdClient
    view: KeyView
    records: KeyRecords
    leases: LeasePool
    session: Session
