"""The digests purged in the fleet, polled with each credential in use
(revocations are a tenant's), dropped from the host cache and the jobs'
manifests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from compilecast.grpcutil import bearer
from compilecast.v1 import cache_pb2 as pb

from .hostcache import HostCache
from .manifests import HostManifests
from .metrics import WorkerMetrics
from .upstream import CoordinatorLink, Relayed

log = logging.getLogger(__name__)


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
