"""The worker's CompileCache service for this host's processes: it
translates each call to its components (worker/daemon/wiring.py builds
them) and nothing more.

- Acquire and Wait: answered from their sources in order (host cache, the
  job's manifest, the job's stream, upstream: worker/daemon/answers.py). When
  the coordinator cannot be reached the answer is COMPILE_LOCALLY at once, so
  a process never waits on a dead service.
- Fetch fills the host cache once per key, then serves every local reader
  from disk (worker/daemon/fetches.py).
- Publish forwards the stream and keeps a copy, so a restarted process on
  this host hits locally (worker/daemon/publishes.py).
- Everything else goes to the coordinator as it is, under the caller's
  credential; the farm's claims, the hit reports and the job streams are the
  coordinator's alone.
"""

from __future__ import annotations

import asyncio

from compilecast import decideserve, validate
from compilecast.errors import CompilecastError, Unauthenticated, Unimplemented, UpstreamError
from compilecast.grpcutil import rpc_errors, token_from, unreachable
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from . import jobrelay
from .dirsync import DirSync
from .upstream import Relayed, relay_pieces
from .wiring import WorkerParts


class WorkerService(rpc.CompileCacheServicer):
    """`dirs`: the host's synced directories, for Status (server.py sets them)."""

    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts
        self.link = parts.link
        self.answers = parts.answers
        self.streams = decideserve.Streams()  # local processes' Decide streams
        self.dirs: DirSync | None = None

    async def close(self) -> None:
        await self.parts.close()

    @rpc_errors
    async def Acquire(self, request, context):
        ns, md = self.link.credential(context)
        return (await self.answers.decide(ns, md, [request]))[0]

    @rpc_errors
    async def AcquireMany(self, request, context):
        ns, md = self.link.credential(context)
        return pb.AcquireManyResponse(
            responses=await self.answers.decide(ns, md, request.requests))

    @rpc_errors
    async def Decide(self, request_iterator, context):
        ns, md = self.link.credential(context)
        async for answer in decideserve.serve(
                request_iterator, lambda rs: self.answers.decide(ns, md, rs),
                wait=lambda r, until: self.answers.wait(ns, md, r, until, self.answers.deadline(r)),
                streams=self.streams):
            yield answer

    @rpc_errors
    async def Wait(self, request, context):
        ns, md = self.link.credential(context)
        deadline = self.answers.deadline(request)  # (the wait's, from here on)
        event = await self.answers.wait(ns, md, request, True, deadline)
        yield event
        if event.decision != pb.WAIT:
            return
        # The holder has started to publish: the caller may fetch now, or wait on.
        if deadline.passed:
            yield pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                               reason="share-binary timeout passed; compile locally")
            return
        copy = self.parts.copies.publishing.get((ns, request.key))
        if copy is not None:  # published through us: its end is the HIT, no wait upstream
            try:
                info = await asyncio.wait_for(asyncio.shield(copy.done),
                                              deadline.left_s() if deadline.bounded else None)
            except Exception:  # (it failed, or time ran out: wait on upstream, as for any)
                pass
            else:
                yield pb.WaitEvent(decision=pb.HIT, artifact=info)
                return
        yield await self.answers.wait(ns, md, request, False, deadline)

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
            await self.parts.revocations.drop(self.link.credential(context)[0], resp.tenant,
                                              resp.revoked, "purged through this worker")
        return resp

    @rpc_errors
    async def GetManifest(self, request, context):
        return await self._forward("GetManifest", request, context)

    @rpc_errors
    async def Revoked(self, request, context):
        return await self._forward("Revoked", request, context)

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
            async for chunk in self.parts.fetches.fetch(ns, md, request):
                yield chunk
        except CompilecastError:
            # A manifest's entry for it proved stale (purged, lost, another
            # digest): the process's next ask goes upstream.
            self.parts.manifests.forget(ns, request.key)
            raise

    @rpc_errors
    async def Publish(self, request_iterator, context):
        ns, md = self.link.credential(context)
        return await self.parts.publishes.publish(ns, md, request_iterator)

    @rpc_errors
    async def OpenUpload(self, request, context):
        ns, md = self.link.credential(context)
        return await self.parts.publishes.open_upload(ns, md, request)

    @rpc_errors
    async def Status(self, request, context):
        resp = pb.StatusResponse(role="worker", upstream=f"coordinator {self.link.address}")
        # Within the caller's deadline, so that a slow or unreachable
        # coordinator is reported as such rather than timing the caller out.
        left = context.time_remaining()
        timeout = self.link.rpc_timeout_s if left is None else \
            max(0.1, min(self.link.rpc_timeout_s, left * 0.7))
        parts = self.parts
        try:
            up = await self.link.up.Status(request, timeout=timeout,
                                           metadata=self.link.credential(context)[1])
        except Relayed as exc:
            resp.upstream_problem = \
                f"coordinator {unreachable(UpstreamError(exc.code, exc.details))}"
            resp.upstream_healthy = False
            resp.artifacts = await asyncio.to_thread(parts.cache.count)
        else:
            resp.CopyFrom(up)
            # Hits this worker answered from its host cache, and answers it
            # shared among its processes, reach the coordinator's counts with
            # the next report: until then, they are added here.
            parts.hits.add_to(resp)
            resp.role = "worker"
            resp.upstream = f"coordinator {self.link.address}"
        resp.waiting_here = parts.waits.waiting
        store = parts.cache.store
        resp.host_cache_bytes, resp.host_cache_max_bytes = store.stored_bytes, store.max_bytes or 0
        resp.host_disk_free_bytes = await asyncio.to_thread(store.free_bytes)
        resp.host_cache_min_free_bytes = store.min_free
        resp.host_uncached = parts.copies.uncached
        if self.dirs is not None:
            resp.directories.extend(await asyncio.to_thread(self.dirs.status))
        resp.pjrt_compiles.extend(parts.metrics.pjrt_status())
        resp.prefetches.extend(parts.manifests.status())
        resp.manifest_hits = parts.manifests.hits
        return resp


