"""The worker's Fetch: a host cache hit served from disk, a miss downloaded
once however many of the host's processes ask (a fill, worker/daemon/fill.py), from
the coordinator, a peer worker it points to, its data plane or its bucket,
and passed on to every reader as it arrives. WorkerService (worker/daemon/service.py)
is made of this and the rest of the API.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from compilecast import retry, validate
from compilecast.blobstore import aread
from compilecast.errors import CorruptBlob, InvalidRequest, Status, UpstreamError
from compilecast.negotiate import (
    GROWING_HOST_FILE,
    HOST_FILE,
    WORKER_FILL,
    Ladder,
    Route,
    RouteEnd,
    RouteFailed,
    Routes,
    acarry,
)
from compilecast.serving import Background
from compilecast.streams import RAW_MAGIC, idle_timeout, opened
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import HEARTBEAT_S, TRANSFER_S, DataChunk

from .bucketurl import BucketUrl
from .dataplane import DataPlaneFill, FillEnd, RelayFill
from .fill import Fill, Inflating, following_fill
from .hostcache import HostCache, HostCopies
from .metrics import WorkerMetrics
from .relayplane import RelayPlane
from .upstream import (
    PEER_IDLE_S,
    UPSTREAM_IDLE_S,
    CoordinatorLink,
    Relayed,
    digest_matches,
    heartbeats_until,
    ticketed,
)

log = logging.getLogger("compilecast.worker.daemon.service")


class HostFiles(RouteEnd):
    """This host's processes read the host cache's files themselves: the
    file a fetch is answered with, whole (LOCAL_FILE), or as a fill writes
    it (GROWING_FILE, Fill's followers)."""

    route = Route.LOCAL_FILE
    also = (Route.GROWING_FILE,)

    def __init__(self, cache: HostCache, metrics: WorkerMetrics) -> None:
        self.cache = cache
        self.metrics = metrics

    def answer(self, info: pb.ArtifactInfo) -> pb.FetchChunk | None:
        """A fetch's answer by the host cache's file, which the process reads
        and verifies (if the file went meanwhile, it asks again without);
        None when the file is not there to hand out."""
        path = self.cache.store.hand_out(info.digest)
        if path is None:
            return None
        self.metrics.local_files.inc()
        return pb.FetchChunk(artifact=info, local_path=path)


@dataclass
class _Download:
    """Where a fill's download comes from now, and what it has."""

    key: str
    digest: str
    relay: str  # this worker's relay address, offered to the coordinator ("": none)
    ladder: Ladder  # the routes it may still take
    # The pauses of the resumes left (retry.RESUME: a download the coordinator
    # cut off goes on from the byte it had).
    resumes: list[float] = field(default_factory=lambda: list(retry.RESUME.pauses))
    info: pb.ArtifactInfo | None = None
    peer: str = ""  # the peer worker relaying it ("": the coordinator)
    inflate: Inflating | None = None  # decoding this attempt's zstd stream


class Fetches:
    """Fetch, and the host cache's fills: one download per key however many ask."""

    def __init__(self, link: CoordinatorLink, cache: HostCache, copies: HostCopies,
                 metrics: WorkerMetrics, routes: Routes, background: Background, *,
                 relay_address: str = "") -> None:
        self.link = link
        self.cache = cache
        self.copies = copies
        self.metrics = metrics
        self.routes = routes
        self.background = background
        self.relay_address = relay_address  # this worker's, offered to the coordinator
        self.fills: dict[tuple[str, str], Fill] = {}  # (namespace, key) -> its download
        self.relay_plane: RelayPlane | None = None  # relays sent with sendfile (server.py)
        # A fill's ends of its routes (negotiate.WORKER_FILL), by where its bytes come from.
        self.from_peer: tuple[FillEnd, ...] = (RelayFill(),)
        self.from_coordinator: tuple[FillEnd, ...] = (DataPlaneFill(), BucketUrl())
        self.host_files = HostFiles(cache, metrics)  # this host's processes' routes

    async def _run_fill(self, fill: Fill, ns: str, md: tuple, key: str, digest: str) -> None:
        """Download `key` into the host cache once, however many ask, passing
        each chunk on to the fill's readers. The coordinator may point us at a
        peer worker that is downloading (or holds) the same artifact; if the
        peer fails, the rest comes from the coordinator, from where we were."""
        start = time.monotonic()
        dl = _Download(key, digest, self.relay_address, self.routes.ladder(WORKER_FILL, key=key))
        try:
            # (Inside the try: a fill that fails to start ends its readers too.)
            writer = fill.writer = self.cache.store.writer(discard_when_unwritable=True)
            with writer:
                while await acarry(dl.ladder, lambda _: self._attempt(dl, fill, md, writer)):
                    pass
                if dl.info is None:
                    raise CorruptBlob(f"coordinator sent no artifact header for {key}")
                try:
                    fill.kept = await asyncio.to_thread(writer.commit, dl.info.digest,
                                                        dl.info.size) is not None
                except InvalidRequest as exc:
                    raise CorruptBlob(f"artifact {key} from {dl.peer or 'the coordinator'} "
                                      f"failed verification: {exc}") from None
            await self.copies.record(ns, dl.info, writer)
            self.metrics.fetch_seconds.observe(time.monotonic() - start)
            self.metrics.bytes.labels("relayed_in" if dl.peer else "fetched").inc(dl.info.size)
            await fill.finish(dl.info, None)
        except BaseException as exc:
            await fill.finish(None, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.fills.pop((ns, key), None)

    def _fetch_request(self, dl: _Download, writer) -> pb.FetchRequest:
        """The next Fetch of `dl`: the rest, from where it is. A peer relays
        from the first byte; only a first request takes zstd, a ticket or a URL."""
        fresh = not writer.size
        request = pb.FetchRequest(
            key=dl.key, digest=dl.info.digest if dl.info else dl.digest,
            relay_address="" if dl.peer else dl.relay,
            offset=0 if dl.peer else writer.size,
            accept_zstd=fresh)
        if fresh:
            dl.ladder.offer(request, dl.peer, only=[end.route for end in self._ends(dl)])
        return request

    def _ends(self, dl: _Download) -> tuple[FillEnd, ...]:
        return self.from_peer if dl.peer else self.from_coordinator

    async def _attempt(self, dl: _Download, fill: Fill, md: tuple, writer) -> bool:
        """One Fetch of what is missing, from the coordinator or a peer;
        whether another should follow (a redirect, a resume, a peer that
        failed). RouteFailed where a route failed: the ladder's loop asks
        again without it."""
        # The coordinator's stored zstd (or a peer's relay of it) is decoded
        # here: a tenth of the bytes on the wire. A resumed download is decoded.
        dl.inflate = None
        request = self._fetch_request(dl, writer)
        stub = self.link.peer(dl.peer) if dl.peer else self.link.up
        used: list[FillEnd] = []
        try:
            chunks = stub.Fetch(request, timeout=TRANSFER_S, metadata=md)
            for end in self._ends(dl):  # each route offered takes its answer's place
                if dl.ladder.offered(request, end.route):
                    chunks = end.chunks(chunks, dl.peer or self.link.address, used, dl.peer)
            redirect = await self._take(dl, fill, writer, request, chunks)
            if used and dl.info is not None and writer.size != dl.info.size:
                raise used[0].failed(f"its stream ended at byte {writer.size} of "
                                     f"{dl.info.size}", where=dl.peer)
            if used:
                (self.metrics.relays.labels("data_plane") if dl.peer
                 else self.metrics.data_plane.labels("taken")).inc()
        except RouteFailed as failure:  # the ladder's loop (acarry) decides what it means
            await self._rest_after(dl, writer, failure)
            raise
        except CorruptBlob as exc:
            if not used:  # the gRPC stream's bytes: the fill fails on them
                raise
            # What a data plane sent does not decode: that route's failure, not
            # the blob's; the rest comes over the gRPC stream.
            undecoded = used[0].failed(f"what it sent does not decode ({exc})", where=dl.peer)
            await self._rest_after(dl, writer, undecoded)
            raise undecoded from None
        except (Relayed, TimeoutError) as exc:
            await self._fetch_broke(dl, writer, exc)
            return True
        if redirect and not dl.peer and dl.relay:
            dl.peer = redirect
            self.metrics.relays.labels("redirected").inc()
            return True
        return False

    async def _take(self, dl: _Download, fill: Fill, writer, request: pb.FetchRequest,
                    chunks) -> str:
        """Pass one Fetch's chunks on to the readers and into the host cache;
        the peer the coordinator redirected to ("": none)."""
        async for chunk in idle_timeout(chunks, PEER_IDLE_S if dl.peer else UPSTREAM_IDLE_S):
            if chunk.HasField("artifact") and dl.info is None:
                await self.copies.make_room(writer, chunk.artifact.size)
            if chunk.relay_from:
                dl.info = chunk.artifact
                return chunk.relay_from
            if chunk.HasField("artifact"):
                await self._header(dl, fill, chunk.artifact)
            if chunk.zstd_data:
                if dl.inflate is None:
                    dl.inflate = Inflating(dl.key, dl.info, fill, writer)
                await fill.send_zstd(chunk)  # peers relay the stream as it came
                await dl.inflate.feed(chunk.zstd_data)
            elif chunk.data:
                await self._take_data(dl, fill, writer, request, chunk)
            elif not chunk.HasField("artifact"):
                await fill.send(chunk)  # a heartbeat: pass it on
        return ""

    async def _header(self, dl: _Download, fill: Fill, artifact: pb.ArtifactInfo) -> None:
        """Take an artifact header."""
        if dl.info is not None and artifact.digest != dl.info.digest:
            raise CorruptBlob(f"{dl.key} changed digest mid-download")
        if not fill.started:  # readers learn what to expect first
            await fill.send(pb.FetchChunk(artifact=artifact))
        dl.info = fill.info = artifact

    async def _take_data(self, dl: _Download, fill: Fill, writer, request: pb.FetchRequest,
                         chunk) -> None:
        if dl.inflate is not None:
            raise CorruptBlob(f"{dl.key}: zstd_data and data in one stream")
        # Readers first: they hash it while this worker does.
        await fill.send(chunk)
        if not writer.size and request.accept_zstd:
            # Sent raw where zstd was welcome: stored raw there, so stored raw
            # here, and followed from the first byte (host processes, relay
            # peers), not after a probe's MiB.
            writer.store_raw()
        await asyncio.to_thread(writer.write, chunk.data)
        fill.advance()

    async def _rest_after(self, dl: _Download, writer, failure: RouteFailed) -> None:
        """A route of the fill's failed: where the rest comes from."""
        if dl.inflate is not None:
            # Nothing of it decoded (its first frame was bad): the copy starts
            # again whole, and is kept; else it is not (its stream is cut).
            await dl.inflate.cut(dl.key, "its zstd stream over another route was cut off",
                                 keep=writer.restart())
        if dl.peer and not failure.lasting:  # as for a failed relay: the rest from the coordinator
            self.metrics.relays.labels("fallback").inc()
            log.warning("relay of %s from %s: %s; fetching the rest from the coordinator",
                        dl.key, dl.peer, failure, extra={"key": dl.key})
            dl.peer, dl.relay = "", ""
        elif not dl.peer:  # the rest from where the download is: never redirected
            dl.relay = ""
            self.metrics.data_plane.labels("fallback").inc()
            log.warning("download of %s: %s; fetching %s without it", dl.key, failure,
                        "the rest" if writer.size else "it", extra={"key": dl.key})

    async def _fetch_broke(self, dl: _Download, writer,
                           exc: Relayed | TimeoutError) -> None:
        """A Fetch failed: resume from the coordinator (a peer's failure, or a
        replica restarting), or raise what ends the fill."""
        if not dl.peer:
            if isinstance(exc, TimeoutError):
                raise UpstreamError(Status.DEADLINE_EXCEEDED,
                                    f"coordinator: the fetch of {dl.key} moved nothing for "
                                    f"{UPSTREAM_IDLE_S:g}s") from None
            if not retry.RESUME.when(exc) or not dl.resumes:
                raise exc from None
            # A replica restarting (a rolling update) or a reset connection: go
            # on from the bytes already here (served, never redirected: a peer
            # would start from the first byte).
            pause, dl.relay = dl.resumes.pop(0), ""
            if dl.inflate is not None:
                await dl.inflate.cut(dl.key, "its zstd stream was cut off midway")
            log.warning("download of %s was cut off at byte %d (%s); resuming in %.0fs",
                        dl.key, writer.size, exc.details, pause, extra={"key": dl.key})
            await asyncio.sleep(pause)
            return
        why = exc.code.name if isinstance(exc, Relayed) else "stalled"
        log.warning("relay of %s from %s failed (%s) at byte %d; fetching the rest from the "
                    "coordinator", dl.key, dl.peer, why, writer.size)
        self.metrics.relays.labels("fallback").inc()
        dl.peer, dl.relay = "", ""  # asking again: served, never redirected
        if dl.inflate is not None:
            await dl.inflate.cut(dl.key, "its zstd stream from a peer was cut off")

    async def _serve_blob(self, info: pb.ArtifactInfo, ns: str, key: str,
                          request: pb.FetchRequest):
        if self.routes.answers(request, HOST_FILE):
            answer = self.host_files.answer(info)
            if answer is not None:
                yield answer
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

    async def fetch(self, ns: str, md: tuple, request: pb.FetchRequest
                    ) -> AsyncIterator[pb.FetchChunk | DataChunk]:
        """A Fetch by a caller of namespace `ns`, with upstream metadata `md`."""
        validate.key(request.key)
        if request.digest:
            validate.digest(request.digest)
        if request.offset or request.relay_address:
            raise InvalidRequest("offset and relay_address are for the coordinator")
        info = await asyncio.to_thread(self.cache.lookup, ns, request.key)
        publishing = self.copies.publishing.get((ns, request.key))
        # A process on this host follows the host cache's file instead, from
        # the byte it has, once the fill stores the bytes raw (from the first byte
        # when they came raw, else after the first MiB's probe).
        follow = request.accept_local_file and self.routes.answers(request, GROWING_HOST_FILE)
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
            fill = self._fill(ns, md, request.key, request.digest)
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

    def _fill(self, ns: str, md: tuple, key: str, digest: str) -> Fill:
        """The host cache's download of `key`: the one under way, else a new one."""
        fill = self.fills.get((ns, key))
        if fill is None:
            # Peers join a running download late: keep its head for them.
            fill = self.fills[(ns, key)] = Fill(Fill.MAX_BACKLOG if self.relay_address else 0)
            self.background.spawn(self._run_fill(fill, ns, md, key, digest))
        return fill

    async def prefetch(self, ns: str, md: tuple, key: str, digest: str) -> bool:
        """Bring `key`'s artifact (`digest`) into the host cache, downloaded
        once however many ask, without reading it: whether the host cache
        kept it. Raises what the download failed with (a purged or lost
        artifact: NOT_FOUND; bytes that do not verify)."""
        info = await asyncio.to_thread(self.cache.lookup, ns, key)
        if info is not None and info.digest == digest:
            return True
        fill = self._fill(ns, md, key, digest)
        got = await asyncio.shield(fill.done)
        if got is not None and got.digest != digest:
            raise CorruptBlob(f"{key} is now {got.digest}, not {digest}")
        return fill.kept

    async def relay_ticket(self, ns: str, request: pb.FetchRequest) -> pb.FetchChunk | None:
        """For a peer's relay Fetch that takes a data ticket: the artifact's
        header with a ticket of this worker's relay data plane, where its
        bytes are in a file sent as it stands (worker/daemon/relayplane.py): the
        host cache file of a download under way, once it is stored raw, or
        the committed blob. None: the fetch goes on over gRPC."""
        if self.relay_plane is None or not request.accept_data_ticket:
            return None
        validate.key(request.key)
        if request.digest:
            validate.digest(request.digest)
        fill = self.fills.get((ns, request.key))
        if fill is not None:
            # Its header and first raw write come within moments of its start.
            deadline = time.monotonic() + HEARTBEAT_S
            while not fill.finished and fill.readable() is None and fill.zstd is not True \
                    and await fill.changed(deadline - time.monotonic()):
                pass
            info = fill.info
            if fill.readable() is not None and info is not None and fill.writer is not None \
                    and digest_matches(info, request.digest):
                try:
                    f = await opened(open, fill.writer.path, "rb")
                except OSError:  # committed (renamed) meanwhile: the gRPC path reads the blob
                    return None
                return ticketed(info, self.relay_plane.offer(f, len(RAW_MAGIC) + info.size,
                                                              fill))
            if not fill.finished:  # a zstd stream, or not kept: the peer follows it over gRPC
                return None
        info = await asyncio.to_thread(self.cache.lookup, ns, request.key)
        if info is None or not digest_matches(info, request.digest):
            return None
        sendable = await opened(self.cache.store.open_sendable, info.digest,
                                request.accept_zstd)
        if sendable is None:
            return None
        return ticketed(info, self.relay_plane.offer(sendable,
                                                     os.fstat(sendable.fileno()).st_size))

    def _following(self, fill: Fill, available: int):
        self.metrics.growing_files.inc()
        return following_fill(fill, available)

    async def _join_late(self, fill: Fill, follow: bool):
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
        async for beat in heartbeats_until(fill.done):
            yield beat
