"""What operators ask of a coordinator replica: purging artifacts and the tenant's revocations, and its status."""

from __future__ import annotations

import collections
import ipaddress
import json
import logging
import math
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

from compilecast import validate
from compilecast.config import CoordinatorConfig
from compilecast.errors import (
    InvalidRequest,
    TooMany,
    Unavailable,
)
from compilecast.store import ArtifactStore
from compilecast.v1 import cache_pb2 as pb

from .etcd import (
    MAX_TXN_OPS,
    cmp_mod_revision,
    op_delete,
    op_put,
)
from .farm import Farm
from .keystate import (
    holder_name,
    revocation_reason,
    waiters_by_job,
)
from .keyview import Keyspace
from .records import (
    DEFAULT_TENANT,
    json_dict,
    plain,
    scope,
    tenant_of,
)
from .waiting import Waiting

PURGE_TXN_KEYS = 120  # index entries one purge txn deletes (a compare and a delete each)
PURGE_LOGGED = 20  # revoked artifacts a purge logs one by one; the rest in one line

# etcd revisions are int64; a revision to read from is one more than one seen.
MAX_REVISION = 2**63 - 1
MAX_REPORTED_HITS = 10_000_000  # in one ReportHits
MAX_REPORTED_SECONDS = 1e9


def reporter_host(peer: str) -> str:
    """The host a call came from, as a hit reporter's bucket names it: the
    address without its port, every loopback address one host, an IPv6
    address its /64 (one machine holds a whole /64, not one address of it)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind  # a unix socket's callers: this machine
    host = rest.rpartition(":")[0].strip("[]") or rest
    try:
        address = ipaddress.ip_address(urllib.parse.unquote(host).split("%")[0])
    except ValueError:
        return host
    if address.is_loopback:
        return "loopback"
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class HitReports:
    """Each reporter's hits, bounded: a bucket of HITS_PER_S a second that
    holds at most BURST (a worker reports every 10 s; a host answers far
    fewer). Reporters are kept least recently seen first, at most
    REPORTERS_MAX."""

    HITS_PER_S = 100_000.0
    BURST = float(MAX_REPORTED_HITS)
    REPORTERS_MAX = 100_000

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = \
            collections.OrderedDict()  # reporter -> (hits left, when)

    def take(self, reporter: str, hits: int) -> None:
        """Count `hits` against `reporter`'s bucket; TooMany (nothing
        counted) when it holds fewer."""
        now = self.clock()
        left, then = self._buckets.pop(reporter, (self.BURST, now))
        left = min(self.BURST, left + (now - then) * self.HITS_PER_S)
        if hits > left:
            self._buckets[reporter] = (left, now)
            raise TooMany(f"{hits} hits reported, more than this worker can have answered "
                          f"since its last reports ({int(left)}); not counted")
        self._buckets[reporter] = (left - hits, now)
        while len(self._buckets) > self.REPORTERS_MAX:
            self._buckets.popitem(last=False)


def describe_store(cfg: CoordinatorConfig) -> str:
    """Where a replica's artifact bytes live, for `compilecast status`."""
    if cfg.store_type == "s3":
        return (f"s3://{cfg.s3_bucket}/{cfg.s3_prefix.strip('/')} at "
                f"{cfg.s3_endpoint or 'AWS S3'} (cache {cfg.store_dir})")
    return f"disk {cfg.store_dir}"


log = logging.getLogger("compilecast.coordinator.state")


@dataclass(frozen=True)
class OperationSettings:
    store_type: str = "disk"
    store_max_bytes: int = 0  # 0: unbounded
    store_description: str = ""  # where the store is, for Status


class OperationMetrics(Protocol):
    """What the operators' calls record (CoordinatorMetrics is one)."""

    @property
    def purges(self) -> Any: ...

    @property
    def tally(self) -> Any: ...

    def of(self, tenant: str) -> Any: ...

    def host_hits(self, tenant: str, hits: int, seconds: float) -> None: ...


