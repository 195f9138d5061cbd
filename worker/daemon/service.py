"""The worker's CompileCache service: a caching, single-flight proxy.

- Acquire answers HIT from the host cache without a round trip; otherwise it
  asks the coordinator, over one Decide stream per credential that carries
  every local process's decisions (compilecast.decide). When the coordinator
  cannot be reached the answer is COMPILE_LOCALLY at once, so a process never
  waits on a dead service.
- Fetch fills the host cache once per key (one download however many local
  processes ask), then serves every local reader from disk
  (worker/daemon/fetches.py).
- Publish forwards the stream and keeps a copy, so a restarted process on
  this host hits locally (worker/daemon/publishes.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc

from compilecast import decide, decideserve, retry, tracing, validate
from compilecast.decide import Decider
from compilecast.errors import CompilecastError, Status, Unimplemented, UpstreamError
from compilecast.grpcutil import bearer, rpc_errors, token_from, unreachable
from compilecast.negotiate import Route, Routes
from compilecast.serving import Background
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from .decisions import HostDecisions
from .dirsync import DirSync
from .fetches import Fetches
from .hostcache import HostCache, HostCopies
from .manifests import HostManifests
from .metrics import WorkerMetrics
from .publishes import Publishes
from .upstream import (
    CoordinatorLink,
    Relayed,
    relay_error,
    relay_pieces,
)
from .waits import HostWaits

log = logging.getLogger(__name__)

DEGRADED = retry.DEGRADED
MAX_DECIDERS = 64  # upstream Decide streams kept open (one per caller credential)


class WorkerService(rpc.CompileCacheServicer):
    """The worker's CompileCache API for this host's processes: the
    decisions and waits (shared among the host's callers, one Decide stream
    per credential upstream) here; fetches and publishes in their components."""

    def __init__(self, coordinator: str, cache: HostCache, metrics: WorkerMetrics,
                 *, rpc_timeout_s: float, share_binary_timeout_ms: int = 0,
                 decide_gap_s: float = decide.GAP_S,
                 token: str = "", credentials: grpc.ChannelCredentials | None = None,
                 relay_address: str = "", peer_credentials: grpc.ChannelCredentials | None = None,
                 local_files: bool = True,
                 data_plane: bool = False, wake_on_host_publish: bool = False,
                 bucket_urls: bool = True, job: str = "", job_streams: bool = True) -> None:
        self.share_binary_timeout_ms = share_binary_timeout_ms
        self.job = job  # this host's job (`up --job`): its manifest's keys are answered here
        # The routes besides gRPC this worker may take (compilecast/negotiate.py):
        # whole downloads and uploads over the coordinator's data plane
        # (plaintext only), a bucket's presigned URLs, peers' relay data
        # planes; the host cache's files handed to this host's processes.
        self.routes = Routes(
            [Route.UPLOAD_TICKET, Route.RELAY_PLANE]
            + [route for route, offered in ((Route.DATA_PLANE, data_plane),
                                            (Route.BUCKET_URL, bucket_urls),
                                            (Route.LOCAL_FILE, local_files),
                                            (Route.GROWING_FILE, local_files)) if offered])
        self.link = CoordinatorLink(coordinator, token=token, rpc_timeout_s=rpc_timeout_s,
                                    credentials=credentials, peer_credentials=peer_credentials)
        self.cache = cache
        self.metrics = metrics
        self.decide_gap_s = decide_gap_s  # between two messages of a Decide stream upstream
        self.background = Background(log)
        self.copies = HostCopies(cache, metrics)
        self.waits = HostWaits(metrics.waits)  # this host's waits for one key go upstream as one
        self.decisions = HostDecisions(metrics.decisions)  # and its requests for one key
        self.fetches = Fetches(self.link, cache, self.copies, metrics, self.routes,
                               self.background, relay_address=relay_address)
        self.publishes = Publishes(self.link, cache, self.copies, metrics, self.routes,
                                   self.waits, wake_on_host_publish=wake_on_host_publish)
        self.manifests = HostManifests(self.link, self.fetches,
                                       max_bytes=cache.store.max_bytes or 0,
                                       counted=self._prefetched, streams=job_streams)
        self.dirs: DirSync | None = None  # the host's synced directories (server.py)
        self._deciders: collections.OrderedDict[tuple, Decider] = collections.OrderedDict()
        self._tenants: dict[str, str] = {}  # host-cache namespace -> its tenant, once known
        self._retiring: set[Decider] = set()  # evicted, closed once their waits end
        self._joined = [0, 0]  # answers shared from another's request: misses, hits
        # Hits answered here, and the compile time they saved, not reported to
        # the coordinator yet (report_hits).
        self._unreported: list[float] = [0, 0.0]
        self._report_refused: set[Status] = set()  # kinds of refusal of a report, logged once
        self._upstream_answered = metrics.upstream_decision_seconds.labels("answered")
        self._upstream_unreachable = metrics.upstream_decision_seconds.labels("unreachable")
        self.metrics.waiting.set_function(lambda: self.waits.waiting)
        self.streams = decideserve.Streams()  # local processes' Decide streams
        self.metrics.cache_bytes.set_function(lambda: self.cache.store.stored_bytes)

    @property
    def token(self) -> str:
        return self.link.token

    async def close(self) -> None:
        for decider in [*self._deciders.values(), *self._retiring]:
            await decider.close()
        await self.manifests.close()
        await self.link.close()

    def _local(self, rpc_name: str, exc: UpstreamError) -> str:
        self.metrics.fallbacks.labels(rpc_name).inc()
        return f"coordinator {self.link.address} unreachable ({exc.status.name}); compile locally"

    def _decider(self, md: tuple) -> Decider:
        """The Decide stream to the coordinator for one upstream credential."""
        decider = self._deciders.pop(md, None)
        if decider is None:
            decider = Decider(self.link.decisions, md, timeout_s=self.link.rpc_timeout_s,
                              gap_s=self.decide_gap_s)
            if len(self._deciders) >= MAX_DECIDERS:  # the least recently used goes
                _, old = self._deciders.popitem(last=False)
                self._retiring.add(old)  # closed at shutdown too, if its waits last that long
                self.background.spawn(self._retire(old))
        self._deciders[md] = decider
        return decider

    async def _retire(self, decider: Decider) -> None:
        """Close a stream no longer used once its waits have ended (they may
        last the share-binary timeout: cutting them would fail them)."""
        try:
            await decider.close(when_idle=True)
        finally:
            self._retiring.discard(decider)

    async def _acquire_many(self, requests, ns: str, md: tuple) -> list[pb.AcquireResponse]:
        """Host-cache hits answered here; the rest in one message of the
        Decide stream (with whatever other callers asked meanwhile)."""
        decide.check_batch(requests)
        for r in requests:
            if 0 < r.key_seconds < 3600:
                self.metrics.key_seconds.observe(r.key_seconds)
        keys = [r.key for r in requests]  # one trip to a thread for the batch's lookups
        found = await asyncio.to_thread(lambda: [self.cache.lookup(ns, k) for k in keys])
        for r in requests:  # the job whose manifest records the key (coordinator/manifests.py)
            r.manifest_job = r.manifest_job or r.requester.job or self.job
            self.manifests.learn(ns, md, r.manifest_job)
        # A host cache hit, else a manifest's entry for exactly the key (its
        # bytes verified as every fetch's: worker/daemon/manifests.py).
        found = [info or self._from_manifest(ns, k) for info, k in zip(found, keys, strict=True)]
        answers = [pb.AcquireResponse(decision=pb.HIT, artifact=info) if info else None
                   for info in found]
        for i, r in enumerate(requests):  # a waiter of its job's designated process: no upstream
            if answers[i] is None and self.manifests.stream(ns, r.requester) is not None:
                answers[i] = pb.AcquireResponse(decision=pb.WAIT, reason=(
                    f"process {r.requester.designated_process} of job {r.requester.job} "
                    "compiles; the job's stream tells this host"))
        ask = [r for r, a in zip(requests, answers, strict=True) if a is None]
        upstream: list[tuple[pb.AcquireResponse, bool]] = []
        if ask:
            start = time.perf_counter()
            try:  # shared with this host's other requests for the key (worker/daemon/decisions.py)
                with tracing.span("worker.upstream.decide", keys=len(ask)):
                    for r in ask:  # ours, never a caller's map
                        r.ClearField("trace_context")
                        tracing.inject(r.trace_context)
                    upstream = await self.decisions.decide(md, ask, self._decider(md).decide)
                self._upstream_answered.observe(time.perf_counter() - start)
            except UpstreamError as exc:  # (the Decider's: compilecast/decide.py's edge)
                if exc.status not in DEGRADED:
                    raise relay_error(exc) from None
                self._upstream_unreachable.observe(time.perf_counter() - start)
                why = self._local("acquire", exc)
                upstream = [(pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, reason=why), False)
                            for _ in ask]
        it = iter(upstream)
        out = []
        for local in answers:
            if local is not None and local.decision == pb.WAIT:  # the job's stream waits
                self.metrics.lookups.labels("wait").inc()
                self.metrics.decisions.labels("stream").inc()
                out.append(local)
                continue
            if local is not None:  # the host cache's hit: the coordinator never saw it
                self.metrics.lookups.labels("host_hit").inc()
                self._saved_here(local.artifact)
                out.append(local)
                continue
            a, joined = next(it)
            self.metrics.lookups.labels(pb.Decision.Name(a.decision).lower()).inc()
            if joined:  # nor this one: another's request was (for Status)
                self._joined[a.decision == pb.HIT] += 1
                if a.decision == pb.HIT:
                    self._saved_here(a.artifact)
            out.append(a)
        return out

    def _saved_here(self, info: pb.ArtifactInfo) -> None:
        """A hit the coordinator did not answer: its saved compile counted
        here, and reported (ReportHits)."""
        self.metrics.compile_seconds_saved.inc(info.compile_time_seconds)
        self._unreported[0] += 1
        self._unreported[1] += min(info.compile_time_seconds, validate.MAX_SECONDS_PER_HIT)

    def learn_job(self, job: str) -> None:
        """This host runs `job` (as this worker's own credential): its manifest
        is asked for and prefetched now."""
        self.manifests.learn("host", bearer(self.token), job)

    def _prefetched(self, size: int) -> None:
        self.metrics.prefetched.inc()
        self.metrics.prefetched_bytes.inc(size)

    def _from_manifest(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        info = self.manifests.answer(ns, key)
        if info is not None:
            self.metrics.manifest_hits.inc()
        return info

    @rpc_errors
    async def Acquire(self, request, context):
        ns, md = self.link.credential(context)
        return (await self._acquire_many([request], ns, md))[0]

    @rpc_errors
    async def AcquireMany(self, request, context):
        ns, md = self.link.credential(context)
        return pb.AcquireManyResponse(responses=await self._acquire_many(request.requests, ns, md))

    @rpc_errors
    async def Decide(self, request_iterator, context):
        ns, md = self.link.credential(context)
        async for answer in decideserve.serve(
                request_iterator, lambda rs: self._acquire_many(rs, ns, md),
                wait=lambda r, until: self._wait_once(self._bounded(r), ns, md, until),
                streams=self.streams):
            yield answer

    def _bounded(self, request: pb.WaitRequest) -> pb.WaitRequest:
        """The wait within the operator's share-binary timeout for this host."""
        validate.key(request.key)
        if self.share_binary_timeout_ms > 0:
            request.timeout_ms = min(request.timeout_ms or self.share_binary_timeout_ms,
                                     self.share_binary_timeout_ms)
        return request

    async def _wait_once(self, request: pb.WaitRequest, ns: str, md: tuple,
                         until_publishing: bool) -> pb.WaitEvent:
        """A wait (`_bounded` already), shared with this host's other waits
        for the key (one upstream wait for all: worker/daemon/waits.py) and sent over
        the job's stream (worker/daemon/jobstream.py) or else the Decide
        stream (a message, not a call of its own); an unreachable
        coordinator means COMPILE_LOCALLY."""

        async def upstream(req: pb.WaitRequest, until: bool) -> pb.WaitEvent:
            stream = self.manifests.stream(ns, req.requester)
            if stream is not None:
                info = self._from_manifest(ns, req.key)  # (the stream told of it meanwhile)
                if info is not None:
                    self._saved_here(info)
                    return pb.WaitEvent(decision=pb.HIT, artifact=info)
                self.metrics.waits.labels("stream").inc()  # (sent on it; maybe upstream next)
                event = await stream.wait(req, until)
                if event is not None:
                    if event.decision == pb.HIT:  # (the coordinator answered no wait of ours)
                        self._saved_here(event.artifact)
                    return event
            self.metrics.waits.labels("upstream").inc()
            with tracing.span("worker.upstream.wait", key=req.key):
                req.ClearField("trace_context")  # ours, never a caller's map
                tracing.inject(req.trace_context)
                return await self._decider(md).wait(req, until_publishing=until)

        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms else None

        async def once() -> pb.WaitEvent:
            if deadline is not None:
                request.timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
            return await self.waits.wait(md, request, until_publishing, upstream)

        # A replica stopping (a rolling update) ends its waits: asked again, on
        # a new stream, rather than have every waiter compile (retry.RELAYED_WAIT).
        try:
            return await retry.RELAYED_WAIT.arun(once, what=f"the wait for {request.key}",
                                                 deadline=deadline)
        except UpstreamError as exc:
            if exc.status not in DEGRADED:
                raise relay_error(exc) from None
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason=self._local("wait", exc))

    @rpc_errors
    async def Wait(self, request, context):
        ns, md = self.link.credential(context)
        request = self._bounded(request)
        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms else None
        event = await self._wait_once(request, ns, md, until_publishing=True)
        yield event
        if event.decision != pb.WAIT:
            return
        # The holder has started to publish: the caller may fetch now, or wait on.
        if deadline is not None:
            request.timeout_ms = int((deadline - time.monotonic()) * 1000)
            if request.timeout_ms <= 0:
                yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                   reason="share-binary timeout passed; compile locally")
                return
        copy = self.copies.publishing.get((ns, request.key))
        if copy is not None:  # published through us: its end is the HIT, no wait upstream
            try:
                info = await asyncio.wait_for(
                    asyncio.shield(copy.done),
                    None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception:  # (it failed, or time ran out: wait on upstream, as for any)
                pass
            else:
                yield pb.WaitEvent(decision=pb.HIT, artifact=info)
                return
            if deadline is not None:
                request.timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        yield await self._wait_once(request, ns, md, until_publishing=False)

    async def _forward(self, method: str, request, context):
        """A unary call passed to the coordinator as is, under the caller's credential."""
        return await getattr(self.link.up, method)(request, timeout=self.link.rpc_timeout_s,
                                                   metadata=self.link.credential(context)[1])

    @rpc_errors
    async def Release(self, request, context):
        return await self._forward("Release", request, context)

    @rpc_errors
    async def DescribeKey(self, request, context):
        return await self._forward("DescribeKey", request, context)

    @rpc_errors
    async def ListArtifacts(self, request, context):
        return await self._forward("ListArtifacts", request, context)

    @rpc_errors
    async def KeepAlive(self, request, context):
        return await self._forward("KeepAlive", request, context)

    @rpc_errors
    async def Purge(self, request, context):
        resp = await self._forward("Purge", request, context)
        if not request.dry_run:
            await self._drop_revoked(self.link.credential(context)[0], resp.tenant, resp.revoked,
                                     "purged through this worker")
        return resp

    @rpc_errors
    async def GetManifest(self, request, context):
        return await self._forward("GetManifest", request, context)

    @rpc_errors
    async def Revoked(self, request, context):
        return await self._forward("Revoked", request, context)

    async def _drop_revoked(self, ns: str, tenant: str, digests, why: str) -> None:
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
            resp = await self.link.up.Revoked(pb.RevokedRequest(), timeout=self.link.rpc_timeout_s,
                                         metadata=md)
        except Relayed:
            return None
        if resp.tenant:
            self._tenants[ns] = resp.tenant
        return resp.tenant or None

    async def report_hits(self, every_s: float) -> None:
        """Report the hits answered here to the coordinator every `every_s`
        (what was not reported stays for the next report)."""
        while True:
            await asyncio.sleep(every_s)
            await self.report_hits_now()

    async def report_hits_now(self) -> None:
        hits, seconds = int(self._unreported[0]), self._unreported[1]
        if not hits:
            return
        try:
            await self.link.up.ReportHits(pb.ReportHitsRequest(hits=hits,
                                                          compile_seconds_saved=seconds),
                                     timeout=self.link.rpc_timeout_s, metadata=bearer(self.token))
        except Relayed as exc:
            if exc.code in (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.CANCELLED):
                log.debug("reporting %d hits failed: %s", hits, exc.code.name)
                return  # reported with the next
            # Refused, not failed: sent again it would be refused again, with
            # every later hit held in it. Dropped; said once a kind.
            if exc.code not in self._report_refused:
                self._report_refused.add(exc.code)
                log.warning("the coordinator did not count %d of this worker's hits: %s: %s%s",
                            hits, exc.code.name, exc.details,
                            " (give the worker's token the worker permission)"
                            if exc.code == Status.PERMISSION_DENIED else "")
        self._unreported[0] -= hits
        self._unreported[1] -= seconds

    async def sync_revocations(self, every_s: float) -> None:
        """Drop the digests the coordinator has revoked (purged artifacts) from
        the host cache, polling every `every_s`: a purge reaches every host
        within that. Revocations are per tenant, so this polls with the
        worker's own credential and with each per-job credential its
        processes use (those with a Decide stream open)."""
        since: dict[tuple, int] = {}
        while True:
            since = {md: since.get(md, 0) for md in [bearer(self.token), *self._deciders]}
            for md in list(since):
                try:
                    resp = await self.link.up.Revoked(
                        pb.RevokedRequest(since_revision=since[md]),
                        timeout=self.link.rpc_timeout_s, metadata=md)
                    await self._drop_revoked(self.link.namespace(md), resp.tenant,
                                             [r.digest for r in resp.revocations],
                                             "; ".join(sorted({r.reason for r in
                                                               resp.revocations}))[:200])
                    since[md] = resp.revision
                except Relayed as exc:
                    log.debug("polling revocations failed: %s", exc.code.name)
            await asyncio.sleep(every_s)

    # The farm's calls, for clients that only know their host's worker.
    @rpc_errors
    async def SubmitCompiles(self, request, context):
        return await self._forward("SubmitCompiles", request, context)

    @rpc_errors
    async def Tasks(self, request, context):
        return await self._forward("Tasks", request, context)

    @rpc_errors
    async def ListRecipes(self, request, context):
        async for recipe in self.link.up.ListRecipes(
                request, timeout=max(60.0, self.link.rpc_timeout_s),
                metadata=self.link.credential(context)[1]):
            yield recipe

    # The farm's claims and the hit reports are the coordinator's alone: farm
    # workers and host workers call it directly, never through a host's worker.
    @rpc_errors
    async def ClaimCompile(self, request, context):
        raise Unimplemented("ClaimCompile is the coordinator's: a farm worker calls it there")

    @rpc_errors
    async def WatchJob(self, request_iterator, context):
        raise Unimplemented("WatchJob is the coordinator's: a worker holds its host's stream, "
                            "and its processes wait here with Wait")
        yield  # (a stream's handler)

    @rpc_errors
    async def RenewClaim(self, request, context):
        raise Unimplemented("RenewClaim is the coordinator's: a farm worker calls it there")

    @rpc_errors
    async def FinishCompile(self, request, context):
        raise Unimplemented("FinishCompile is the coordinator's: a farm worker calls it there")

    @rpc_errors
    async def ReportHits(self, request, context):
        raise Unimplemented("ReportHits is the coordinator's: workers report their hits there")

    # -- Fetch and Publish (worker/daemon/fetches.py, worker/daemon/publishes.py) ------
    @rpc_errors
    async def Fetch(self, request, context):
        ns, md = self.link.credential(context)
        try:
            async for chunk in self.fetches.fetch(ns, md, request):
                yield chunk
        except CompilecastError:
            # A manifest's entry for it proved stale (purged, lost, another
            # digest): the process's next ask goes upstream.
            self.manifests.forget(ns, request.key)
            raise

    @rpc_errors
    async def Publish(self, request_iterator, context):
        ns, md = self.link.credential(context)
        return await self.publishes.publish(ns, md, request_iterator)

    @rpc_errors
    async def OpenUpload(self, request, context):
        ns, md = self.link.credential(context)
        return await self.publishes.open_upload(ns, md, request)

    @rpc_errors
    async def Status(self, request, context):
        resp = pb.StatusResponse(role="worker", upstream=f"coordinator {self.link.address}")
        # Within the caller's deadline, so that a slow or unreachable
        # coordinator is reported as such rather than timing the caller out.
        left = context.time_remaining()
        timeout = self.link.rpc_timeout_s if left is None else max(0.1, min(self.link.rpc_timeout_s,
                                                                      left * 0.7))
        try:
            up = await self.link.up.Status(request, timeout=timeout,
                                      metadata=self.link.credential(context)[1])
        except Relayed as exc:
            resp.upstream_problem = f"coordinator {unreachable(UpstreamError(exc.code, exc.details))}"
        else:
            resp.CopyFrom(up)
            # Hits this worker answered from its host cache, and answers it shared
            # among its processes, reach the coordinator's counts with the next
            # report (report_hits): until then, they are added here.
            resp.hits += int(self._unreported[0])
            resp.misses += self._joined[False]
            resp.compile_seconds_saved += self._unreported[1]
            resp.role = "worker"
            resp.upstream = f"coordinator {self.link.address}"
            resp.waiting_here = self.waits.waiting
            await self._host_status(resp)
            return resp
        resp.upstream_healthy = False
        resp.artifacts = await asyncio.to_thread(self.cache.count)
        resp.waiting_here = self.waits.waiting
        await self._host_status(resp)
        return resp

    async def _host_status(self, resp: pb.StatusResponse) -> None:
        store = self.cache.store
        resp.host_cache_bytes, resp.host_cache_max_bytes = store.stored_bytes, store.max_bytes or 0
        resp.host_disk_free_bytes = await asyncio.to_thread(store.free_bytes)
        resp.host_cache_min_free_bytes = store.min_free
        resp.host_uncached = self.copies.uncached
        if self.dirs is not None:
            resp.directories.extend(await asyncio.to_thread(self.dirs.status))
        resp.pjrt_compiles.extend(self.metrics.pjrt_status())
        resp.prefetches.extend(self.manifests.status())
        resp.manifest_hits = self.manifests.hits


class RelayService(rpc.CompileCacheServicer):
    """A worker's relay endpoint (TCP): Fetch only, for peer workers the
    coordinator points here. Where workers hold a token, a peer must present
    one: the workers' own (this host's namespace) or the per-job token its
    process used, which reaches only what that token fetched here or what the
    coordinator grants it."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker

    @rpc_errors
    async def Fetch(self, request, context):
        if self.worker.token and not token_from(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "relay fetches need a token")
        ns, _ = self.worker.link.credential(context)
        head = await self.worker.fetches.relay_ticket(ns, request)
        if head is not None:
            yield head
            return
        async for chunk in self.worker.Fetch(request, context):
            for piece in relay_pieces(chunk):
                yield piece
