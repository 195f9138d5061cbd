"""What a worker tells the coordinator of its host, and hears back:

- `HostHits`: the hits answered here (the host cache, a job's manifest or
  stream, a request shared among the host's processes) and the compile time
  they saved, counted on the host and reported (ReportHits) every so often;
  a report the coordinator refuses is dropped and said once a kind, never
  sent again with every later hit held in it;
- `Revocations`: the digests purged in the fleet, polled with each
  credential in use (revocations are a tenant's), dropped from the host cache
  and the jobs' manifests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from compilecast import validate
from compilecast.errors import Status
from compilecast.grpcutil import bearer
from compilecast.v1 import cache_pb2 as pb

from .hostcache import HostCache
from .manifests import HostManifests
from .metrics import WorkerMetrics
from .upstream import CoordinatorLink, Relayed

log = logging.getLogger(__name__)

PASSING = (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.CANCELLED)  # sent with the next


class HostHits:
    def __init__(self, link: CoordinatorLink, metrics: WorkerMetrics) -> None:
        self.link = link
        self.metrics = metrics
        self.unreported: list[float] = [0, 0.0]  # hits answered here, and their seconds
        self.joined = [0, 0]  # answers shared from another's request: misses, hits
        self._refused: set[Status] = set()  # kinds of refusal of a report, logged once

    def saved_here(self, info: pb.ArtifactInfo) -> None:
        """A hit the coordinator did not answer: its saved compile counted
        here, and reported; a day's at most (validate.MAX_SECONDS_PER_HIT)."""
        self.metrics.compile_seconds_saved.inc(info.compile_time_seconds)
        self.unreported[0] += 1
        self.unreported[1] += min(info.compile_time_seconds, validate.MAX_SECONDS_PER_HIT)

    def shared(self, answer: pb.AcquireResponse) -> None:
        """An answer another caller's request brought: the coordinator
        counted one request for both."""
        self.joined[answer.decision == pb.HIT] += 1
        if answer.decision == pb.HIT:
            self.saved_here(answer.artifact)

    def add_to(self, resp: pb.StatusResponse) -> None:
        """The coordinator's counts in `resp`, with what it has not heard yet."""
        resp.hits += int(self.unreported[0])
        resp.misses += self.joined[False]
        resp.compile_seconds_saved += self.unreported[1]

    async def run(self, every_s: float) -> None:
        """Report every `every_s` (what was not reported stays for the next)."""
        while True:
            await asyncio.sleep(every_s)
            await self.report_now()

    async def report_now(self) -> None:
        hits, seconds = int(self.unreported[0]), self.unreported[1]
        if not hits:
            return
        try:
            await self.link.up.ReportHits(
                pb.ReportHitsRequest(hits=hits, compile_seconds_saved=seconds),
                timeout=self.link.rpc_timeout_s, metadata=bearer(self.link.token))
        except Relayed as exc:
            if exc.code in PASSING:
                log.debug("reporting %d hits failed: %s", hits, exc.code.name)
                return
            # Refused, not failed: sent again it would be refused again, with
            # every later hit held in it. Dropped; said once a kind.
            if exc.code not in self._refused:
                self._refused.add(exc.code)
                log.warning("the coordinator did not count %d of this worker's hits: %s: %s%s",
                            hits, exc.code.name, exc.details,
                            " (give the worker's token the worker permission)"
                            if exc.code == Status.PERMISSION_DENIED else "")
        self.unreported[0] -= hits
        self.unreported[1] -= seconds


class Revocations:
    """`credentials()`: the per-job credentials in use besides the worker's own."""

    def __init__(self, link: CoordinatorLink, cache: HostCache, manifests: HostManifests,
                 metrics: WorkerMetrics, credentials: Callable[[], list[tuple]]) -> None:
        self.link = link
        self.cache = cache
        self.manifests = manifests
        self.metrics = metrics
        self.credentials = credentials
        self._tenants: dict[str, str] = {}  # host-cache namespace -> its tenant, once known

    async def drop(self, ns: str, tenant: str, digests, why: str) -> None:
        """Tenant `tenant`'s revocations, seen through namespace `ns`: its
        entries go, and the bytes unless another tenant has them too."""
        if not digests:
            return
        if tenant:
            self._tenants[ns] = tenant
        digests = set(digests)
        named = await asyncio.to_thread(self.cache.naming, digests)
        mine, others = {ns}, set[str]()
        for other in named:
            known = await self._tenant_of(other)
            if known is not None and tenant:
                (mine if known == tenant else others).add(other)
        self.manifests.revoke(digests)
        for digest in await asyncio.to_thread(self.cache.revoke, digests, named, mine, others):
            self.metrics.revoked.inc()
            log.warning("dropped revoked artifact %s from the host cache (%s)", digest, why)

    async def _tenant_of(self, ns: str) -> str | None:
        """The tenant of host-cache namespace `ns`, asked of the coordinator
        with its credential when not known yet; None when it cannot be."""
        if ns in self._tenants:
            return self._tenants[ns]
        md = next((md for md, n in self.link.namespaces.items() if n == ns), None)
        if md is None:
            return None
        try:
            resp = await self.link.up.Revoked(pb.RevokedRequest(),
                                              timeout=self.link.rpc_timeout_s, metadata=md)
        except Relayed:
            return None
        if resp.tenant:
            self._tenants[ns] = resp.tenant
        return resp.tenant or None

    async def run(self, every_s: float) -> None:
        """Drop the digests the coordinator has revoked (purged artifacts),
        polling every `every_s`: a purge reaches every host within that.
        Revocations are per tenant, so this polls with the worker's own
        credential and with each per-job credential its processes use."""
        since: dict[tuple, int] = {}
        while True:
            since = {md: since.get(md, 0)
                     for md in [bearer(self.link.token), *self.credentials()]}
            for md in list(since):
                try:
                    resp = await self.link.up.Revoked(
                        pb.RevokedRequest(since_revision=since[md]),
                        timeout=self.link.rpc_timeout_s, metadata=md)
                    await self.drop(self.link.namespace(md), resp.tenant,
                                    [r.digest for r in resp.revocations],
                                    "; ".join(sorted({r.reason for r in
                                                      resp.revocations}))[:200])
                    since[md] = resp.revision
                except Relayed as exc:
                    log.debug("polling revocations failed: %s", exc.code.name)
            await asyncio.sleep(every_s)
