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
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from compilecast import validate
from compilecast.blobstore import DiskBlobStore, Inflate, amake_room, aread
from compilecast.config import CoordinatorConfig
from compilecast.errors import (
    AlreadyPublished,
    CorruptBlob,
    InvalidRequest,
    LeaseError,
    NotFound,
    Revoked,
    StoreFull,
    Unavailable,
)
from compilecast.serving import cancel_all
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk

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
    _KINDS,
    _RECORDS,
    KeyState,
    _holder_name,
    _lease_owner,
    _lowest_rank,
    _reason,
    _verdict,
    _Waiters,
)
from .leases import LeasePool
from .metrics import CoordinatorMetrics
from .operations import Operations
from .records import (
    DEFAULT_TENANT,
    KeyRecords,
    info_from,
    info_json,
    json_dict,
    plain,
    read_info,
    scope,
    tenant_of,
)
from .relay import RelayTrees
from .sweep import IndexSweeper
from .uploads import Uploads
from .uploads import stream as stream_upload
from .watch import WatchHub

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
# Published entries each replica keeps in memory (~0.5 KB each), oldest out first.
INDEX_MAX = 200_000
PROMOTION_STAGGER_S = 0.5
# How long a change of a replica's waiters of a key waits to be written with
# the changes after it (a pod's job start brings a thousand in a few tenths).
WAITER_FLUSH_S = 0.02



RELEASED_KEPT = 100_000  # keys whose claim's end is remembered (for waiters)

def _in_flight(key: str, header: pb.PublishHeader) -> pb.ArtifactInfo:
    """What fetchers of an upload in progress are told about it."""
    return pb.ArtifactInfo(key=key, digest=header.digest, size=header.size,
                           compile_time_seconds=header.compile_time_seconds)

def _store_zstd(writer, inflate: Inflate, stream) -> None:
    """Store a publish sent as zstd as it came, its decoded bytes verified
    (a stream that does not decode, or decodes past the declared size, is
    the publisher's error)."""
    writer.write_zstd(stream)
    try:
        inflate.feed(stream)
    except CorruptBlob as exc:
        raise InvalidRequest(f"zstd_data: {exc}") from None


