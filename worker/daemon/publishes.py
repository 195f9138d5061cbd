"""The worker's publishes: a process's Publish stream (or the memory file it
hands over, worker/daemon/handoff.py) forwarded to the coordinator, over its data
plane where it offers one, while the worker keeps a copy in its host cache
and this host's waiters may follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import AsyncIterator

from compilecast import validate, wire
from compilecast.errors import (
    InvalidRequest,
    Status,
    TooMany,
    Unavailable,
)
from compilecast.negotiate import WORKER_PUBLISH, Ends, Ladder, Route, RouteEnd, Routes, acarry
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk, publish_stream

from ..inprocess.received import UploadRefused
from .dataplane import (
    answered,
    dial,
    upload_status,
)
from .fill import (
    Fill,
    Packer,
)
from .handoff import Handoffs
from .hostcache import HostCache, HostCopies
from .metrics import WorkerMetrics
from .upstream import (
    UPSTREAM_IDLE_S,
    CoordinatorLink,
    Relayed,
    forward_publish,
    relay_error,
    unless_stalled,
)
from .waits import HostWaits

log = logging.getLogger("compilecast.worker.daemon.service")


class Publishes:
    """Publish, OpenUpload and the handed-over publishes of this host's processes."""

    def __init__(self, link: CoordinatorLink, cache: HostCache, copies: HostCopies,
                 metrics: WorkerMetrics, routes: Routes, waits: HostWaits, *,
                 wake_on_host_publish: bool = False) -> None:
        self.link = link
        self.cache = cache
        self.copies = copies
        self.metrics = metrics
        self.routes = routes
        self.waits = waits
        # This host's waiters woken as a publish through us begins (they follow our copy).
        self.wake_on_host_publish = wake_on_host_publish
        self.handoffs: Handoffs | None = None  # publishes handed over as files (server.py)
        self.senders = Ends[DataPlaneUpload]([DataPlaneUpload(link)])  # negotiate.WORKER_PUBLISH

    async def publish(self, ns: str, md: tuple,
                      request_iterator: AsyncIterator[pb.PublishChunk]) -> pb.PublishResponse:
        """A Publish stream of a caller of namespace `ns` (upstream metadata `md`)."""
        header, chunks = await publish_stream(request_iterator)
        # Refuse bad headers here: a coordinator that aborts a stream the worker
        # is still sending can surface as a reset (INTERNAL) instead of its status.
        validate.publish_header(header, self.cache.store.max_blob_size)
        return await self._published(ns, md, header, chunks)

    async def open_upload(self, ns: str, md: tuple,
                          request: pb.OpenUploadRequest) -> pb.OpenUploadResponse:
        """A ticket to hand a publish over as a sealed file (worker/daemon/handoff.py);
        none where this worker takes no handoffs (not on a unix socket)."""
        if self.handoffs is None:
            return pb.OpenUploadResponse()
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
        copy = Fill(0)
        copy.info = pb.ArtifactInfo(key=header.key, size=header.size, digest=header.digest)
        ours = self.copies.publishing.setdefault((ns, header.key), copy) is copy
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
                del self.copies.publishing[(ns, header.key)]
            await copy.finish(resp.artifact if resp is not None else None, error)

    async def _publish(self, ns: str, md: tuple, header: pb.PublishHeader,
                       chunks, copy: Fill, digest_here: bool = False) -> pb.PublishResponse:
        writer = copy.writer = self.cache.store.writer(discard_when_unwritable=True)
        with writer:
            await self.copies.make_room(writer, header.size)

            moved = [time.monotonic()]

            # The publish goes on compressed here, on the holder's host, once:
            # the coordinator stores the stream as it comes, and so does the
            # host cache.
            pack = Packer(writer)

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
                    sent = await asyncio.to_thread(pack.add, chunk)
                    copy.advance()
                    for out in sent:
                        yield out
                for out in await asyncio.to_thread(pack.end):
                    yield out
                if digest_here and later:  # what our copy hashed to, every byte written
                    header.digest = await asyncio.to_thread(writer.hexdigest)

            sending = outgoing()
            where = f"{ns}/{header.key}"  # an upload of it that broke: its next try over gRPC
            # The first chunk, once read: it says whether the rest goes raw (it
            # is packed here when it compresses). Raw bytes of a big artifact
            # may go over the coordinator's data plane.
            first: list[pb.PublishChunk | None] = []

            async def forward() -> AsyncIterator[pb.PublishChunk]:
                yield head
                if first and first[0] is not None:
                    yield first[0]
                async for chunk in sending:
                    yield chunk
                if later:  # set by the stream's last message, once every chunk was read
                    yield pb.PublishChunk(digest=header.digest)

            async def attempt(ladder: Ladder) -> pb.PublishResponse:
                upload = self.senders.first(ladder, header.size, where) if not first else None
                if upload is not None:
                    first.append(await anext(sending, None))
                    if first[0] is not None and not first[0].zstd_data:
                        return await upload.send(md, head.header, header, first[0], sending,
                                                 moved, ladder, where)
                return await forward_publish(self.link.up, forward(), md, moved,
                                             f"the publish of {header.key}")

            resp = await acarry(self.routes.ladder(WORKER_PUBLISH, key=header.key), attempt)
            await asyncio.to_thread(writer.commit, header.digest, header.size)
        await self.copies.record(ns, resp.artifact, writer)
        self.metrics.bytes.labels("published").inc(header.size)
        return resp