class Operations:
    """Purge, Revoked, ReportHits and Status of one replica."""

    def __init__(self, settings: OperationSettings, keys: Keyspace, waiting: Waiting,
                 store: ArtifactStore, metrics: OperationMetrics, farm: Farm) -> None:
        self.settings = settings
        self.view = keys.view
        self.waiting = waiting
        self.session = keys.session
        self.etcd = keys.etcd
        self.store = store
        self.metrics = metrics
        self.records = keys.records
        self.farm = farm
        self.prefix = keys.view.prefix
        self.reports = HitReports()

    # -- Purge -----------------------------------------------------------
    async def purge(self, keys: list[str], digests: list[str], reason: str, *,
                    tenant: str = DEFAULT_TENANT, dry_run: bool = False) -> pb.PurgeResponse:
        """Revoke the bytes of `keys`' artifacts and `digests` for the tenant,
        then remove every index entry of the tenant that names them: no key
        serves them, no publish brings them back (the revocation is written
        first), and workers drop them from their host caches. The blobs stay
        in the store (another tenant's entries may name the same bytes) until
        evicted."""
        for k in keys:
            validate.key(k)
        for d in digests:
            validate.digest(d)
        if not keys and not digests:
            raise InvalidRequest("name the keys or digests to purge")
        if len(keys) + len(digests) > validate.MAX_PURGE_NAMES:
            raise InvalidRequest(f"a purge names at most {validate.MAX_PURGE_NAMES} keys and "
                                 f"digests, got {len(keys) + len(digests)}: send them in pages")
        reason = reason[:validate.MAX_DETAIL_LEN] or "purged by an operator"
        resp = pb.PurgeResponse()
        wanted = set(digests)  # a key's bytes are revoked, so every key naming them goes
        for k, kv in zip(keys, await self.etcd.get_many([self.view.k("a", scope(tenant, k))
                                                         for k in keys]), strict=True):
            if kv is None:
                resp.missing.append(k)
            else:
                digest = (json_dict(kv.value) or {}).get("digest")
                if isinstance(digest, str):
                    wanted.add(digest)
        head = self.view.k("a", scope(tenant, ""))
        naming: dict[str, list[str]] = {d: [] for d in sorted(wanted)}
        if wanted:  # a tenant's whole index, a page at a time
            async for kv in self.etcd.scan_prefix(head):
                digest = (json_dict(kv.value) or {}).get("digest")
                if digest in naming:
                    naming[digest].append(kv.key[len(head):].decode())
        if dry_run:
            for digest, named in naming.items():
                resp.purged.extend(sorted(named))
                resp.revoked.append(digest)
            return resp
        # The revocations first, MAX_TXN_OPS a txn: from then on no key
        # serves those bytes and no publish brings them back.
        now = time.time()
        revocations = [op_put(self.view.revocation(tenant, digest), json.dumps(
            {"reason": reason, "at": now, "keys": sorted(named)}).encode())
            for digest, named in naming.items()]
        for start in range(0, len(revocations), MAX_TXN_OPS):
            await self.etcd.txn([], revocations[start:start + MAX_TXN_OPS])
        # Then the index entries naming them, PURGE_TXN_KEYS a txn whatever
        # their digests.
        entries = [(k, digest) for digest, named in naming.items() for k in named]
        for start in range(0, len(entries), PURGE_TXN_KEYS):
            resp.purged.extend(await self._unindex(tenant,
                                                   entries[start:start + PURGE_TXN_KEYS]))
        resp.purged.sort()
        resp.revoked.extend(naming)
        shown = list(naming.items())[:PURGE_LOGGED]
        for digest, named in shown:
            log.warning("purged %s: revoked artifact %s (%s)", ", ".join(named) or "no key",
                        digest, reason, extra={"key": scope(tenant, digest)})
        if len(naming) > len(shown):
            log.warning("purged %d more keys: revoked %d more artifacts (%s)",
                        len(entries) - sum(len(named) for _, named in shown),
                        len(naming) - len(shown), reason)
        self.metrics.purges.inc(len(resp.revoked))
        return resp

    async def _unindex(self, tenant: str, entries: list[tuple[str, str]]) -> list[str]:
        """Delete the index entries of `entries` (key, digest) that still
        name their digest, in one txn (again, should one change meanwhile);
        the keys deleted."""
        for _ in range(3):
            records = [self.view.k("a", scope(tenant, k)) for k, _ in entries]
            current = [(k, rec, kv) for (k, digest), rec, kv in zip(
                           entries, records, await self.etcd.get_many(records), strict=True)
                       if kv is not None and
                       (json_dict(kv.value) or {}).get("digest") == digest]
            if not current:
                return []
            ok, revision, _ = await self.etcd.txn(
                [cmp_mod_revision(rec, kv.mod_revision) for _, rec, kv in current],
                [op_delete(rec) for _, rec, _ in current])
            if ok:
                for k, _, _ in current:
                    self.view.forget_artifact(scope(tenant, k), revision)
                return [k for k, _, _ in current]
        raise Unavailable("the index entries to purge kept changing; try again")

    async def revoked(self, since_revision: int, *,
                      tenant: str = DEFAULT_TENANT) -> pb.RevokedResponse:
        if not 0 <= since_revision < MAX_REVISION:
            raise InvalidRequest(f"since_revision must be in [0, {MAX_REVISION})")
        head = self.view.k("v", scope(tenant, ""))
        kvs, revision = await self.etcd.changed_since(head, since_revision)
        resp = pb.RevokedResponse(revision=revision)
        for kv in kvs:  # (a record it cannot read still revokes its digest)
            rec = json_dict(kv.value) or {}
            resp.revocations.add(digest=kv.key[len(head):].decode(), reason=revocation_reason(kv),
                                 revoked_unix=float(rec.get("at", 0.0)),
                                 keys=[str(k) for k in rec.get("keys", ())])
        return resp

    # -- Hits the workers answered --------------------------------------
    def report_hits(self, hits: int, seconds: float, *, tenant: str = DEFAULT_TENANT,
                    reporter: str = "") -> None:
        """Count hits a worker answered without us (its host cache, or a
        request it shared among its processes) and the compile time they
        saved, for the worker's tenant: the fleet's hits, in one place.
        Each reporter (a worker identity on one host) is bounded in rate
        and in seconds per hit (HitReports)."""
        if not 0 <= hits <= MAX_REPORTED_HITS or not math.isfinite(seconds) \
                or not 0 <= seconds <= MAX_REPORTED_SECONDS:
            raise InvalidRequest(f"a report of {hits} hits saving {seconds} s: hits are 0 to "
                                 f"{MAX_REPORTED_HITS}, seconds 0 to {MAX_REPORTED_SECONDS:g}")
        self.reports.take(reporter, hits)
        # A hit of an artifact published with days of compile time counts,
        # its seconds at most a day's (never a refusal that holds the hits).
        self.metrics.host_hits(tenant, hits, min(seconds, hits * validate.MAX_SECONDS_PER_HIT))

    # -- Status ----------------------------------------------------------
    async def status(self, tenant: str = DEFAULT_TENANT) -> pb.StatusResponse:
        readable, problem = await self.etcd.health()
        resp = pb.StatusResponse(role="coordinator", upstream_healthy=not problem,
                                 upstream_problem=problem,
                                 upstream="etcd " + ",".join(self.etcd.endpoints))
        tally, replica = self.metrics.of(tenant), self.metrics.tally
        resp.hits, resp.misses = tally.hits + tally.host_hits, tally.misses
        resp.compile_seconds_saved = tally.saved_s
        resp.store_bytes, resp.store_max_bytes = self.store.stored_bytes, self.settings.store_max_bytes
        resp.store = self.settings.store_description
        if self.settings.store_type == "s3":
            resp.bucket_errors = replica.bucket_errors
            resp.bucket_local_hits = replica.bucket_local_hits
            resp.bucket_local_misses = replica.bucket_local_misses
        if not readable:
            return resp
        counts = await self.farm.counts(tenant)
        resp.tasks_queued, resp.tasks_running = counts["queued"], counts["running"]
        resp.tasks_done, resp.tasks_failed = counts["done"], counts["failed"]
        tenant_path = f"/{tenant}/".encode()
        resp.artifacts = await self.etcd.count_prefix(self.prefix + b"/a" + tenant_path)
        resp.revoked = await self.etcd.count_prefix(self.prefix + b"/v" + tenant_path)
        leases = await self.etcd.get_prefix(self.prefix + b"/l" + tenant_path, limit=100)
        resp.compiles_in_flight = await self.etcd.count_prefix(self.prefix + b"/l" + tenant_path)
        wait_records = await self.etcd.get_prefix(self.prefix + b"/w" + tenant_path, limit=5000)
        now = time.time()
        jobs: dict[str, list[int]] = {}
        for kv in leases:
            jobs.setdefault(str((json_dict(kv.value) or {}).get("job", "")), [0, 0])[0] += 1
        by_key: collections.Counter[str] = collections.Counter()  # waiters of each key
        head = len(self.prefix + b"/w" + tenant_path)
        # This replica's waiters as they are now (its records land up to
        # WAITER_FLUSH_S later); the other replicas' as their records say.
        counted = self.waiting.here(tenant)
        mine = self.session.replica.encode()
        for kv in wait_records:
            waited, _, who = kv.key[head:].partition(b"/")
            if who != mine:
                counted.append((waited.decode(), waiters_by_job(kv)))
        for key, by_job in counted:
            for job, n in by_job.items():
                resp.waiters += n
                jobs.setdefault(job, [0, 0])[1] += n
                by_key[key] += n
        for job, (compiling, waiting) in sorted(jobs.items()):
            resp.jobs.append(pb.JobStatus(job=job, compiles_in_flight=compiling, waiters=waiting))
        for sk, program, differing, when in self.records.recent:
            if tenant_of(sk) == tenant:
                resp.recent_misses.append(pb.RecentMiss(key=plain(sk), program_name=program,
                                                        differing=differing,
                                                        age_seconds=now - when))
        for kv in leases:
            held = kv.key[len(self.prefix) + 3 + len(tenant_path) - 1:].decode()
            rec = json_dict(kv.value) or {}
            resp.in_flight.append(pb.InFlight(key=held, holder=holder_name(rec),
                                              age_seconds=now - rec.get("granted", now),
                                              waiters=by_key[held]))
        return resp