class CoordinatorState(Operations):
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
        self.sweeper = IndexSweeper(etcd, self.prefix, store, self.records, metrics,
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
        self._waiting: dict[str, _Waiters] = {}
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
        if not self.store.has(entry[0].digest):  # a stat; the blob may be gone
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
            reason = self._claimed[sk] = f"compiled by {_holder_name(json.loads(held))}"
        except (ValueError, AttributeError):
            self._claimed.pop(sk, None)
            return None
        return reason

    # -- reads -----------------------------------------------------------
    def _state_keys(self, sk: str) -> list[bytes]:
        return [self._k(kind, sk) for kind in _RECORDS]

    async def _read(self, sk: str) -> KeyState:
        return await self._readable_state(sk, await self.etcd.get_many(self._state_keys(sk)))

    async def _readable_state(self, sk: str, kvs: list[KV | None]) -> KeyState:
        """The key's state from its records as read (in _RECORDS order), each
        parsed once; one it cannot read is dropped and reads as absent."""
        parsed: list[tuple[KV | None, Any]] = []
        for kind, kv in zip(_RECORDS, kvs, strict=True):
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
                    "else); dropping it", _KINDS[kind], sk, extra={"key": sk})
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
        if self.store.has(st.artifact.digest):  # one stat: cheaper than a thread hop
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
        lease_id, granted_at = await self.leases.take(_lease_owner(sk, req))
        record = self._k(kind, sk)
        ok, rev, kvs = await self._claims.txn(
            compare, [op_put(record, self._claim(lease_id, req, program), lease=lease_id)], read)

        def held(revision: int) -> pb.Lease:
            return pb.Lease(id=lease_id, ttl_seconds=self.leases.ttl_left(granted_at),
                            revision=revision, accepts_zstd=True,
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
                return pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, **_verdict(st.local))
            if st.lease or st.hedge:
                return pb.AcquireResponse(decision=pb.WAIT,
                                          reason=f"compiled by {_holder_name(st.lease or st.hedge)}")
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

    # -- Wait ------------------------------------------------------------
    def wait_timeout_s(self, key: str, req: pb.Requester, timeout_ms: int) -> float:
        """How long a wait with these arguments lasts; InvalidRequest when
        they cannot be waited with."""
        validate.key(key)
        validate.requester(req)
        if timeout_ms < 0:
            raise InvalidRequest("timeout_ms must be >= 0")
        return (timeout_ms or self.cfg.share_binary_between_hosts_timeout_ms) / 1000.0

    async def wait(self, key: str, req: pb.Requester, timeout_ms: int, *,
                   tenant: str = DEFAULT_TENANT, may_publish: bool = True) -> AsyncIterator[pb.WaitEvent]:
        timeout = self.wait_timeout_s(key, req, timeout_ms)
        start = time.monotonic()
        deadline = start + timeout
        rank = f"{req.process_id:010d}" if req.job else f"9{time.time_ns():019d}"
        sk = scope(tenant, key)
        sub = self.hub.subscribe(sk)
        self.metrics.waiters.inc()
        outcome = "compile_locally"
        registered = False
        try:
            cached = self._cached_artifact(sk)
            if cached is not None:  # published already: no registration, no read
                self._hit(cached)
                outcome = "hit"
                yield pb.WaitEvent(decision=pb.HIT, artifact=cached)
                return
            registered = True  # counted here from now on: no longer at the end
            self._waiting.setdefault(sk, _Waiters()).add(rank, req.job)
            try:
                await self._write_waiters(sk)
            except Unavailable as exc:
                yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=self._etcd_down(exc))
                return
            seen_holder = False
            announced = None
            expected: list[float | None] = []  # looked up once, when first needed
            free_since: float | None = None
            while True:
                sub.clear()
                try:
                    # Woken by a publish: the watch has put the entry in memory.
                    info = self._cached_artifact(sk)
                    st = await self._read_shared(sk, fresh=True) if info is None else None
                    info = info or await self._usable_artifact(sk, st)
                    if info is not None:
                        self._hit(info)
                        outcome = "hit"
                        yield pb.WaitEvent(decision=pb.HIT, artifact=info)
                        return
                    if st.local:
                        yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY, **_verdict(st.local))
                        return
                    upload = self.uploads.get(sk) if self.cfg.publish_stream_readers else None
                    if upload is not None and upload is not announced:
                        announced = upload  # once per upload: fetching it streams it
                        yield pb.WaitEvent(decision=pb.WAIT, artifact=upload.info,
                                           reason="publishing: a fetch streams the bytes "
                                                  "as they upload")
                    now = time.monotonic()
                    if st.lease or st.hedge:
                        seen_holder, free_since = True, None
                        lease = await self._maybe_hedge(sk, rank, req, st, may_publish,
                                                        expected)
                        if lease is not None:
                            outcome = "hedged"
                            yield pb.WaitEvent(decision=pb.COMPILE, lease=lease,
                                               reason="the holder is far past the expected "
                                                      "compile time: compile too; the first "
                                                      "publish wins")
                            return
                    elif may_publish and (not req.job or seen_holder or req.process_id == req.designated_process
                          or now - start >= self.cfg.designated_grace_s
                          or self._released_lately(sk, now)):
                        free_since = free_since or now
                        position = await self._waiter_position(sk, rank)
                        if now - free_since >= PROMOTION_STAGGER_S * position:
                            lease = await self._try_take(sk, req)
                            if lease is not None:
                                outcome = "promoted"
                                self.metrics.compiles.labels("promoted").inc()
                                log.info("promoted %s to compile %s", req.client or req.job, key,
                                         extra={"key": sk, "job": req.job,
                                                "process_id": req.process_id})
                                yield pb.WaitEvent(decision=pb.COMPILE, lease=lease)
                                return
                            continue
                except Unavailable as exc:
                    yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=self._etcd_down(exc))
                    return
                now = time.monotonic()
                if now >= deadline:
                    outcome = "timeout"
                    yield pb.WaitEvent(
                        decision=pb.COMPILE_LOCALLY,
                        reason=f"share-binary timeout of {timeout:.1f}s passed; compile locally",
                    )
                    return
                nap = min(deadline - now, HEARTBEAT_S)
                if free_since is not None:
                    nap = min(nap, PROMOTION_STAGGER_S)
                if not await sub.wait(nap):
                    yield pb.WaitEvent(decision=pb.WAIT, reason="still compiling")
        finally:
            self.hub.unsubscribe(sk, sub)
            self.metrics.waiters.dec()
            self.metrics.waits.labels(outcome).inc()
            self.metrics.wait_seconds.observe(time.monotonic() - start)
            if registered:
                here = self._waiting[sk]
                here.remove(rank, req.job)
                if not here.count:
                    del self._waiting[sk]
                self._spawn(self._forget(sk))

    async def _maybe_hedge(self, sk: str, rank: str, req: pb.Requester, st: KeyState,
                           may_publish: bool, expected: list[float | None]) -> pb.Lease | None:
        """Hedge a holder that runs far past the program's expected compile
        time: the lowest waiter gets a hedge lease (P/h) and compiles too."""
        factor = self.cfg.hedge_factor
        if factor <= 0 or not may_publish or st.lease is None or st.hedge is not None:
            return None
        if not expected:
            expected.append(await self.records.expected_compile_s(tenant_of(sk),
                                                           st.lease.get("program", "")))
        if expected[0] is None:
            return None  # never seen this program compile: nothing to compare with
        age = time.time() - st.lease.get("granted", time.time())
        if age < max(self.cfg.hedge_min_s, factor * expected[0]):
            return None
        if await self._waiter_position(sk, rank) != 0:
            return None
        lease = await self._try_take(sk, req, st.lease.get("program", ""),
                                     hedge_of=st.lease_rev)
        if lease is not None:
            self.metrics.compiles.labels("hedge").inc()
            log.warning("hedging %s: holder %s compiles for %.0fs, expected %.0fs", sk,
                        _holder_name(st.lease), age, expected[0])
        return lease

    def _waiters_key(self, sk: str) -> bytes:
        return self._k("w", sk) + f"/{self._replica}".encode()

    def _write_waiters(self, sk: str) -> asyncio.Future:
        """Write this replica's P/w record of `sk` as its waiters will be in
        WAITER_FLUSH_S (deleted when none are left); done once written (or
        failed with Unavailable). The changes that arrive before that write
        starts go with it: a thousand waiters arriving (or leaving) together
        cost a few writes, not two each."""
        flush = self._waiter_flushes.get(sk)
        if flush is None:
            flush = self._waiter_flushes[sk] = asyncio.get_running_loop().create_future()
            self._spawn(self._flush_waiters(sk, flush))
        return asyncio.shield(flush)  # one waiter cancelled does not cancel it for all

    async def _flush_waiters(self, sk: str, flush: asyncio.Future) -> None:
        try:
            await asyncio.sleep(WAITER_FLUSH_S)
            lease = await self._session()
            if self._waiter_flushes.get(sk) is flush:  # later changes make a write of their own
                del self._waiter_flushes[sk]
            here = self._waiting.get(sk)
            if here is None:
                await self._waiter_writes.delete(self._waiters_key(sk), written_before=True)
            else:
                await self._waiter_writes.put(self._waiters_key(sk), here.record(), lease=lease)
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

    async def _forget(self, sk: str) -> None:
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
        for kv in await self.etcd.get_prefix(self._k("w", sk) + b"/"):
            if kv.key != mine and (lowest := _lowest_rank(kv)) is not None and lowest < rank:
                position += 1
        return position

    # -- Publish ---------------------------------------------------------
    async def publish(self, header: pb.PublishHeader, chunks: AsyncIterator[DataChunk], *,
                      tenant: str = DEFAULT_TENANT) -> pb.ArtifactInfo:
        key = self._checked_header(header)
        with self._counting_refusals(key):
            return await self._publish(scope(tenant, key), header, chunks)

    async def check_publish(self, header: pb.PublishHeader, *,
                            tenant: str = DEFAULT_TENANT) -> None:
        """Raise what a Publish with this header would be refused with before
        its first byte (a bad header, a lease not held, a key published or a
        digest purged); the upload's publish checks it all again."""
        key = self._checked_header(header)
        with self._counting_refusals(key):
            await self._may_publish(scope(tenant, key), header)

    @contextlib.contextmanager
    def _counting_refusals(self, key: str) -> Iterator[None]:
        """Count a publish that fails in the block by its exception (and log
        a full store)."""
        try:
            yield
        except Exception as exc:
            self.metrics.publishes.labels(type(exc).__name__).inc()
            if isinstance(exc, StoreFull):
                log.error("refused the publish of %s: %s", key, exc, extra={"key": key})
            raise

    def _checked_header(self, header: pb.PublishHeader) -> str:
        key = validate.publish_header(header, self.cfg.max_artifact_bytes)
        if header.HasField("recipe"):
            validate.recipe(header.recipe, need_target=False)
        return key

    async def _may_publish(self, sk: str, header: pb.PublishHeader) -> str:
        """Which record the header's lease holds (see _check_holder), once
        the key is not published and a digest sent first is not purged."""
        kind = await self._check_holder(sk, header.lease, header.requester)
        reads = [self._k("a", sk)]
        if header.digest:  # else sent last: checked against revocations once known
            reads.append(self._revocation(tenant_of(sk), header.digest))
        entry, *revoked = await self.etcd.get_many(reads)
        if entry is not None:
            raise AlreadyPublished(f"key {plain(sk)} is already published")
        if revoked and revoked[0] is not None:
            raise await self._refuse_revoked(sk, kind, header, revoked[0], "was purged")
        return kind

    async def _publish(self, sk: str, header: pb.PublishHeader,
                       chunks: AsyncIterator[DataChunk]) -> pb.ArtifactInfo:
        key = plain(sk)
        later = not header.digest  # sent last: checked against revocations once known
        kind = await self._may_publish(sk, header)
        if not await amake_room(self.store, header.size):
            raise StoreFull(f"the artifact store has no room for {header.size} bytes, even "
                            "after evicting what it could (its volume is full)")
        writer = self.store.writer()
        loop = asyncio.get_running_loop()
        received = self.metrics.bytes.labels("in")
        inflate: Inflate | None = None
        with writer, self.uploads.track(sk, _in_flight(key, header), writer) as upload:
            async for chunk in chunks:
                received.inc(chunk.size)
                if chunk.zstd_data:
                    if inflate is None:
                        if writer.size:
                            raise InvalidRequest("a Publish sends data or zstd_data, not both")
                        inflate = Inflate(writer.write, header.size)
                    await loop.run_in_executor(self._publish_threads, _store_zstd, writer,
                                               inflate, chunk.zstd_data)
                    continue
                data = chunk.data
                if inflate is not None and data:
                    raise InvalidRequest("a Publish sends data or zstd_data, not both")
                if writer.size + len(data) > header.size:
                    raise InvalidRequest(f"received more than the declared {header.size} bytes")
                await loop.run_in_executor(self._publish_threads, writer.write, data)
                upload.advance()  # fetchers of the upload may read this far
            if later:  # the digest the last message carried: never a purged one's bytes
                revoked, = await self.etcd.get_many([self._revocation(tenant_of(sk),
                                                                      header.digest)])
                if revoked is not None:
                    raise await self._refuse_revoked(sk, kind, header, revoked, "was purged")
            await loop.run_in_executor(self._publish_threads, writer.commit, header.digest,
                                       header.size)
            upload.finish(ok=True)
            return await self._announce(sk, kind, header)

    async def _announce(self, sk: str, kind: str, header: pb.PublishHeader) -> pb.ArtifactInfo:
        """Index a committed blob in etcd under the key, if the lease still holds."""
        key = plain(sk)
        revocation = self._revocation(tenant_of(sk), header.digest)
        recipe = None
        if header.HasField("recipe"):  # stored before the index entry that names it
            recipe = pb.Recipe()
            recipe.CopyFrom(header.recipe)
            recipe.key = key
            if not recipe.job:
                recipe.job = header.requester.job
        info = pb.ArtifactInfo(key=key, digest=header.digest, size=header.size,
                               compile_time_seconds=header.compile_time_seconds,
                               created_unix=time.time(),
                               recipe_digest=await self.farm.store_recipe(recipe) if recipe else "")
        ok, revision, _ = await self.etcd.txn(
            [cmp_mod_revision(self._k(kind, sk), header.lease.revision),
             cmp_absent(self._k("a", sk)), cmp_absent(revocation)],
            # The first valid publish wins; it ends the lease and any hedge.
            [op_put(self._k("a", sk), info_json(info)), op_delete(self._k("l", sk)),
             op_delete(self._k("h", sk))],
        )
        if not ok:
            # A retried txn (the first attempt's reply lost with an etcd member)
            # fails its compares after succeeding: the entry is then ours.
            entry, revoked = await self.etcd.get_many([self._k("a", sk), revocation])
            if revoked is not None and entry is None:
                raise await self._refuse_revoked(sk, kind, header, revoked,
                                                 "was purged while it was being published")
            if entry is None or json.loads(entry.value).get("digest") != header.digest:
                raise LeaseError(f"the compile lease for key {key} was lost before the "
                                 "publish completed (expired or taken over)")
            info = info_from(key, entry.value)
            revision = entry.mod_revision
        self._remember_artifact(sk, info, revision)
        if recipe is not None and info.recipe_digest:
            await self.farm.record(tenant_of(sk), recipe, info.recipe_digest)
        self.metrics.publishes.labels("ok").inc()
        log.info("published %s digest=%s size=%d compile_time=%.2fs", key, header.digest,
                 header.size, header.compile_time_seconds,
                 extra={"key": sk, "job": header.requester.job,
                        "process_id": header.requester.process_id})
        return info

    # -- Release ---------------------------------------------------------
    async def release(self, key: str, lease: pb.Lease, reason: int, detail: str, *,
                      tenant: str = DEFAULT_TENANT) -> None:
        validate.key(key)
        validate.lease(lease)
        if reason not in pb.ReleaseReason.values() or reason == pb.RELEASE_REASON_UNSPECIFIED:
            raise InvalidRequest("reason must be COMPILE_FAILED, BELOW_THRESHOLD, ABANDONED or "
                                 "PUBLISH_REFUSED")
        sk = scope(tenant, key)
        kind = await self._check_holder(sk, lease)
        name = pb.ReleaseReason.Name(reason)
        why = {pb.COMPILE_FAILED: "the compile failed on the holder",
               pb.BELOW_THRESHOLD: "the entry is below the caching thresholds",
               pb.PUBLISH_REFUSED: "the coordinator refused the holder's executable"}.get(reason)
        if reason == pb.PUBLISH_REFUSED and detail:
            why += f" ({detail[:200]})"
        cause = pb.LOCAL_CAUSE_BELOW_THRESHOLD if reason == pb.BELOW_THRESHOLD else 0
        if not await self._give_up(sk, kind, lease, why, detail, cause):
            raise LeaseError(f"the compile lease for key {key} is no longer held")
        self.metrics.releases.labels(name.lower()).inc()
        log.info("released %s (%s) %s", key, name, detail[:200], extra={"key": sk})

    async def _give_up(self, sk: str, kind: str, lease: pb.Lease, why: str | None,
                       detail: str, cause: int = pb.LOCAL_CAUSE_UNSPECIFIED) -> bool:
        """End the claim P/kind that `lease` holds; with `why`, every waiter
        compiles locally at once (a "compile locally" verdict for
        local_marker_ttl_s) instead of one being promoted. False when the
        claim was no longer held."""
        ops = [op_delete(self._k(kind, sk))]
        if why is not None:
            marker_lease = await self.etcd.grant(self.cfg.local_marker_ttl_s)
            body = json.dumps({"reason": f"{why}; compile locally", "cause": cause,
                               "detail": detail[:validate.MAX_DETAIL_LEN]})
            ops.append(op_put(self._k("x", sk), body.encode(), lease=marker_lease))
        ok, _, _ = await self.etcd.txn([cmp_mod_revision(self._k(kind, sk), lease.revision)], ops)
        return ok

    async def _refuse_revoked(self, sk: str, kind: str, header: pb.PublishHeader,
                              revoked: KV, what: str) -> Revoked:
        """A publish of revoked bytes: its claim ends with a "compile locally"
        verdict (a deterministic compile would give every promoted waiter the
        same bytes again, one after another), and the error to raise."""
        with contextlib.suppress(Unavailable):
            await self._give_up(sk, kind, header.lease,
                                "the compiled bytes were purged by an operator", _reason(revoked))
        return Revoked(f"artifact {header.digest} {what} ({_reason(revoked)}); "
                       "it may not be published again")

    # -- KeepAlive -------------------------------------------------------
    async def keepalive(self, key: str, lease: pb.Lease, *,
                        tenant: str = DEFAULT_TENANT) -> int:
        validate.key(key)
        validate.lease(lease)
        try:
            await self._check_holder(scope(tenant, key), lease)
        except LeaseError:
            return 0
        left = await self.etcd.keepalive_once(lease.id)
        self.leases.renewed(lease.id, left)
        return left

    # -- Fetch -----------------------------------------------------------
    async def fetch(self, key: str, digest: str, *, tenant: str = DEFAULT_TENANT,
                    offset: int = 0, as_stored: bool = False
                    ) -> tuple[pb.ArtifactInfo, AsyncIterator[DataChunk]]:
        """The artifact of `key` and its bytes from `offset` on; `as_stored`:
        a blob stored as zstd goes as it is stored (FetchChunk.zstd_data), for
        a client that decodes it (an upload still in flight goes as data)."""
        validate.key(key)
        if digest:
            validate.digest(digest)
        if offset < 0:
            raise InvalidRequest("offset must be >= 0")
        sk = scope(tenant, key)
        info = self._cached_artifact(sk)
        if info is None:
            rec = await self.etcd.get(self._k("a", sk))
            if rec is None:
                upload = self.uploads.get(sk)
                if upload is None or (digest and upload.info.digest != digest):
                    raise NotFound(f"no artifact is published under key {key}")
                if offset > upload.info.size:
                    raise InvalidRequest(f"offset {offset} is past the artifact's "
                                         f"{upload.info.size} bytes")
                self.metrics.streamed_while_publishing.inc()
                return upload.info, self._counted(stream_upload(
                    upload, offset, lambda at: self._stream(sk, upload.info, at),
                    self.cfg.publish_stream_readers))
            info = read_info(key, rec.value)
            if info is None:
                await self._drop_unreadable(sk, "a", rec)
                raise NotFound(f"the index entry of key {key} could not be read; recompile")
            self._remember_artifact(sk, info, rec.mod_revision)
        if digest and info.digest != digest:
            raise NotFound(f"key {key} holds digest {info.digest}, not {digest}")
        if not self.store.has(info.digest):
            entry = await self.etcd.get(self._k("a", sk))
            if entry is not None:
                await self._usable_artifact(sk, KeyState(info, entry.mod_revision, None, 0, None))
            raise NotFound(f"the blob of key {key} is missing; recompile")
        if offset > info.size:
            raise InvalidRequest(f"offset {offset} is past the artifact's {info.size} bytes")
        return info, self._counted(self._stream(sk, info, offset, as_stored))

    async def _counted(self, chunks: AsyncIterator[DataChunk]) -> AsyncIterator[DataChunk]:
        out = self.metrics.bytes.labels("out")
        async for chunk in chunks:
            out.inc(chunk.size)
            yield chunk

    async def _stream(self, sk: str, info: pb.ArtifactInfo, offset: int = 0,
                      as_stored: bool = False) -> AsyncIterator[DataChunk]:
        try:
            # Resuming at `offset`: what the caller already has is not sent again.
            async for chunk in aread(self.store, info.digest, offset=offset,
                                     transform=DataChunk.framed, as_stored=as_stored):
                yield chunk
        except (CorruptBlob, NotFound) as exc:
            # Bytes that proved bad, or an object gone from a bucket behind
            # our back: the entry goes, and the key compiles again.
            if isinstance(exc, CorruptBlob):
                self.metrics.corrupt_blobs.inc()
            self._index.pop(sk, None)
            with contextlib.suppress(Exception):
                await self.etcd.delete(self._k("a", sk))
            raise