class UploadTickets(RouteEnd):
    """The coordinator's upload tickets (OpenUpload), which a publish over
    its data plane goes with."""

    route = Route.UPLOAD_TICKET

    def __init__(self, link: CoordinatorLink) -> None:
        self.link = link

    async def open(self, md: tuple, header: pb.PublishHeader) -> pb.DataTicket:
        try:
            opened = await self.link.up.OpenUpload(pb.OpenUploadRequest(header=header),
                                                   timeout=self.link.rpc_timeout_s, metadata=md)
        except Relayed as exc:
            if exc.code == Status.RESOURCE_EXHAUSTED:
                # Too many tickets out (or too large: its Publish says so).
                raise self.failed(exc.details) from None
            raise
        if not opened.HasField("ticket"):
            raise self.failed(f"{self.link.address} offers no upload tickets", lasting=True)
        return opened.ticket


class DataPlaneUpload(RouteEnd):
    """A publish's raw bytes over the coordinator's data plane, for a ticket;
    it suits big publishes only (negotiate.UPLOAD_FROM, the way's)."""

    route = Route.DATA_PLANE

    def __init__(self, link: CoordinatorLink) -> None:
        self.link = link
        self.tickets = UploadTickets(link)

    async def send(self, md: tuple, header: pb.PublishHeader, ending: pb.PublishHeader,
                   first, rest: AsyncIterator, moved: list[float], ladder: Ladder,
                   where: str) -> pb.PublishResponse:
        """Send a publish's raw bytes (`first`, then `rest`) over the
        coordinator's data plane, as a process's client does (cache.proto,
        OpenUpload); a route's failure, with nothing of `rest` read, where
        they must go over gRPC instead. `header` is the publish's header as it
        came, and `ending` the same once `rest` has ended (with a digest sent
        last). A refusal is the coordinator's status, as its Publish stream
        would have ended with; an upload that broke off is UNAVAILABLE, and
        the holder's next try goes over gRPC (the route is off toward
        `where`, the artifact)."""
        ticket = await self.tickets.open(md, header)
        sock = await dial(ticket, self.link.address, self)
        where_to = "the coordinator's data plane"
        later = not header.digest  # known once `rest` has ended: sent after the bytes
        loop = asyncio.get_running_loop()

        async def send() -> pb.PublishResponse:
            await loop.sock_sendall(sock, wire.DATA_PLANE_UPLOAD + ticket.token)
            await upload_status(loop, sock, where_to)  # go
            chunk = first
            while chunk is not None:
                if answered(sock):  # refused before the end
                    await upload_status(loop, sock, where_to)
                    raise OSError(errno.EPROTO, f"{where_to} answered before the last byte")
                await loop.sock_sendall(sock, chunk.data)
                moved[0] = time.monotonic()
                chunk = await anext(rest, None)
            if later:
                await loop.sock_sendall(sock, ending.digest.encode("ascii"))
            return pb.PublishResponse.FromString(await upload_status(loop, sock, where_to))

        with sock:
            try:
                try:
                    return await unless_stalled(asyncio.ensure_future(send()), moved,
                                                 UPSTREAM_IDLE_S, f"the upload of {header.key}")
                except OSError as exc:
                    with contextlib.suppress(OSError, TimeoutError):  # a refusal sent before?
                        await asyncio.wait_for(upload_status(loop, sock, where_to), 1.0)
                    ladder.failed(self.failed(f"the upload broke off ({exc})", lasting=True,
                                              where=where))
                    raise Unavailable(f"the upload of {header.key} to {where_to} broke off "
                                      f"({exc})") from None
            except UploadRefused as exc:
                raise relay_error(exc) from None