class RelayService(rpc.CompileCacheServicer):
    """A worker's relay endpoint (TCP): Fetch, WatchJob and GetManifest only,
    for peer workers the coordinator (or a relay above) points here. Where workers hold a token, a peer must present
    one: the workers' own (this host's namespace) or the per-job token its
    process used, which reaches only what that token fetched here or what the
    coordinator grants it."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker

    @rpc_errors
    async def WatchJob(self, request_iterator, context):
        """A peer's stream of a job whose news this worker relays
        (worker/daemon/jobrelay.py)."""
        if self.worker.link.token and not token_from(context):
            raise Unauthenticated("relayed news needs a token")
        ns, md = self.worker.link.credential(context)
        async for events in jobrelay.watch(
                request_iterator, lambda job: self.worker.parts.manifests.subtree(ns, md, job)):
            yield events

    @rpc_errors
    async def GetManifest(self, request, context):
        """A peer's manifest of a job whose news this worker relays: its own copy."""
        if self.worker.link.token and not token_from(context):
            raise Unauthenticated("relayed manifests need a token")
        validate.job(request.job)
        if request.held_digest:
            validate.digest(request.held_digest)
        ns, md = self.worker.link.credential(context)
        return await self.worker.parts.manifests.relayed(ns, md, request.job,
                                                         request.held_digest)

    @rpc_errors
    async def Fetch(self, request, context):
        if self.worker.link.token and not token_from(context):
            raise Unauthenticated("relay fetches need a token")
        ns, _ = self.worker.link.credential(context)
        head = await self.worker.parts.fetches.relay_ticket(ns, request)
        if head is not None:
            yield head
            return
        async for chunk in self.worker.Fetch(request, context):
            for piece in relay_pieces(chunk):
                yield piece
