"""The worker's CompileCache service: a caching, single-flight proxy.

- Acquire answers HIT from the host cache without a round trip; otherwise it
  asks the coordinator, over one Decide stream per credential that carries
  every local process's decisions (compilecast.decide). When the coordinator
  cannot be reached the answer is COMPILE_LOCALLY at once, so a process never
  waits on a dead service.
- Fetch fills the host cache once per key (one download however many local
  processes ask), then serves every local reader from disk.
- Publish forwards the stream and keeps a copy, so a restarted process on
  this host hits locally.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc

from compilecast import decide, validate, wire
from compilecast.blobstore import RAW_MAGIC, amake_room, aread
from compilecast.blobwriter import OUT_OF_SPACE
from compilecast.coordinator.auth import token_from
from compilecast.coordinator.service import publish_stream
from compilecast.decide import Decider
from compilecast.errors import (
    CorruptBlob,
    InvalidRequest,
    TooMany,
    Unavailable,
    UpstreamError,
)
from compilecast.grpcutil import aio_channel, bearer, rpc_errors, unreachable
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import DataChunk

from . import client
from .bucketurl import with_bucket_url
from .client import UploadRefused
from .dataplane import (
    DATA_PLANE_PIECE,
    RELAY_LEAST,
    DataPlaneBroke,
    answered,
    dial,
    upload_status,
    with_data_plane,
)
from .decisions import HostDecisions
from .dirsync import DirSync
from .fill import (
    _Fill,
    _following,
    _Inflating,
    _Packer,
)
from .handoff import Handoffs
from .hostcache import HostCache
from .metrics import WorkerMetrics
from .relayplane import RelayPlane
from .upstream import (
    HEARTBEAT_S,
    PEER_IDLE_S,
    RESUME_S,
    TRANSFER_S,
    UPSTREAM_IDLE_S,
    WAIT_RETRY_S,
    _forward_publish,
    _heartbeats_until,
    _idle_timeout,
    _matches,
    _relay,
    _ticketed,
    _unless_stalled,
)
from .waits import HostWaits

log = logging.getLogger(__name__)

DEGRADED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_DECIDERS = 64  # upstream Decide streams kept open (one per caller credential)
MAX_PEERS_NOTED = 4096  # peers remembered for a relay data plane that could not be reached


class WorkerService(rpc.CompileCacheServicer):
    def __init__(self, coordinator: str, cache: HostCache, metrics: WorkerMetrics,
                 *, rpc_timeout_s: float, share_binary_timeout_ms: int = 0,
                 decide_gap_s: float = decide.GAP_S,
                 token: str = "", credentials: grpc.ChannelCredentials | None = None,
                 relay_address: str = "", peer_credentials: grpc.ChannelCredentials | None = None,
                 link_store: str = "", local_files: bool = True,
                 data_plane: bool = False, wake_on_host_publish: bool = False,
                 bucket_urls: bool = True) -> None:
        self.share_binary_timeout_ms = share_binary_timeout_ms
        # This host's waiters woken as a publish through us begins (they follow our copy).
        self.wake_on_host_publish = wake_on_host_publish
        # Whole downloads over the coordinator's data plane when it offers one
        # (plaintext only); off once its address could not be connected to.
        self.data_plane = data_plane
        self.local_files = local_files  # hand processes on this host the host cache's files
        self.relay_address = relay_address
        self.link_store = link_store  # a coordinator's store on this filesystem (`up`)
        self._unlinkable: set[str] = set()  # digests whose linked blob failed to verify
        self.peer_credentials = peer_credentials
        self._peers: dict[str, tuple[grpc.aio.Channel, rpc.CompileCacheStub]] = {}
        self.coordinator = coordinator
        self.cache = cache
        self.metrics = metrics
        self.rpc_timeout_s = rpc_timeout_s
        self.decide_gap_s = decide_gap_s  # between two messages of a Decide stream upstream
        self.token = token
        self.channel = aio_channel(coordinator, credentials)
        self.up = wire.stub(self.channel)
        self._fills: dict[tuple[str, str], _Fill] = {}
        self._publishing: dict[tuple[str, str], _Fill] = {}  # publishes through us
        # Publishes go over the coordinator's data plane (with `data_plane`)
        # until it offers no upload tickets; but not the next try of one whose
        # upload broke off.
        self.data_plane_uploads = True
        # A coordinator over a bucket may send this worker to the bucket for the
        # bytes (worker/bucketurl.py); off once the bucket could not be reached.
        self.bucket_urls = bucket_urls
        self._upload_broke: set[tuple[str, str]] = set()
        self.handoffs: Handoffs | None = None  # publishes handed over as files (server.py)
        self.dirs: DirSync | None = None  # the host's synced directories (server.py)
        self.relay_plane: RelayPlane | None = None  # relays sent with sendfile (server.py)
        # Peers whose relay data plane could not be connected to: relayed over gRPC.
        self._no_relay_plane: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._deciders: collections.OrderedDict[tuple, Decider] = collections.OrderedDict()
        self._namespaces: dict[tuple, str] = {}  # upstream metadata -> host-cache namespace
        self._tenants: dict[str, str] = {}  # host-cache namespace -> its tenant, once known
        self._retiring: set[Decider] = set()  # evicted, closed once their waits end
        self.waits = HostWaits(metrics.waits)  # this host's waits for one key go upstream as one
        self.decisions = HostDecisions(metrics.decisions)  # and its requests for one key
        self._joined = [0, 0]  # answers shared from another's request: misses, hits
        self._upstream_answered = metrics.upstream_decision_seconds.labels("answered")
        self._upstream_unreachable = metrics.upstream_decision_seconds.labels("unreachable")
        self.metrics.waiting.set_function(lambda: self.waits.waiting)
        self.streams = decide.Streams()  # local processes' Decide streams
        self.metrics.cache_bytes.set_function(lambda: self.cache.store.stored_bytes)

    async def close(self) -> None:
        for decider in [*self._deciders.values(), *self._retiring]:
            await decider.close()
        await self.channel.close()
        for channel, _ in self._peers.values():
            await channel.close()

    def _peer(self, address: str) -> rpc.CompileCacheStub:
        if address not in self._peers:
            channel = aio_channel(address, self.peer_credentials)
            self._peers[address] = (channel, wire.stub(channel))
        return self._peers[address][1]

    def _credential(self, context) -> tuple[str, tuple]:
        """(host-cache namespace, upstream metadata) for a caller.

        A caller's own bearer token (a per-job token) is forwarded as is and
        gets its own namespace; callers without one act as this worker.
        """
        caller = token_from(context)
        if caller == self.token:  # a peer worker relaying for its host: the same identity
            caller = ""
        token = caller or self.token
        ns = hashlib.sha256(f"caller:{caller}".encode()).hexdigest()[:16] if caller else "host"
        if len(self._namespaces) >= MAX_DECIDERS * 4:
            self._namespaces.pop(next(iter(self._namespaces)))
        self._namespaces[bearer(token)] = ns
        return ns, bearer(token)

    def _namespace(self, md: tuple) -> str:
        """The host-cache namespace of upstream metadata `md`."""
        return self._namespaces.get(md, "host")

    def _local(self, rpc_name: str, exc: grpc.aio.AioRpcError) -> str:
        self.metrics.fallbacks.labels(rpc_name).inc()
        return f"coordinator {self.coordinator} unreachable ({exc.code().name}); compile locally"

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _decider(self, md: tuple) -> Decider:
        """The Decide stream to the coordinator for one upstream credential."""
        decider = self._deciders.pop(md, None)
        if decider is None:
            decider = Decider(self.up, md, timeout_s=self.rpc_timeout_s,
                              gap_s=self.decide_gap_s)
            if len(self._deciders) >= MAX_DECIDERS:  # the least recently used goes
                _, old = self._deciders.popitem(last=False)
                self._retiring.add(old)  # closed at shutdown too, if its waits last that long
                self._spawn(self._retire(old))
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
        answers = [pb.AcquireResponse(decision=pb.HIT, artifact=info) if info else None
                   for info in found]
        ask = [r for r, a in zip(requests, answers, strict=True) if a is None]
        upstream: list[tuple[pb.AcquireResponse, bool]] = []
        if ask:
            start = time.perf_counter()
            try:  # shared with this host's other requests for the key (worker/decisions.py)
                upstream = await self.decisions.decide(md, ask, self._decider(md).decide)
                self._upstream_answered.observe(time.perf_counter() - start)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in DEGRADED:
                    raise _relay(exc) from None
                self._upstream_unreachable.observe(time.perf_counter() - start)
                why = self._local("acquire", exc)
                upstream = [(pb.AcquireResponse(decision=pb.COMPILE_LOCALLY, reason=why), False)
                            for _ in ask]
        it = iter(upstream)
        out = []
        for local in answers:
            if local is not None:  # the host cache's hit: the coordinator never saw it
                self.metrics.lookups.labels("host_hit").inc()
                self.metrics.compile_seconds_saved.inc(local.artifact.compile_time_seconds)
                out.append(local)
                continue
            a, joined = next(it)
            self.metrics.lookups.labels(pb.Decision.Name(a.decision).lower()).inc()
            if joined:  # nor this one: another's request was (for Status)
                self._joined[a.decision == pb.HIT] += 1
                if a.decision == pb.HIT:
                    self.metrics.compile_seconds_saved.inc(a.artifact.compile_time_seconds)
            out.append(a)
        return out

    @rpc_errors
    async def Acquire(self, request, context):
        ns, md = self._credential(context)
        return (await self._acquire_many([request], ns, md))[0]

    @rpc_errors
    async def AcquireMany(self, request, context):
        ns, md = self._credential(context)
        return pb.AcquireManyResponse(responses=await self._acquire_many(request.requests, ns, md))

    @rpc_errors
    async def Decide(self, request_iterator, context):
        ns, md = self._credential(context)
        async for answer in decide.serve(
                request_iterator, lambda rs: self._acquire_many(rs, ns, md),
                wait=lambda r, until: self._wait_once(self._bounded(r), md, until),
                streams=self.streams):
            yield answer

    def _bounded(self, request: pb.WaitRequest) -> pb.WaitRequest:
        """The wait within the operator's share-binary timeout for this host."""
        validate.key(request.key)
        if self.share_binary_timeout_ms > 0:
            request.timeout_ms = min(request.timeout_ms or self.share_binary_timeout_ms,
                                     self.share_binary_timeout_ms)
        return request

    async def _wait_once(self, request: pb.WaitRequest, md: tuple,
                         until_publishing: bool) -> pb.WaitEvent:
        """A wait (`_bounded` already), shared with this host's other waits
        for the key (one upstream wait for all: worker/waits.py) and sent over
        the Decide stream (a message, not a call of its own); an unreachable
        coordinator means COMPILE_LOCALLY."""

        async def upstream(req: pb.WaitRequest, until: bool) -> pb.WaitEvent:
            return await self._decider(md).wait(req, until_publishing=until)

        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms else None
        for pause in (*WAIT_RETRY_S, None):
            try:
                return await self.waits.wait(md, request, until_publishing, upstream)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in DEGRADED:
                    raise _relay(exc) from None
                left = None if deadline is None else deadline - time.monotonic()
                if pause is None or (left is not None and left <= pause):
                    return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                        reason=self._local("wait", exc))
                # A replica stopping (a rolling update) ends its waits: ask
                # again, on a new stream, rather than have every waiter compile.
                log.info("wait for %s was cut off (%s); asking again in %.1fs", request.key,
                         exc.details(), pause, extra={"key": request.key})
                await asyncio.sleep(pause)
                if deadline is not None:
                    request.timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        raise AssertionError("unreachable")

    @rpc_errors
    async def Wait(self, request, context):
        ns, md = self._credential(context)
        request = self._bounded(request)
        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms else None
        event = await self._wait_once(request, md, until_publishing=True)
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
        copy = self._publishing.get((ns, request.key))
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
        yield await self._wait_once(request, md, until_publishing=False)

    @rpc_errors
    async def Publish(self, request_iterator, context):
        ns, md = self._credential(context)
        header, chunks = await publish_stream(request_iterator)
        # Refuse bad headers here: a coordinator that aborts a stream the worker
        # is still sending can surface as a reset (INTERNAL) instead of its status.
        validate.publish_header(header, self.cache.store.max_blob_size)
        return await self._published(ns, md, header, chunks)

    @rpc_errors
    async def OpenUpload(self, request, context):
        """A ticket to hand a publish over as a sealed file (worker/handoff.py);
        none where this worker takes no handoffs (not on a unix socket)."""
        if self.handoffs is None:
            return pb.OpenUploadResponse()
        ns, md = self._credential(context)
        validate.publish_header(request.header, self.cache.store.max_blob_size)
        ticket = self.handoffs.ticket(ns, md, request.header)
        if ticket is None:
            raise TooMany("too many handoff tickets are out; publish over gRPC")
        return pb.OpenUploadResponse(ticket=ticket)

    async def publish_handoff(self, ns: str, md: tuple, header: pb.PublishHeader,
                              chunks: AsyncIterator[DataChunk]) -> pb.PublishResponse:
        """A publish handed over as a file: its chunks, and no digest sent
        last (a header without one gets the digest of the bytes handed)."""
        return await self._published(ns, md, header, chunks, digest_here=True)

    async def _published(self, ns: str, md: tuple, header: pb.PublishHeader, chunks,
                         digest_here: bool = False) -> pb.PublishResponse:
        # This host's processes that fetch it meanwhile read our copy: they
        # follow its file as it is written (stored raw), or read it when done.
        # (The digest may come last: they learn it at the end.)
        copy = _Fill(0)
        copy.info = pb.ArtifactInfo(key=header.key, size=header.size, digest=header.digest)
        ours = self._publishing.setdefault((ns, header.key), copy) is copy
        if ours and self.wake_on_host_publish:  # they fetch now: they follow our copy
            self.metrics.woken_here.inc(self.waits.publishing(
                md, header.key, pb.WaitEvent(decision=pb.WAIT, artifact=copy.info)))
        error: BaseException | None = None
        resp = None
        try:
            resp = await self._publish(ns, md, header, chunks, copy, digest_here)
            return resp
        except BaseException as exc:
            error = Unavailable(f"the publish of {header.key} on this host failed: "
                                f"{exc or type(exc).__name__}")
            raise
        finally:
            if ours:
                del self._publishing[(ns, header.key)]
            await copy.finish(resp.artifact if resp is not None else None, error)

    async def _publish(self, ns: str, md: tuple, header: pb.PublishHeader,
                       chunks, copy: _Fill, digest_here: bool = False) -> pb.PublishResponse:
        writer = copy.writer = self.cache.store.writer(discard_when_unwritable=True)
        with writer:
            await self._make_room(writer, header.size)

            moved = [time.monotonic()]

            # A coordinator that takes zstd gets the publish compressed here, on the
            # holder's host, once: it stores the stream as it comes, and so does
            # the host cache.
            pack = _Packer(writer) if header.lease.accepts_zstd else None

            later = not header.digest  # the holder sends it last: so does this worker
            # As it came: publish_stream sets the digest sent last on `header`.
            head = pb.PublishChunk(header=header)

            async def outgoing() -> AsyncIterator[pb.PublishChunk]:
                """The chunks to send on, each in our copy first."""
                async for chunk in chunks:
                    moved[0] = time.monotonic()
                    if chunk.zstd_data:
                        raise InvalidRequest("a worker takes a publish as data (it compresses "
                                             "for the coordinator itself)")
                    if pack is None:
                        await asyncio.to_thread(writer.write, chunk.data)
                        copy.advance()
                        yield chunk  # as received: its frame goes on without re-encoding
                        continue
                    sent = await asyncio.to_thread(pack.add, chunk)
                    copy.advance()
                    for out in sent:
                        yield out
                if pack is not None:
                    for out in await asyncio.to_thread(pack.end):
                        yield out
                if digest_here and later:  # what our copy hashed to, every byte written
                    header.digest = await asyncio.to_thread(writer.hexdigest)

            sending = outgoing()
            # The first chunk says whether the rest goes raw (a zstd-taking
            # coordinator's gets packed here when it compresses): raw bytes of
            # a big artifact may go over the coordinator's data plane.
            first = await anext(sending, None) if self._uploads(ns, header) else None
            resp = None
            if first is not None and not first.zstd_data:
                resp = await self._upload(ns, md, head.header, header, first, sending, moved)

            async def forward() -> AsyncIterator[pb.PublishChunk]:
                yield head
                if first is not None:
                    yield first
                async for chunk in sending:
                    yield chunk
                if later:  # set by the stream's last message, once every chunk was read
                    yield pb.PublishChunk(digest=header.digest)

            if resp is None:
                resp = await _forward_publish(self.up, forward(), md, moved,
                                              f"the publish of {header.key}")
            await asyncio.to_thread(writer.commit, header.digest, header.size)
        await self._record(ns, resp.artifact, writer)
        self.metrics.bytes.labels("published").inc(header.size)
        return resp

    def _uploads(self, ns: str, header: pb.PublishHeader) -> bool:
        """Whether a publish through us may go over the coordinator's data
        plane: a big one, where the coordinator takes uploads, unless its
        last try here broke off (it goes over gRPC this time)."""
        if (ns, header.key) in self._upload_broke:
            self._upload_broke.discard((ns, header.key))
            return False
        return self.data_plane and self.data_plane_uploads \
            and header.size >= client.DATA_PLANE_UPLOAD_FROM

    async def _upload(self, ns: str, md: tuple, header: pb.PublishHeader,
                      ending: pb.PublishHeader, first, rest: AsyncIterator,
                      moved: list[float]) -> pb.PublishResponse | None:
        """Send a publish's raw bytes (`first`, then `rest`) over the
        coordinator's data plane, as a process's client does (cache.proto,
        OpenUpload); None, with nothing of `rest` read, where they must go
        over gRPC instead. `header` is the publish's header as it came, and
        `ending` the same once `rest` has ended (with a digest sent last). A
        refusal is the coordinator's status, as its Publish stream would have
        ended with; an upload that broke off is UNAVAILABLE, and the holder's
        next try goes over gRPC."""
        try:
            opened = await self.up.OpenUpload(pb.OpenUploadRequest(header=header),
                                              timeout=self.rpc_timeout_s, metadata=md)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # too many tickets out (or too large: its Publish says so)
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _relay(exc) from None
            opened = pb.OpenUploadResponse()  # an older coordinator
        if not opened.HasField("ticket"):
            self.data_plane_uploads = False
            log.info("%s takes publishes over gRPC only", self.coordinator)
            return None
        try:
            sock = await dial(opened.ticket, self.coordinator)
        except DataPlaneBroke as exc:
            self.data_plane = False
            log.info("cannot reach the coordinator's data plane (%s); artifacts go over "
                     "gRPC from now on", exc, extra={"key": header.key})
            return None
        where = "the coordinator's data plane"
        later = not header.digest  # known once `rest` has ended: sent after the bytes
        loop = asyncio.get_running_loop()

        async def send() -> pb.PublishResponse:
            await loop.sock_sendall(sock, wire.DATA_PLANE_UPLOAD + opened.ticket.token)
            await upload_status(loop, sock, where)  # go
            chunk = first
            while chunk is not None:
                if answered(sock):  # refused before the end
                    await upload_status(loop, sock, where)
                    raise OSError(errno.EPROTO, f"{where} answered before the last byte")
                await loop.sock_sendall(sock, chunk.data)
                moved[0] = time.monotonic()
                chunk = await anext(rest, None)
            if later:
                await loop.sock_sendall(sock, ending.digest.encode("ascii"))
            return pb.PublishResponse.FromString(await upload_status(loop, sock, where))

        with sock:
            try:
                try:
                    return await _unless_stalled(asyncio.ensure_future(send()), moved,
                                                 UPSTREAM_IDLE_S, f"the upload of {header.key}")
                except OSError as exc:
                    with contextlib.suppress(OSError, TimeoutError):  # a refusal sent before?
                        await asyncio.wait_for(upload_status(loop, sock, where), 1.0)
                    if len(self._upload_broke) >= 1024:
                        self._upload_broke.clear()
                    self._upload_broke.add((ns, header.key))
                    raise Unavailable(f"the upload of {header.key} to {where} broke off "
                                      f"({exc})") from None
            except UploadRefused as exc:
                raise _relay(exc) from None

    async def _forward(self, method: str, request, context):
        """A unary call passed to the coordinator as is, under the caller's credential."""
        try:
            return await getattr(self.up, method)(request, timeout=self.rpc_timeout_s,
                                                  metadata=self._credential(context)[1])
        except grpc.aio.AioRpcError as exc:
            raise _relay(exc) from None

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
            await self._drop_revoked(self._credential(context)[0], resp.tenant, resp.revoked,
                                     "purged through this worker")
        return resp

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
        mine, others = {ns}, set()
        for other in named:
            known = await self._tenant_of(other)
            if known is not None and tenant:
                (mine if known == tenant else others).add(other)
        for digest in await asyncio.to_thread(self.cache.revoke, digests, named, mine, others):
            self.metrics.revoked.inc()
            log.warning("dropped revoked artifact %s from the host cache (%s)", digest, why)

    async def _tenant_of(self, ns: str) -> str | None:
        """The tenant of host-cache namespace `ns`, asked of the coordinator
        with its credential when not known yet; None when it cannot be."""
        if ns in self._tenants:
            return self._tenants[ns]
        md = next((md for md, n in self._namespaces.items() if n == ns), None)
        if md is None:
            return None
        try:
            resp = await self.up.Revoked(pb.RevokedRequest(), timeout=self.rpc_timeout_s,
                                         metadata=md)
        except grpc.aio.AioRpcError:
            return None
        if resp.tenant:
            self._tenants[ns] = resp.tenant
        return resp.tenant or None

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
                    resp = await self.up.Revoked(
                        pb.RevokedRequest(since_revision=since[md]),
                        timeout=self.rpc_timeout_s, metadata=md)
                    await self._drop_revoked(self._namespace(md), resp.tenant,
                                             [r.digest for r in resp.revocations],
                                             "; ".join(sorted({r.reason for r in
                                                               resp.revocations}))[:200])
                    since[md] = resp.revision
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        log.warning("the coordinator predates revocations; not polling them")
                        return
                    log.debug("polling revocations failed: %s", exc.code().name)
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
        try:
            async for recipe in self.up.ListRecipes(request, timeout=max(60.0, self.rpc_timeout_s),
                                                    metadata=self._credential(context)[1]):
                yield recipe
        except grpc.aio.AioRpcError as exc:
            raise _relay(exc) from None

    # -- Fetch -----------------------------------------------------------
    async def _run_fill(self, fill: _Fill, ns: str, md: tuple, key: str, digest: str) -> None:
        """Download `key` into the host cache once, however many ask, passing
        each chunk on to the fill's readers. The coordinator may point us at a
        peer worker that is downloading (or holds) the same artifact; if the
        peer fails, the rest comes from the coordinator, from where we were."""
        start = time.monotonic()
        info = None
        peer = ""
        relay = self.relay_address
        resumes = list(RESUME_S)
        linked = False
        ticket = self.data_plane
        urls = self.bucket_urls
        try:
            # (Inside the try: a fill that fails to start ends its readers too.)
            writer = fill.writer = self.cache.store.writer(discard_when_unwritable=True)
            with writer:
                while True:
                    # The coordinator's stored zstd (or a peer's relay of it), decoded
                    # here: a tenth of the bytes on the wire. A resumed download is decoded.
                    inflate: _Inflating | None = None
                    request = pb.FetchRequest(key=key, digest=info.digest if info else digest,
                                              relay_address="" if peer else relay,
                                              offset=0 if peer else writer.size,
                                              accept_zstd=not writer.size,
                                              accept_data_ticket=not writer.size and (
                                                  peer not in self._no_relay_plane if peer
                                                  else ticket),
                                              accept_url=not writer.size and not peer and urls)
                    stub = self._peer(peer) if peer else self.up
                    used: list = []
                    try:
                        redirect = ""
                        chunks = stub.Fetch(request, timeout=TRANSFER_S, metadata=md)
                        if request.accept_data_ticket:  # (every other chunk passes straight on)
                            chunks = with_data_plane(chunks, peer or self.coordinator, used,
                                                     RELAY_LEAST if peer else DATA_PLANE_PIECE)
                        if request.accept_url:
                            chunks = with_bucket_url(chunks, used)
                        async for chunk in _idle_timeout(
                                chunks, PEER_IDLE_S if peer else UPSTREAM_IDLE_S):
                            if chunk.HasField("artifact") and info is None:
                                await self._make_room(writer, chunk.artifact.size)
                            if chunk.relay_from:
                                redirect = chunk.relay_from
                                info = chunk.artifact
                                break
                            if chunk.HasField("artifact"):
                                if info is not None and chunk.artifact.digest != info.digest:
                                    raise CorruptBlob(f"{key} changed digest mid-download")
                                if not fill.started:  # readers learn what to expect first
                                    await fill.send(pb.FetchChunk(artifact=chunk.artifact))
                                info = fill.info = chunk.artifact
                                if (not peer and not writer.size
                                        and await self._linked(info.digest)):
                                    linked = True
                                    break  # the download is cancelled: the bytes are here
                            if chunk.zstd_data:
                                if inflate is None:
                                    inflate = _Inflating(key, info, fill, writer)
                                await fill.send_zstd(chunk)  # peers relay the stream as it came
                                await inflate.feed(chunk.zstd_data)
                            elif chunk.data:
                                if inflate is not None:
                                    raise CorruptBlob(f"{key}: zstd_data and data in one stream")
                                # Readers first: they hash it while this worker does.
                                await fill.send(chunk)
                                if not writer.size and request.accept_zstd:
                                    # Sent raw where zstd was welcome: stored raw there, so
                                    # stored raw here, and followed from the first byte
                                    # (host processes, relay peers), not after a probe's MiB.
                                    writer.store_raw()
                                await asyncio.to_thread(writer.write, chunk.data)
                                fill.advance()
                            elif not chunk.HasField("artifact"):
                                await fill.send(chunk)  # a heartbeat: pass it on
                        if used and not linked and writer.size != info.size:
                            raise DataPlaneBroke(f"its data plane's stream ended at byte "
                                                  f"{writer.size} of {info.size}")
                        if used and not linked:
                            (self.metrics.relays.labels("data_plane") if peer
                             else self.metrics.data_plane.labels("taken")).inc()
                    except DataPlaneBroke as exc:
                        if inflate is not None:
                            await inflate.cut(key, "its zstd stream from the data plane was "
                                                   "cut off")
                        if peer and exc.unreachable:  # that peer over gRPC, from here on
                            if len(self._no_relay_plane) < MAX_PEERS_NOTED:
                                self._no_relay_plane.add(peer)
                            log.warning("download of %s: %s's relay data plane: %s; relayed "
                                        "over gRPC", key, peer, exc, extra={"key": key})
                        elif peer:  # as for a failed relay: the rest from the coordinator
                            self.metrics.relays.labels("fallback").inc()
                            log.warning("relay of %s from %s: %s; fetching the rest from the "
                                        "coordinator", key, peer, exc, extra={"key": key})
                            peer, relay = "", ""
                        else:  # the rest (or all) over gRPC, from where the download is
                            ticket, urls, relay = False, False, ""
                            if exc.unreachable:  # from here: never asked for again
                                self.data_plane = self.bucket_urls = False
                            self.metrics.data_plane.labels("fallback").inc()
                            log.warning("download of %s: %s; fetching %s over gRPC", key,
                                        exc, "the rest" if writer.size else "it",
                                        extra={"key": key})
                        continue
                    except (grpc.aio.AioRpcError, TimeoutError) as exc:
                        if not peer:
                            if isinstance(exc, TimeoutError):
                                raise UpstreamError(
                                    grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"coordinator: the fetch of {key} moved nothing for "
                                    f"{UPSTREAM_IDLE_S:g}s") from None
                            if exc.code() != grpc.StatusCode.UNAVAILABLE or not resumes:
                                raise _relay(exc) from None
                            # A replica restarting (a rolling update) or a reset
                            # connection: go on from the bytes already here (served,
                            # never redirected: a peer would start from the first byte).
                            pause, relay = resumes.pop(0), ""
                            if inflate is not None:
                                await inflate.cut(key, "its zstd stream was cut off midway")
                            log.warning("download of %s was cut off at byte %d (%s); resuming "
                                        "in %.0fs", key, writer.size, exc.details(), pause,
                                        extra={"key": key})
                            await asyncio.sleep(pause)
                            continue
                        why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) \
                            else "stalled"
                        log.warning("relay of %s from %s failed (%s) at byte %d; fetching the "
                                    "rest from the coordinator", key, peer, why, writer.size)
                        self.metrics.relays.labels("fallback").inc()
                        peer, relay = "", ""  # asking again: served, never redirected
                        if inflate is not None:
                            await inflate.cut(key, "its zstd stream from a peer was cut off")
                        continue
                    if redirect and not peer and relay:
                        peer = redirect
                        self.metrics.relays.labels("redirected").inc()
                        continue
                    break
                if info is None:
                    raise CorruptBlob(f"coordinator sent no artifact header for {key}")
                if linked:
                    writer.abort()
                    await self._serve_linked(fill, info)
                    await self._record(ns, info, writer)
                    self.metrics.bytes.labels("linked").inc(info.size)
                    await fill.finish(info, None)
                    return
                try:
                    fill.kept = await asyncio.to_thread(writer.commit, info.digest,
                                                        info.size) is not None
                except InvalidRequest as exc:
                    raise CorruptBlob(f"artifact {key} from {peer or 'the coordinator'} failed "
                                      f"verification: {exc}") from None
            await self._record(ns, info, writer)
            self.metrics.fetch_seconds.observe(time.monotonic() - start)
            self.metrics.bytes.labels("relayed_in" if peer else "fetched").inc(info.size)
            await fill.finish(info, None)
        except BaseException as exc:
            await fill.finish(None, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._fills.pop((ns, key), None)

    async def _make_room(self, writer, size: int) -> None:
        """Evict from the host cache until an artifact of `size` fits on its
        disk above cache_min_free_bytes; else pass it on without a copy."""
        if not await amake_room(self.cache.store, size):
            writer.stop_keeping(f"no room for {size} bytes above the free space kept on the "
                                "host cache's disk")

    async def _linked(self, digest: str) -> bool:
        """Whether the blob is now in the host cache by a hard link from the
        coordinator's store on this filesystem (`up`)."""
        if not self.link_store or digest in self._unlinkable:
            return False
        return await asyncio.to_thread(self.cache.store.link, digest, self.link_store)

    async def _serve_linked(self, fill: _Fill, info: pb.ArtifactInfo) -> None:
        """Pass a linked blob to the fill's readers, verifying it as it is
        read. One that does not verify is quarantined here and never linked
        again: the next fill downloads it."""
        try:
            async for piece in aread(self.cache.store, info.digest):
                await fill.send(DataChunk(piece))
        except CorruptBlob:
            self._unlinkable.add(info.digest)
            raise

    async def _record(self, ns: str, info: pb.ArtifactInfo, writer) -> None:
        """Index a committed download or publish in the host cache; one the
        disk had no room for was passed on without a copy (a warning says so)."""
        if not writer.discarded:
            try:
                await asyncio.to_thread(self.cache.record, ns, info)
                return
            except OSError as exc:  # the blob is in place; without its entry it reads as a miss
                if exc.errno not in OUT_OF_SPACE:
                    raise
        self.metrics.uncached.inc()
        log.warning("kept no copy of %s in the host cache: %s", info.key,
                    writer.discarded or "no space left for its entry", extra={"key": info.key})

    async def _serve_blob(self, info: pb.ArtifactInfo, ns: str, key: str,
                          request: pb.FetchRequest):
        if request.accept_local_file and self.local_files:
            # A process on this host reads the host cache's file itself (and
            # verifies it); if the file went meanwhile, it asks again without.
            path = self.cache.store.hand_out(info.digest)
            if path is not None:
                self.metrics.local_files.inc()
                yield pb.FetchChunk(artifact=info, local_path=path)
                return
        yield pb.FetchChunk(artifact=info)
        served = self.metrics.bytes.labels("served")
        try:
            async for chunk in aread(self.cache.store, info.digest, transform=DataChunk.framed,
                                     as_stored=request.accept_zstd):
                served.inc(chunk.size)
                yield chunk
        except CorruptBlob:
            self.metrics.corrupt_blobs.inc()
            self.cache.forget(ns, key)
            raise

    @rpc_errors
    async def Fetch(self, request, context):
        validate.key(request.key)
        if request.digest:
            validate.digest(request.digest)
        if request.offset or request.relay_address:
            raise InvalidRequest("offset and relay_address are for the coordinator")
        ns, md = self._credential(context)
        info = await asyncio.to_thread(self.cache.lookup, ns, request.key)
        publishing = self._publishing.get((ns, request.key))
        # A process on this host follows the host cache's file instead, from
        # the byte it has, once the fill stores the bytes raw (from the first byte
        # when they came raw, else after the first MiB's probe).
        follow = request.accept_growing_file and request.accept_local_file and self.local_files
        if info is None and publishing is not None:
            # A process of this host is publishing it through us: the one asking
            # reads our copy (as it is written, or once it is in), instead of our
            # downloading what we upload.
            followed = False
            async for chunk in self._join_late(publishing, follow):
                followed = followed or chunk.HasField("artifact")
                yield chunk
            if followed:
                return
            info = await asyncio.to_thread(self.cache.lookup, ns, request.key)
        if info is not None and (not request.digest or info.digest == request.digest):
            self.metrics.fetches.labels("host").inc()
            async for chunk in self._serve_blob(info, ns, request.key, request):
                yield chunk
            return
        self.metrics.fetches.labels("coordinator").inc()
        while True:
            fill = self._fills.get((ns, request.key))
            if fill is None:
                # Peers join a running download late: keep its head for them.
                fill = self._fills[(ns, request.key)] = _Fill(
                    _Fill.MAX_BACKLOG if self.relay_address else 0)
                self._spawn(self._run_fill(fill, ns, md, request.key, request.digest))
            reader = fill.join(request.accept_zstd)
            if reader is not None:
                break
            # Joined late: the file from its first byte, as it is written, or
            # wait for the blob (heartbeats meanwhile) and read it from disk;
            # one the host cache had no room for is downloaded again.
            followed = False
            async for chunk in self._join_late(fill, follow):
                followed = followed or chunk.HasField("artifact")
                yield chunk
            if followed:
                return
            info = fill.done.result()
            if fill.kept:
                async for chunk in self._serve_blob(info, ns, request.key, request):
                    yield chunk
                return
        try:
            while not follow or (available := fill.readable()) is None:
                item = await reader.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                self.metrics.bytes.labels("served").inc(len(item.data) + len(item.zstd_data))
                yield item
        finally:
            fill.leave(reader)
        async for chunk in self._following(fill, available):
            yield chunk

    async def relay_ticket(self, request, context) -> pb.FetchChunk | None:
        """For a peer's relay Fetch that takes a data ticket: the artifact's
        header with a ticket of this worker's relay data plane, where its
        bytes are in a file sent as it stands (worker/relayplane.py): the
        host cache file of a download under way, once it is stored raw, or
        the committed blob. None: the fetch goes on over gRPC."""
        if self.relay_plane is None or not request.accept_data_ticket:
            return None
        validate.key(request.key)
        if request.digest:
            validate.digest(request.digest)
        ns, _ = self._credential(context)
        fill = self._fills.get((ns, request.key))
        if fill is not None:
            # Its header and first raw write come within moments of its start.
            deadline = time.monotonic() + HEARTBEAT_S
            while not fill.finished and fill.readable() is None and fill.zstd is not True \
                    and await fill.changed(deadline - time.monotonic()):
                pass
            info = fill.info
            if fill.readable() is not None and _matches(info, request.digest):
                try:
                    f = await asyncio.to_thread(open, fill.writer.path, "rb")
                except OSError:  # committed (renamed) meanwhile: the gRPC path reads the blob
                    return None
                return _ticketed(info, self.relay_plane.offer(f, len(RAW_MAGIC) + info.size,
                                                              fill))
            if not fill.finished:  # a zstd stream, or not kept: the peer follows it over gRPC
                return None
        info = await asyncio.to_thread(self.cache.lookup, ns, request.key)
        if info is None or not _matches(info, request.digest):
            return None
        f = await asyncio.to_thread(self.cache.store.open_sendable, info.digest,
                                    request.accept_zstd)
        if f is None:
            return None
        return _ticketed(info, self.relay_plane.offer(f, os.fstat(f.fileno()).st_size))

    def _following(self, fill: _Fill, available: int):
        self.metrics.growing_files.inc()
        return _following(fill, available)

    async def _join_late(self, fill: _Fill, follow: bool):
        """A fetch that joins `fill` after it began. With `follow`, it follows
        the fill's file from its first byte, once it is one to follow
        (heartbeats until then): the header, which carries the artifact, then
        _following. Otherwise, or when the fill ends without such a file,
        heartbeats until the fill is done (the caller reads the committed
        blob then)."""
        if follow:
            while not fill.finished and fill.readable() is None:
                if not await fill.changed(HEARTBEAT_S):
                    yield pb.FetchChunk()
            if (available := fill.readable()) is not None:
                yield pb.FetchChunk(artifact=fill.info)
                async for chunk in self._following(fill, available):
                    yield chunk
                return
        async for beat in _heartbeats_until(fill.done):
            yield beat

    @rpc_errors
    async def Status(self, request, context):
        resp = pb.StatusResponse(role="worker", upstream=f"coordinator {self.coordinator}")
        # Within the caller's deadline, so that a slow or unreachable
        # coordinator is reported as such rather than timing the caller out.
        left = context.time_remaining()
        timeout = self.rpc_timeout_s if left is None else max(0.1, min(self.rpc_timeout_s,
                                                                      left * 0.7))
        try:
            up = await self.up.Status(request, timeout=timeout,
                                      metadata=self._credential(context)[1])
        except grpc.aio.AioRpcError as exc:
            resp.upstream_problem = f"coordinator {unreachable(exc)}"
        else:
            resp.CopyFrom(up)
            # Hits this worker answered from its host cache, and answers it shared
            # among its processes, never reach the coordinator.
            reg = self.metrics.registry
            resp.hits += int(reg.get_sample_value("compilecast_worker_lookups_total",
                                                  {"result": "host_hit"}) or 0)
            resp.hits += self._joined[True]
            resp.misses += self._joined[False]
            resp.compile_seconds_saved += float(reg.get_sample_value(
                "compilecast_worker_saved_compile_seconds_total") or 0.0)
            resp.role = "worker"
            resp.upstream = f"coordinator {self.coordinator}"
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
        resp.host_uncached = int(self.metrics.registry.get_sample_value(
            "compilecast_worker_uncached_total") or 0)
        if self.dirs is not None:
            resp.directories.extend(await asyncio.to_thread(self.dirs.status))
        resp.pjrt_compiles.extend(self.metrics.pjrt_status())
