"""The CompileCache gRPC service of the coordinator: decoding, then the core."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import cast

from compilecast import decide, decideserve, tracing, validate
from compilecast.deadline import Deadline
from compilecast.errors import InvalidRequest, TooMany
from compilecast.grpcutil import rpc_errors
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import publish_stream

from .auth import Authenticator, Principal
from .dataplane import DataPlane
from .operations import reporter_host
from .records import scope
from .state import CoordinatorState


class CoordinatorService(rpc.CompileCacheServicer):
    """Every call is authenticated first; the principal's tenant scopes it."""

    def __init__(self, state: CoordinatorState, auth: Authenticator,
                 data_plane: DataPlane | None = None,
                 advice: decideserve.GapAdvice | None = None) -> None:
        self.state = state
        self.auth = auth
        self.data_plane = data_plane
        self.streams = decideserve.Streams()
        self.advice = advice  # the gap asked of Decide clients while busy

    @rpc_errors
    async def Acquire(self, request, context):
        who = self.auth.identify(context)
        validate.acquire_request(request)
        answer = await self.state.claims.acquire(request.key, request.requester,
                                                 dict(request.key_components),
                                                 request.program_name, tenant=who.tenant,
                                                 may_publish=who.can_publish)
        self._noted(who, [request], [answer])
        return answer

    async def _acquire_many(self, requests, who) -> list[pb.AcquireResponse]:
        """A checked batch, decided concurrently: etcd pipelines the misses' writes."""

        async def one(r):
            async with limit:
                with tracing.span("coordinator.decide", tracing.carried(r.trace_context),
                                  key=r.key):
                    return await self.state.claims.acquire(
                        r.key, r.requester, dict(r.key_components), r.program_name,
                        tenant=who.tenant, may_publish=who.can_publish)

        limit: contextlib.AbstractAsyncContextManager[object]
        if len(requests) == 1:  # the common message of a Decide stream
            limit = contextlib.nullcontext()
            answers = [await one(requests[0])]
        else:
            limit = asyncio.Semaphore(64)
            answers = await asyncio.gather(*(one(r) for r in requests))
        self._noted(who, requests, answers)
        return answers

    def _noted(self, who: Principal, requests, answers) -> None:
        """What the answers mean for the requests' jobs: their manifests'
        keys, and the keys their streams hear are claimed."""
        self.state.manifests.note(who.tenant, requests, answers, may_publish=who.can_publish)
        self.state.job_watches.noted(who.tenant, requests, answers)

    def _decided_now(self, requests, who, partial: bool = False):
        answers = self.state.claims.decided_now([r.key for r in requests], tenant=who.tenant,
                                                partial=partial)
        self._noted(who, requests, answers)
        return answers

    @rpc_errors
    async def AcquireMany(self, request, context):
        who = self.auth.identify(context)
        decide.check_batch(request.requests)  # all checked before any is decided
        responses = (cast(list[pb.AcquireResponse] | None,  # (whole: every key, or None)
                          self._decided_now(request.requests, who))
                     or await self._acquire_many(request.requests, who))
        return pb.AcquireManyResponse(responses=responses)

    @rpc_errors
    async def Decide(self, request_iterator, context):
        who = self.auth.identify(context)
        self.state.metrics.decide_streams.inc()
        try:
            async for answer in decideserve.serve(
                    request_iterator, lambda rs: self._acquire_many(rs, who),
                    wait=lambda r, until: decide.ending_event(self._wait(r, who), until),
                    decide_now=lambda rs, partial: self._decided_now(rs, who, partial),
                    streams=self.streams, advice=self.advice):
                yield answer
        finally:
            self.state.metrics.decide_streams.dec()

    async def _wait(self, request: pb.WaitRequest, who,
                    deadline: Deadline | None = None) -> AsyncIterator[pb.WaitEvent]:
        # (A span that is not made current: the generator may be closed from
        # another task.)
        with tracing.detached_span("coordinator.wait", tracing.carried(request.trace_context),
                                   key=request.key):
            async for event in self.state.waiting.wait(
                    request.key, request.requester,
                    request.timeout_ms if deadline is None else deadline,
                    tenant=who.tenant, may_publish=who.can_publish):
                yield event

    @rpc_errors
    async def Wait(self, request, context):
        who = self.auth.identify(context)
        if request.accept_data_wait and self.data_plane is not None:
            # The wait goes on over the data plane (coordinator/dataplane.py):
            # the caller blocks in a socket's recv, and a HIT brings the bytes.
            deadline = self.state.waiting.deadline(request.key, request.requester,
                                                   request.timeout_ms)
            ticket = self.data_plane.wait_ticket(
                functools.partial(self._wait, request, who), deadline)
            if ticket is not None:
                yield pb.WaitEvent(decision=pb.WAIT, data_ticket=ticket,
                                   reason="the wait goes on over the data plane")
                return
        async for event in self._wait(request, who):
            yield event

    @rpc_errors
    async def Publish(self, request_iterator, context):
        who = self.auth.identify(context)
        who.require_publish()
        header, chunks = await publish_stream(request_iterator)
        info = await self.state.artifacts.publish(header, chunks, tenant=who.tenant)
        return pb.PublishResponse(artifact=info)

    @rpc_errors
    async def OpenUpload(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        if self.data_plane is None:  # no data plane here, or gRPC behind TLS
            return pb.OpenUploadResponse()
        await self.state.artifacts.check_publish(request.header, tenant=who.tenant)
        ticket = self.data_plane.upload_ticket(
            request.header, functools.partial(self.state.artifacts.publish, tenant=who.tenant))
        if ticket is None:  # for now: this publish goes over gRPC, later ones may not
            raise TooMany("too many data plane tickets are out; publish over gRPC")
        return pb.OpenUploadResponse(ticket=ticket)

    @rpc_errors
    async def Release(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        await self.state.artifacts.release(request.key, request.lease, request.reason, request.detail,
                                 tenant=who.tenant)
        return pb.ReleaseResponse()

    @rpc_errors
    async def Fetch(self, request, context):
        who = self.auth.identify(context)
        info, chunks = await self.state.artifacts.fetch(request.key, request.digest, tenant=who.tenant,
                                              offset=request.offset,
                                              as_stored=request.accept_zstd)
        if request.relay_address and self.state.cfg.relay_fanout > 0:
            parent = self.state.relays.assign((who.tenant, info.digest),
                                              validate.relay_address(request.relay_address), info.size)
            if parent is not None:
                self.state.metrics.relays.inc()
                yield pb.FetchChunk(artifact=info, relay_from=parent)
                return
        # Only a committed artifact: one still uploading (whose digest may be stored under
        # another key already) streams from its upload, and ends with it if it fails.
        committed = self.state.uploads.get(scope(who.tenant, request.key)) is None
        bucket = getattr(self.state.store, "bucket", None)
        if request.accept_url and not request.offset and committed and bucket is not None \
                and self.state.cfg.s3_presign_s > 0:
            url = await asyncio.to_thread(bucket.presign, info.digest, self.state.cfg.s3_presign_s)
            self.state.metrics.bucket_urls.inc()
            yield pb.FetchChunk(artifact=info, url=url)
            return
        if request.accept_data_ticket and not request.offset and self.data_plane is not None \
                and committed:
            ticket = await self.data_plane.ticket(info, zstd_ok=request.accept_zstd)
            if ticket is not None:
                self.state.metrics.data_tickets.inc()
                yield pb.FetchChunk(artifact=info, data_ticket=ticket)
                return
        yield pb.FetchChunk(artifact=info)
        async for chunk in chunks:
            yield chunk

    @rpc_errors
    async def KeepAlive(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        ttl = await self.state.artifacts.keepalive(request.key, request.lease, tenant=who.tenant)
        return pb.KeepAliveResponse(ttl_seconds=ttl)

    @rpc_errors
    async def DescribeKey(self, request, context):
        who = self.auth.identify(context)
        return await self.state.records.describe(request.key, tenant=who.tenant)

    @rpc_errors
    async def ListArtifacts(self, request, context):
        who = self.auth.identify(context)
        return await self.state.records.list_artifacts(request.after, request.limit,
                                                       tenant=who.tenant, prefix=request.prefix)

    @rpc_errors
    async def Status(self, request, context):
        who = self.auth.identify(context)
        resp = await self.state.operations.status(tenant=who.tenant)
        if self.advice is not None:
            resp.coordinator_loop_busy = self.advice.busy
            resp.decide_gap_ms = self.advice.gap_ms
        n, p50, p99 = self.state.metrics.recent_etcd_writes()
        resp.etcd_writes_sampled, resp.etcd_write_p50_ms, resp.etcd_write_p99_ms = (
            n, p50 * 1e3, p99 * 1e3)
        return resp

    @rpc_errors
    async def Purge(self, request, context):
        who = self.auth.identify(context)
        who.require_admin()
        resp = await self.state.operations.purge(list(request.keys), list(request.digests), request.reason,
                                      tenant=who.tenant, dry_run=request.dry_run)
        resp.tenant = who.tenant
        return resp

    @rpc_errors
    async def Revoked(self, request, context):
        who = self.auth.identify(context)
        resp = await self.state.operations.revoked(request.since_revision, tenant=who.tenant)
        resp.tenant = who.tenant
        return resp

    @rpc_errors
    async def ReportHits(self, request, context):
        who = self.auth.identify(context)
        who.require_worker()
        host = reporter_host(context.peer() or "")  # a worker: one identity on one host
        self.state.operations.report_hits(request.hits, request.compile_seconds_saved,
                                          tenant=who.tenant, reporter=f"{who.name}@{host}")
        return pb.ReportHitsResponse()

    @rpc_errors
    async def GetManifest(self, request, context):
        who = self.auth.identify(context)
        if not request.job:
            raise InvalidRequest("name the job whose manifest to get")
        validate.job(request.job)
        if request.held_digest:
            validate.digest(request.held_digest)
        return await self.state.manifests.manifest(who.tenant, request.job,
                                                   request.held_digest)

    @rpc_errors
    async def WatchJob(self, request_iterator, context):
        who = self.auth.identify(context)
        async for events in self.state.job_watches.serve(request_iterator, tenant=who.tenant,
                                                         identity=who.name,
                                                         may_publish=who.can_publish):
            yield events

    # -- ahead-of-time compiles -----------------------------------------
    @rpc_errors
    async def ListRecipes(self, request, context):
        who = self.auth.identify(context)
        async for recipe in self.state.farm.list_recipes(who.tenant, request.job):
            yield recipe

    @rpc_errors
    async def SubmitCompiles(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        ids = await self.state.farm.submit(who.tenant, request)
        return pb.SubmitCompilesResponse(task_ids=ids)

    @rpc_errors
    async def ClaimCompile(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        return await self.state.farm.claim(who.tenant, request.worker, request.wait_ms)

    @rpc_errors
    async def RenewClaim(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        ttl = await self.state.farm.renew(who.tenant, request.task_id, request.claim)
        return pb.KeepAliveResponse(ttl_seconds=ttl)

    @rpc_errors
    async def FinishCompile(self, request, context):
        who = self.auth.identify(context)
        who.require_publish()
        await self.state.farm.finish(who.tenant, request)
        return pb.FinishCompileResponse()

    @rpc_errors
    async def Tasks(self, request, context):
        who = self.auth.identify(context)
        return await self.state.farm.tasks(who.tenant, list(request.task_ids))
