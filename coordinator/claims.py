"""Claims on keys, and Acquire's decision: who compiles a key (its compile
lease record, or a hedge beside a holder far past its expected time), how a
holder proves it holds one, and what a process asking for a key is told.
The lease rules are in coordinator/state.py's opening.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from compilecast.errors import LeaseError, Unavailable
from compilecast.v1 import cache_pb2 as pb

from .etcd import KV, EtcdClient, GuardedBatcher, cmp_absent, cmp_mod_revision, op_put
from .keystate import KeyState, holder_name, lease_owner, local_verdict
from .keyview import KeyView
from .leases import LeasePool
from .records import DEFAULT_TENANT, KeyRecords, json_dict, plain, scope, tenant_of

log = logging.getLogger("compilecast.coordinator.state")


@dataclass(frozen=True)
class ClaimSettings:
    publish_stream_readers: int = 0  # waiters an upload in progress streams to (0: none)


class ClaimMetrics(Protocol):
    """What the claims record (CoordinatorMetrics is one)."""

    @property
    def compiles(self) -> Any: ...

    def count_decision(self, tenant: str, decision: pb.Decision.ValueType, n: int = 1) -> None: ...

    def observe_etcd_decision(self, decision: pb.Decision.ValueType, seconds: float) -> None: ...


class Claims:
    """Taking and checking compile leases, and deciding an Acquire."""

    def __init__(self, settings: ClaimSettings, view: KeyView, etcd: EtcdClient, leases: LeasePool,
                 records: KeyRecords, metrics: ClaimMetrics) -> None:
        self.settings = settings
        self.view = view
        self.etcd = etcd
        self.leases = leases
        self.records = records
        self.metrics = metrics
        self._claims = GuardedBatcher(etcd)  # the claims of concurrent misses, together

    # -- the lease -------------------------------------------------------
    def _claim(self, lease_id: int, req: pb.Requester, program: str) -> bytes:
        return json.dumps(
            {"lease": lease_id, "job": req.job, "process": req.process_id,
             "client": req.client, "granted": time.time(), "program": program}
        ).encode()

    async def try_take(self, sk: str, req: pb.Requester, program: str = "", *,
                       hedge_of: int = 0) -> pb.Lease | None:
        """Create the lease record (P/l), or with hedge_of the hedge record
        (P/h) next to a holder whose record still has revision hedge_of."""
        if not hedge_of:
            return (await self.take_or_read(sk, req, program))[0]
        k = self.view.k
        compare = [cmp_mod_revision(k("l", sk), hedge_of),
                   cmp_absent(k("h", sk)), cmp_absent(k("a", sk))]
        return (await self._claim_txn(sk, "h", compare, [k("h", sk)], req, program))[0]

    async def take_or_read(self, sk: str, req: pb.Requester,
                           program: str) -> tuple[pb.Lease | None, KeyState | None]:
        """Claim a free key in one round trip: the txn creates the lease
        record when nothing (artifact, claim, hedge, local verdict) exists,
        and otherwise reads what does. Returns (lease, None) or (None, state)."""
        keys = self.view.state_keys(sk)
        lease, kvs = await self._claim_txn(sk, "l", [cmp_absent(k) for k in keys], keys,
                                           req, program)
        if lease is not None:
            return lease, None
        return None, await self.view.readable_state(sk, kvs)

    async def _claim_txn(self, sk: str, kind: str, compare: list[Any], read: list[bytes],
                         req: pb.Requester, program: str
                         ) -> tuple[pb.Lease | None, list[KV | None]]:
        """Put the claim record P/kind on a pooled lease if `compare` holds,
        else read `read` (which includes P/kind) in the same txn. A retried
        txn whose first attempt landed (the reply was lost with an etcd
        member) fails its compares on our own record: that is a success."""
        lease_id, granted_at = await self.leases.take(lease_owner(sk, req))
        record = self.view.k(kind, sk)
        ok, rev, kvs = await self._claims.txn(
            compare, [op_put(record, self._claim(lease_id, req, program), lease=lease_id)], read)

        def held(revision: int) -> pb.Lease:
            return pb.Lease(id=lease_id, ttl_seconds=self.leases.ttl_left(granted_at),
                            revision=revision,
                            takes_digest_last=self.takes_digest_last())

        if ok:
            return held(rev), []
        mine = kvs[read.index(record)]
        if mine is not None and (json_dict(mine.value) or {}).get("lease") == lease_id:
            return held(mine.mod_revision), kvs
        self.leases.give_back((lease_id, granted_at))
        return None, kvs

    def takes_digest_last(self) -> bool:
        """Whether holders may send the digest after the bytes: not when the
        waiters read an upload as it arrives (they are told its digest)."""
        return self.settings.publish_stream_readers == 0

    async def check_holder(self, sk: str, lease: pb.Lease,
                           requester: pb.Requester | None = None) -> str:
        """Which record ("l": the lease, "h": a hedge) `lease` holds; raises
        LeaseError when it holds neither."""
        key = plain(sk)
        recs = await self.etcd.get_many([self.view.k("l", sk), self.view.k("h", sk)])
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
                self.view.hit(tenant, resp.artifact)
        else:
            start = time.perf_counter()
            try:
                resp = await self._decide(sk, req, may_publish, program_name)
            except Unavailable as exc:
                resp = pb.AcquireResponse(decision=pb.COMPILE_LOCALLY,
                                          reason=self.view.etcd_down(exc))
            self.metrics.observe_etcd_decision(resp.decision, time.perf_counter() - start)
        self.metrics.count_decision(tenant, resp.decision)
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
        given = [r for r in answers if r is not None]
        self.view.hit(tenant, *(r.artifact for r in given if r.decision == pb.HIT))
        # counted once per decision, not once per key
        for decision, n in collections.Counter(r.decision for r in given).items():
            self.metrics.count_decision(tenant, decision, n)
        return answers

    def _known(self, sk: str) -> pb.AcquireResponse | None:
        cached = self.view.cached_artifact(sk)
        if cached is not None:
            return pb.AcquireResponse(decision=pb.HIT, artifact=cached)
        held = self.view.claim_reason(sk)
        if held is not None:  # someone compiles it: what etcd would say, without asking
            return pb.AcquireResponse(decision=pb.WAIT, reason=held)
        return None

    async def _decide(self, sk: str, req: pb.Requester, may_publish: bool,
                      program: str) -> pb.AcquireResponse:
        """What etcd says of a key this replica does not know (_known is None)."""
        # A process that may claim the key tries to at once; the others read.
        claims = may_publish and (not req.job or req.process_id == req.designated_process)
        for _ in range(3):
            st: KeyState | None
            if claims:
                lease, st = await self.take_or_read(sk, req, program)
                if lease is not None:
                    return self._granted(sk, req, lease)
            else:
                st = await self.view.read_shared(sk)
            assert st is not None
            info = await self.view.usable_artifact(sk, st)
            if info is not None:
                self.view.hit(tenant_of(sk), info)
                return pb.AcquireResponse(decision=pb.HIT, artifact=info)
            if st.local:
                return pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, **local_verdict(st.local))
            if st.lease or st.hedge:
                return pb.AcquireResponse(decision=pb.WAIT,
                                          reason=f"compiled by {holder_name(st.lease or st.hedge or {})}")
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
