"""The coordinator's decisions over etcd: leases, the artifact index, waiters.

etcd layout under the prefix P. KEY below is the scoped key TENANT/KEY (a
validated cache key holds no '/', a tenant name neither), so tenants never
see each other's records:

    P/a/KEY              artifact index entry (JSON ArtifactInfo); write-once
    P/l/KEY              compile lease record (JSON), attached to the holder's etcd lease
                         (one per holder process, shared by its claims: leases.py)
    P/h/KEY              hedge lease record: a second compiler for a holder far past
                         the program's expected compile time, attached to its etcd lease
    P/x/KEY              "compile locally" verdict, attached to a short etcd lease
    P/w/KEY/REPLICA      this replica's waiters of KEY (JSON: how many, the lowest rank,
                         how many of each job), attached to its session lease
    P/k/..., P/n/...     what each key was made of: see records.py

Lease rules (the invariants everything else leans on):
- P/l/KEY is created only by a txn that checks P/l/KEY, P/a/KEY and P/x/KEY are all
  absent, so at most one holder exists per key at any revision.
- The lease's fencing token is the revision that created P/l/KEY. Publish and
  Release are txns that compare P/l/KEY's mod_revision with that token, so a
  holder whose etcd lease expired (and whose record may have been re-created
  for someone else) can never publish.
- Publish writes P/a/KEY and deletes P/l/KEY and P/h/KEY in one txn, after
  the blob is durably in the store; an index entry never points at a missing
  blob. With a hedge, the first valid publish (holder or hedger) wins.
- Waiters are woken by one prefix watch per replica (WatchHub), so a publish
  through any replica wakes waiters on every replica.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from compilecast.blobstore import DiskBlobStore
from compilecast.config import CoordinatorConfig
from compilecast.errors import (
    LeaseError,
    Unavailable,
)
from compilecast.serving import cancel_all
from compilecast.v1 import cache_pb2 as pb

from .artifacts import Artifacts
from .etcd import (
    KV,
    Etcd,
    GuardedBatcher,
    WriteBatcher,
    cmp_absent,
    cmp_mod_revision,
    op_delete,
    op_put,
)
from .farm import Farm
from .keystate import (
    RECORD_KINDS,
    RECORDS,
    KeyState,
    KeyWaiters,
    holder_name,
    lease_owner,
    local_verdict,
)
from .leases import LeasePool
from .metrics import CoordinatorMetrics
from .operations import Operations
from .presence import Presence
from .records import (
    DEFAULT_TENANT,
    KeyRecords,
    json_dict,
    plain,
    read_info,
    scope,
)
from .relay import RelayTrees
from .sweep import IndexSweeper
from .uploads import Uploads
from .waiting import Waiting
from .watch import WatchHub

log = logging.getLogger(__name__)

# Published entries each replica keeps in memory (~0.5 KB each), oldest out first.
INDEX_MAX = 200_000



RELEASED_KEPT = 100_000  # keys whose claim's end is remembered (for waiters)

class CoordinatorState(Artifacts, Waiting, Operations):
    def __init__(
        self,
        cfg: CoordinatorConfig,
        etcd: Etcd,
        store: DiskBlobStore,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.cfg = cfg
        self.etcd = etcd
        self.store = store
        self.presence = Presence(store, metrics.bucket_stalls)
        metrics.bucket_checks_waiting.set_function(lambda: self.presence.waiting)
        self.metrics = metrics
        self.prefix = cfg.etcd_prefix.rstrip("/").encode()
        self.hub = WatchHub(etcd, self.prefix)
        # Published entries are write-once, so a HIT can be answered from
        # memory. The watch reports every entry put (so a waiter woken by a
        # publish on any replica finds it here). An entry leaves only when its
        # blob proves corrupt or missing; the watch reports such deletes (and
        # gaps, after which we forget all).
        self._index: dict[str, tuple[pb.ArtifactInfo, int]] = {}
        self.index_max = INDEX_MAX
        self._index_deleted: dict[str, int] = {}
        self.records = KeyRecords(etcd, self.prefix, metrics)
        self.sweeper = IndexSweeper(etcd, self.prefix, self.presence, self.records, metrics,
                                    record_max_age_s=cfg.key_record_days * 86400,
                                    forget=self._forget_artifact)
        self.farm = Farm(etcd, store, self.prefix, metrics, cfg.lease_ttl_s)
        self.relays = RelayTrees(cfg.relay_fanout, chain_bytes=cfg.relay_chain_bytes)
        self.uploads = Uploads(self.hub.wake)
        # Publishes write on threads of their own, never queued behind readers.
        self._publish_threads = ThreadPoolExecutor(4, thread_name_prefix="publish")
        self.leases = LeasePool(etcd, cfg.lease_ttl_s)
        self.hub.on_artifact.append(self._published)
        self.hub.on_artifact_deleted.append(self._forget_artifact)
        self.hub.on_gap.append(self._index.clear)
        # Keys with a compile lease record, as the watch reports them (in
        # revision order, so no older read can undo a newer event): key -> why
        # to WAIT. A key claimed here is a WAIT for everyone else without an
        # etcd round trip; the view may lag etcd by the watch's delay, and an
        # answer from a stale entry is a WAIT whose Wait re-reads etcd at once.
        self._claimed: dict[str, str | bytes] = {}  # its reason, or the record unread
        # When the watch last saw a claim of a key end (published, released or
        # lapsed): a job's waiter that never saw the claim knows its
        # designated process came and went, and does not sit out the grace.
        self._released: collections.OrderedDict[str, float] = collections.OrderedDict()
        # etcd reads in flight, by key, with the watch's event count at their start.
        self._reads: dict[str, tuple[asyncio.Future, int]] = {}
        self._waiter_writes = WriteBatcher(etcd)  # waiter records, put and deleted together
        # This replica's waiters, by key: one P/w record per key and replica
        # says how many there are (a pod's job start writes a few per key, not
        # two per waiter). Its id names that record.
        self._waiting: dict[str, KeyWaiters] = {}
        self._replica = uuid.uuid4().hex[:16]
        # Writes of those records waiting to start, by key: the changes that
        # arrive meanwhile go with them (done once the write has landed).
        self._waiter_flushes: dict[str, asyncio.Future] = {}
        self._claims = GuardedBatcher(etcd)  # the claims of concurrent misses, together
        self.hub.on_claim.append(self._note_claim)
        self.hub.on_gap.append(self._claimed.clear)
        self.hub.on_gap.append(self._released.clear)
        self._session_lease = 0
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()

    # -- etcd keys -------------------------------------------------------
    def _k(self, kind: str, sk: str) -> bytes:
        """etcd key of a scoped key (tenant/key)."""
        return self.prefix + f"/{kind}/{sk}".encode()

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.hub.run(), name="watch-hub"))
        self._tasks.append(asyncio.create_task(self._session_keeper(), name="session"))
        await self.hub.ready.wait()

    async def stop(self) -> None:
        await cancel_all(self._tasks)  # the session keeper could swallow one cancel
        await self.records.close()
        await self.leases.close()
        self._publish_threads.shutdown(wait=False)
        self.presence.close()
        if self._session_lease:
            with contextlib.suppress(Exception):
                await self.etcd.revoke(self._session_lease)

    async def _session_keeper(self) -> None:
        """Keep this replica's session lease (waiter registrations) alive."""
        ttl = max(self.cfg.lease_ttl_s, 5)
        while True:
            try:
                if not self._session_lease:
                    self._session_lease = await self.etcd.grant(ttl)
                left = await self.etcd.keepalive_once(self._session_lease)
                if left <= 0:
                    self._session_lease = 0
                    continue
            except Exception as exc:
                log.warning("session lease keepalive failed: %s", exc)
            await asyncio.sleep(ttl / 3)

    async def _session(self) -> int:
        if not self._session_lease:
            self._session_lease = await self.etcd.grant(max(self.cfg.lease_ttl_s, 5))
        return self._session_lease

    def _spawn(self, coro) -> None:
        """Run best-effort bookkeeping (revokes, cleanups) in the background."""
        task = asyncio.create_task(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("background task failed: %s", t.exception())

        task.add_done_callback(done)

    # -- the in-memory index of published entries --------------------------
    def _forget_artifact(self, sk: str, revision: int) -> None:
        self._index.pop(sk, None)
        self._index_deleted[sk] = revision

    def _remember_artifact(self, sk: str, info: pb.ArtifactInfo, revision: int) -> None:
        if self._index_deleted.get(sk, 0) < revision:
            if sk not in self._index and len(self._index) >= self.index_max:
                # The oldest remembered entry goes (a HIT on it reads etcd again).
                self._index.pop(next(iter(self._index)))
            self._index[sk] = (info, revision)

    def _published(self, sk: str, value: bytes, revision: int) -> None:
        info = read_info(plain(sk), value)
        if info is None:  # what etcd now holds is not what was remembered
            log.warning("unreadable index entry for %s at revision %d", sk, revision)
            self._forget_artifact(sk, revision)
            return
        self._remember_artifact(sk, info, revision)

    def _cached_artifact(self, sk: str) -> pb.ArtifactInfo | None:
        entry = self._index.get(sk)
        if entry is None:
            return None
        present = self.presence.known(entry[0].digest)  # a stat; the blob may be gone
        if present is None:  # only a bucket request can tell: not on this path
            return None
        if not present:
            self._index.pop(sk, None)
            return None
        return entry[0]

    def _note_claim(self, sk: str, record: bytes | None) -> None:
        if record is None:
            self._claimed.pop(sk, None)
            self._released[sk] = time.monotonic()
            self._released.move_to_end(sk)
            if len(self._released) > RELEASED_KEPT:
                self._released.popitem(last=False)
            return
        # Read when a WAIT first needs it: most claims end before anyone asks
        # (a miss's own claim), and reading each cost the watch ~2 % of the
        # coordinator's CPU at 5,000 decisions a second (BENCHMARKS.md).
        self._claimed[sk] = record

    def _released_lately(self, sk: str, now: float) -> bool:
        """Whether a claim of `sk` ended within the designated grace: its
        designated process came and went (a failed publish, a release), and
        nobody holds it now."""
        ended = self._released.get(sk)
        return ended is not None and now - ended < self.cfg.designated_grace_s

    def _claim_reason(self, sk: str) -> str | None:
        """The WAIT reason for a claim the watch reported, or None (none, or
        a record that is not ours to read: ask etcd)."""
        held = self._claimed.get(sk)
        if not isinstance(held, bytes):
            return held
        try:
            reason = self._claimed[sk] = f"compiled by {holder_name(json.loads(held))}"
        except (ValueError, AttributeError):
            self._claimed.pop(sk, None)
            return None
        return reason

    # -- reads -----------------------------------------------------------
    def _state_keys(self, sk: str) -> list[bytes]:
        return [self._k(kind, sk) for kind in RECORDS]

    async def _read(self, sk: str) -> KeyState:
        return await self._readable_state(sk, await self.etcd.get_many(self._state_keys(sk)))

    async def _readable_state(self, sk: str, kvs: list[KV | None]) -> KeyState:
        """The key's state from its records as read (in RECORDS order), each
        parsed once; one it cannot read is dropped and reads as absent."""
        parsed: list[tuple[KV | None, Any]] = []
        for kind, kv in zip(RECORDS, kvs, strict=True):
            value = None
            if kv is not None:
                value = read_info(plain(sk), kv.value) if kind == "a" else json_dict(kv.value)
                if value is None:
                    await self._drop_unreadable(sk, kind, kv)
            parsed.append((kv, value))
        (a, artifact), (lrec, lease), (_, local), (_, hedge) = parsed
        if artifact is not None:
            self._remember_artifact(sk, artifact, a.mod_revision)
        return KeyState(
            artifact=artifact,
            artifact_rev=a.mod_revision if artifact is not None else 0,
            lease=lease,
            lease_rev=lrec.mod_revision if lease is not None else 0,
            local=local,
            hedge=hedge,
        )

    async def _drop_unreadable(self, sk: str, kind: str, kv: KV) -> None:
        """A record of the key that is not ours to read (an operator's `etcdctl
        put`, a damaged value) is dropped, as long as it is still that one:
        the key then reads as if it were absent (a miss compiles again),
        instead of failing every call for it."""
        log.warning("the %s record of %s cannot be read (damaged, or written by something "
                    "else); dropping it", RECORD_KINDS[kind], sk, extra={"key": sk})
        if kind == "a":
            self._forget_artifact(sk, kv.mod_revision + 1)
        await self.etcd.txn([cmp_mod_revision(self._k(kind, sk), kv.mod_revision)],
                            [op_delete(self._k(kind, sk))])

    async def _read_shared(self, sk: str, *, fresh: bool = False) -> KeyState:
        """_read, shared by concurrent callers on one key (the hosts of a pod
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
            read = asyncio.ensure_future(self._read(sk))
            entry = (read, self.hub.events)
            if sk not in self._reads:  # a fresher read never replaces one in flight
                self._reads[sk] = entry
                read.add_done_callback(lambda _: self._reads.pop(sk, None))
        return await asyncio.shield(entry[0])

    async def _usable_artifact(self, sk: str, st: KeyState) -> pb.ArtifactInfo | None:
        """The artifact if its blob is present; a dangling entry is dropped."""
        if st.artifact is None:
            return None
        present = await self.presence.check(st.artifact.digest)
        if present or present is None:  # (None: a bucket that cannot tell now; the fetch will)
            return st.artifact
        log.warning("index entry %s points at missing blob %s (evicted from a bounded store, "
                    "or deleted); dropping it: the key compiles again",
                    st.artifact.key, st.artifact.digest)
        self._forget_artifact(sk, st.artifact_rev + 1)
        await self.etcd.txn([cmp_mod_revision(self._k("a", sk), st.artifact_rev)],
                            [op_delete(self._k("a", sk))])
        return None

    def _etcd_down(self, exc: Unavailable) -> str:
        """A decision that etcd's absence turns into compile-locally: counted
        (the alert's metric) and explained."""
        self.metrics.etcd_unavailable.inc()
        return f"coordinator: {exc}"

    def _hit(self, *infos: pb.ArtifactInfo) -> None:
        """Count the compile time that hits on `infos` saved (one increment)."""
        saved = sum(max(info.compile_time_seconds, 0.0) for info in infos)
        if saved:
            self.metrics.compile_seconds_saved.inc(saved)

    # -- the lease -------------------------------------------------------
    def _claim(self, lease_id: int, req: pb.Requester, program: str) -> bytes:
        return json.dumps(
            {"lease": lease_id, "job": req.job, "process": req.process_id,
             "client": req.client, "granted": time.time(), "program": program}
        ).encode()

    async def _try_take(self, sk: str, req: pb.Requester, program: str = "", *,
                        hedge_of: int = 0) -> pb.Lease | None:
        """Create the lease record (P/l), or with hedge_of the hedge record
        (P/h) next to a holder whose record still has revision hedge_of."""
        if not hedge_of:
            return (await self._take_or_read(sk, req, program))[0]
        compare = [cmp_mod_revision(self._k("l", sk), hedge_of),
                   cmp_absent(self._k("h", sk)), cmp_absent(self._k("a", sk))]
        return (await self._claim_txn(sk, "h", compare, [self._k("h", sk)], req, program))[0]

    async def _take_or_read(self, sk: str, req: pb.Requester,
                            program: str) -> tuple[pb.Lease | None, KeyState | None]:
        """Claim a free key in one round trip: the txn creates the lease
        record when nothing (artifact, claim, hedge, local verdict) exists,
        and otherwise reads what does. Returns (lease, None) or (None, state)."""
        keys = self._state_keys(sk)
        lease, kvs = await self._claim_txn(sk, "l", [cmp_absent(k) for k in keys], keys,
                                           req, program)
        return (lease, None) if lease is not None else (None, await self._readable_state(sk, kvs))

    async def _claim_txn(self, sk: str, kind: str, compare: list, read: list[bytes],
                         req: pb.Requester, program: str
                         ) -> tuple[pb.Lease | None, list[KV | None]]:
        """Put the claim record P/kind on a pooled lease if `compare` holds,
        else read `read` (which includes P/kind) in the same txn. A retried
        txn whose first attempt landed (the reply was lost with an etcd
        member) fails its compares on our own record: that is a success."""
        lease_id, granted_at = await self.leases.take(lease_owner(sk, req))
        record = self._k(kind, sk)
        ok, rev, kvs = await self._claims.txn(
            compare, [op_put(record, self._claim(lease_id, req, program), lease=lease_id)], read)

        def held(revision: int) -> pb.Lease:
            return pb.Lease(id=lease_id, ttl_seconds=self.leases.ttl_left(granted_at),
                            revision=revision,
                            takes_digest_last=self._takes_digest_last())

        if ok:
            return held(rev), []
        mine = kvs[read.index(record)]
        if mine is not None and (json_dict(mine.value) or {}).get("lease") == lease_id:
            return held(mine.mod_revision), kvs
        self.leases.give_back((lease_id, granted_at))
        return None, kvs

    def _takes_digest_last(self) -> bool:
        """Whether holders may send the digest after the bytes: not when the
        waiters read an upload as it arrives (they are told its digest)."""
        return self.cfg.publish_stream_readers == 0

    async def _check_holder(self, sk: str, lease: pb.Lease,
                            requester: pb.Requester | None = None) -> str:
        """Which record ("l": the lease, "h": a hedge) `lease` holds; raises
        LeaseError when it holds neither."""
        key = plain(sk)
        recs = await self.etcd.get_many([self._k("l", sk), self._k("h", sk)])
        if recs[0] is None and recs[1] is None:
            raise LeaseError(f"no compile lease is held for key {key} (expired or never taken)")
        for kind, rec in zip(("l", "h"), recs, strict=True):
            if rec is None:
                continue
            holder = json.loads(rec.value)
            if holder.get("lease") == lease.id and rec.mod_revision == lease.revision:
                if requester is not None and requester.job != holder.get("job", ""):
                    raise LeaseError(f"the compile lease for key {key} belongs to another job")
                return kind
        raise LeaseError(f"the compile lease for key {key} is held by someone else")

    # -- Acquire ---------------------------------------------------------
    async def acquire(self, key: str, req: pb.Requester,
                      components: dict[str, str] | None = None,
                      program_name: str = "", *, tenant: str = DEFAULT_TENANT,
                      may_publish: bool = True) -> pb.AcquireResponse:
        # The caller has checked the request (validate.acquire_request): the
        # service does, once per request, before any of a batch is decided.
        sk = scope(tenant, key)
        if (resp := self._known(sk)) is not None:
            if resp.decision == pb.HIT:
                self._hit(resp.artifact)
        else:
            start = time.perf_counter()
            try:
                resp = await self._decide(sk, req, may_publish, program_name)
            except Unavailable as exc:
                resp = pb.AcquireResponse(decision=pb.COMPILE_LOCALLY,
                                          reason=self._etcd_down(exc))
            self.metrics.observe_etcd_decision(resp.decision, time.perf_counter() - start)
        self.metrics.count_decision(resp.decision)
        if resp.decision == pb.COMPILE and components:
            self.records.record(sk, program_name, dict(components))
        return resp

    def decided_now(self, keys: Sequence[str], *, tenant: str = DEFAULT_TENANT,
                    partial: bool = False) -> list[pb.AcquireResponse | None] | None:
        """What acquire would answer for every key of a checked batch, when
        this replica knows it without etcd and without awaiting anything
        (a HIT from the index, a WAIT on a claim the watch reported). None
        when any key needs more (acquire decides the whole batch then); with
        `partial`, None in place of each key that needs more, and None only
        when no key is known. The answers given are counted."""
        answers = []
        for key in keys:
            known = self._known(scope(tenant, key))
            if known is None and not partial:
                return None
            answers.append(known)
        if all(a is None for a in answers):
            return None
        known = [r for r in answers if r is not None]
        self._hit(*(r.artifact for r in known if r.decision == pb.HIT))
        # counted once per decision, not once per key
        for decision, n in collections.Counter(r.decision for r in known).items():
            self.metrics.count_decision(decision, n)
        return answers

    def _known(self, sk: str) -> pb.AcquireResponse | None:
        cached = self._cached_artifact(sk)
        if cached is not None:
            return pb.AcquireResponse(decision=pb.HIT, artifact=cached)
        held = self._claim_reason(sk)
        if held is not None:  # someone compiles it: what etcd would say, without asking
            return pb.AcquireResponse(decision=pb.WAIT, reason=held)
        return None

    async def _decide(self, sk: str, req: pb.Requester, may_publish: bool, program: str) -> pb.AcquireResponse:
        """What etcd says of a key this replica does not know (_known is None)."""
        # A process that may claim the key tries to at once; the others read.
        claims = may_publish and (not req.job or req.process_id == req.designated_process)
        for _ in range(3):
            if claims:
                lease, st = await self._take_or_read(sk, req, program)
                if lease is not None:
                    return self._granted(sk, req, lease)
            else:
                st = await self._read_shared(sk)
            info = await self._usable_artifact(sk, st)
            if info is not None:
                self._hit(info)
                return pb.AcquireResponse(decision=pb.HIT, artifact=info)
            if st.local:
                return pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, **local_verdict(st.local))
            if st.lease or st.hedge:
                return pb.AcquireResponse(decision=pb.WAIT,
                                          reason=f"compiled by {holder_name(st.lease or st.hedge)}")
            if req.job and req.process_id != req.designated_process:
                return pb.AcquireResponse(
                    decision=pb.WAIT,
                    reason=f"process {req.designated_process} of job {req.job} compiles",
                )
            if not may_publish:
                return pb.AcquireResponse(decision=pb.COMPILE_LOCALLY,
                                          reason="this identity may not publish; compile locally")
        return pb.AcquireResponse(decision=pb.WAIT, reason="contended; wait")

    def _granted(self, sk: str, req: pb.Requester, lease: pb.Lease) -> pb.AcquireResponse:
        self.metrics.compiles.labels("first").inc()
        log.info("compile lease for %s to %s", sk, req.client or req.job,
                 extra={"key": sk, "job": req.job, "process_id": req.process_id})
        return pb.AcquireResponse(decision=pb.COMPILE, lease=lease)
