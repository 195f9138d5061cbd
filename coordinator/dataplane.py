"""The data plane: artifact bytes over plain TCP, sent with sendfile.

A fetch over gRPC costs both ends per-message work in Python for every
512 KiB: the coordinator reads, frames and queues each chunk, the client
parses each message and copies its bytes out. For the artifacts this system
exists for (hundreds of MB to GB) that work, not the network, bounds a
fetch, and on a pod every host fetches at once. So a fetch of a whole,
committed artifact may be answered with a ticket instead (FetchChunk.
data_ticket: an address and a one-time token, issued only over the
authenticated Fetch call). The client connects, writes "CCGET01\\n" and the
token, and the coordinator sends the blob's file as it is stored with
sendfile: the kernel moves the bytes; no Python touches them here, and the
client reads them straight into the bytes object it returns.

What a ticket may send:
- only a blob this replica wrote or verified within store_reverify_s, in the
  same unchanged file (ArtifactStore.open_sendable); anything else goes over
  gRPC, whose read verifies it. The file is opened when the ticket is issued
  and sent from that open file, so an eviction or a quarantine in between
  cannot swap it;
- one connection, within TICKET_S of the Fetch; an unknown, used or expired
  token gets the connection closed without a byte.
Clients verify size and digest of what they receive, as on every path, and
fetch over gRPC on any failure. The token stands in for the caller's
credential for one blob for a few seconds, so the data plane is offered only
where the gRPC port is plaintext too: a coordinator with TLS answers every
fetch over gRPC.

Publishes come the other way (OpenUpload). A Publish stream costs the
coordinator gRPC's receive and a Python message per chunk: about 0.48
CPU-seconds for 187 MB here, on the path of every waiter. An upload ticket is
issued, over the authenticated OpenUpload call, only to the lease holder
whose header passes every check a Publish makes before its first byte. The
client connects, writes "CCPUT01\\n" and the token, and on a status frame
saying go, sends the bytes (and the digest after them, when the header has
none). A thread reads them in CHUNK pieces off the socket, and they are
published exactly as a Publish stream with that header would be
(Artifacts.publish: the lease, the digest, the store and the index
are all checked again). The last status frame says how it ended: the
PublishResponse, or the status code and message a Publish would have ended
with.

Waits may go on here too (Wait with accept_data_wait). A waiting process
blocked in a plain socket's recv costs nothing while it waits, where an open
Wait stream costs it gRPC's wake-ups (~3 CPU-ms a second; 63 waiters beside
one compile on 2 cores slowed it by a tenth: BENCHMARKS.md). And a HIT is
followed by the blob on the same connection: no Fetch call, no second
connection, for every waiter at the moment of the publish. The ticket,
issued over the authenticated Wait call, holds the wait as that call would
have made it (key, requester, tenant, rights, deadline); the connection runs
it, sends the status frame with the event that ends it, and after a HIT the
blob as a "CCGET01" ticket would (only a trusted one; else the client
fetches). The client closing the connection ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from compilecast import validate
from compilecast.deadline import Deadline
from compilecast.decide import ending_event
from compilecast.errors import CompilecastError
from compilecast.store import ArtifactStore
from compilecast.streams import CHUNK, opened
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DATA_PLANE_REQUEST as REQUEST_MAGIC
from compilecast.wire import DATA_PLANE_UPLOAD as UPLOAD_MAGIC
from compilecast.wire import DATA_PLANE_WAIT as WAIT_MAGIC
from compilecast.wire import (
    REQUEST_S,
    TICKET_S,
    UNACKED_S,
    DataChunk,
    TicketServer,
    data_plane_request,
    refusal_frame,
    status_frame,
)

from .metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

MAX_TICKETS = 4096  # outstanding tickets (each holds an open file); past it, gRPC
MAX_CONNECTIONS = 1024  # open at once; past it a connection is closed at once (its client: gRPC)
UPLOAD_STALL_S = 60.0  # an upload that sends nothing for this long is given up
DIGEST_HEX = 64  # an upload's digest, when it comes after the bytes
DRAIN_S = 5.0  # after a refusal, what the client still sends is dropped for at most this long
MAX_WAITS = MAX_CONNECTIONS // 2  # waits held here at once (each a connection); past it, gRPC

Publish = Callable[[pb.PublishHeader, AsyncIterator[DataChunk]], Awaitable[pb.ArtifactInfo]]
Waiting = Callable[[Deadline], AsyncIterator[pb.WaitEvent]]  # a wait's events, by a deadline


@dataclass
class _Ticket:
    file: Any  # the blob's file, open
    expires: float


@dataclass
class _Upload:
    header: pb.PublishHeader  # checked when the ticket was issued
    publish: Publish  # the caller's publish: Artifacts.publish for its tenant
    expires: float


@dataclass
class _Wait:
    events: Waiting  # the caller's wait (Waiting.wait, with its request)
    deadline: Deadline  # when it ends, as its Wait call set it
    expires: float


class DataPlane(TicketServer):
    def __init__(self, store: ArtifactStore, metrics: CoordinatorMetrics, listen: str,
                 advertise: str = "") -> None:
        super().__init__(listen)
        self.store = store
        self.metrics = metrics
        self.advertise = advertise
        self._uploads: dict[bytes, _Upload] = {}
        self._waits: dict[bytes, _Wait] = {}
        self.waiting = 0  # waits held on connections now

    async def stop(self) -> None:
        await super().stop()
        self._uploads.clear()
        self._waits.clear()

    @property
    def address(self) -> str:
        return self.advertise or super().address

    async def ticket(self, info: pb.ArtifactInfo, *, zstd_ok: bool) -> pb.DataTicket | None:
        """A ticket for the artifact's stored blob, or None where its bytes
        must go over gRPC (not a trusted blob here, zstd to a client that
        does not decode it, too many tickets out)."""
        self._expire()
        if len(self._tickets) >= MAX_TICKETS:
            return None
        f = await opened(self.store.open_sendable, info.digest, zstd_ok)
        if f is None:
            return None
        return self._issue(self._tickets, _Ticket(f, time.monotonic() + TICKET_S))

    def upload_ticket(self, header: pb.PublishHeader, publish: Publish) -> pb.DataTicket | None:
        """A ticket for one upload of the artifact `header` describes (a
        header the caller has checked), to be published with `publish`; None
        when too many tickets are out (the client then publishes over gRPC)."""
        self._expire()
        if len(self._tickets) + len(self._uploads) >= MAX_TICKETS:
            return None
        return self._issue(self._uploads, _Upload(header, publish, time.monotonic() + TICKET_S))

    def wait_ticket(self, events: Waiting, deadline: Deadline) -> pb.DataTicket | None:
        """A ticket to go on with a wait here: `events` (given `deadline`)
        when its connection comes; None when
        MAX_WAITS are held or promised, or too many tickets are out (the
        wait then stays on its gRPC stream)."""
        self._expire()
        if self.waiting + len(self._waits) >= MAX_WAITS or \
                len(self._tickets) + len(self._uploads) + len(self._waits) >= MAX_TICKETS:
            return None
        return self._issue(self._waits, _Wait(events, deadline, time.monotonic() + TICKET_S))

    def _expire(self) -> None:
        if expired := self._expire_tickets():
            self.metrics.data_plane.labels("expired").inc(expired)
        if expired := len(self._take_expired(self._uploads)):
            self.metrics.data_uploads.labels("expired").inc(expired)
        if expired := len(self._take_expired(self._waits)):
            self.metrics.data_waits.labels("expired").inc(expired)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._sends.add(task)
        ticket = None
        try:
            if len(self._sends) > MAX_CONNECTIONS:  # a flood of connections without tokens
                self.metrics.data_plane.labels("refused").inc()
                return
            request = await data_plane_request(reader, writer, REQUEST_S, UNACKED_S)
            if request is None:
                self.metrics.data_plane.labels("refused").inc()
                return
            self._expire()
            magic, token = request
            if magic == UPLOAD_MAGIC and (upload := self._uploads.pop(token, None)) is not None:
                await self._take_upload(upload, writer)
                return
            if magic == WAIT_MAGIC and (wait := self._waits.pop(token, None)) is not None:
                await self._hold_wait(wait, reader, writer)
                return
            ticket = self._tickets.pop(token, None) if magic == REQUEST_MAGIC else None
            if ticket is None:
                log.info("data plane: refused a connection from %s (no such ticket)",
                         writer.get_extra_info("peername"))
                self.metrics.data_plane.labels("refused").inc()
                return
            await self._send_blob(writer, ticket.file, self.metrics.data_plane, "sent")
        finally:
            if ticket is not None:
                ticket.file.close()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._sends.discard(task)

    async def _hold_wait(self, wait: _Wait, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """Wait on the client's behalf until the wait ends or the client
        closes the connection (it sends nothing after its token); answer
        with the ending event's status frame, and after a HIT with the blob
        when this replica may send it."""
        self.waiting += 1
        try:
            ending = asyncio.ensure_future(ending_event(wait.events(wait.deadline), True))
            gone = asyncio.ensure_future(reader.read(1))  # b"" (or a byte: no client of ours)
            try:
                await asyncio.wait({ending, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (ending, gone):
                    task.cancel()
                await asyncio.gather(ending, gone, return_exceptions=True)
            if ending.cancelled():
                self.metrics.data_waits.labels("left").inc()
                return
            blob = None
            if (exc := ending.exception()) is not None:
                if not isinstance(exc, CompilecastError):
                    log.error("data plane: a wait failed", exc_info=exc)
                frame = refusal_frame(exc, "Wait")
            else:
                event = ending.result()
                if event.decision == pb.HIT:
                    blob = await opened(self.store.open_sendable,
                                        event.artifact.digest, True)
                event.data_follows = blob is not None
                frame = status_frame(0, event.SerializeToString())
            if blob is not None:
                with blob:
                    writer.write(frame)  # (sendfile sends what is buffered first)
                    await self._send_blob(writer, blob, self.metrics.data_waits, "hit_sent")
                return
            writer.write(frame)
            try:
                await writer.drain()
            except (OSError, RuntimeError) as exc:
                log.info("data plane: the answer to a wait broke off (%s)", exc)
                self.metrics.data_waits.labels("broken").inc()
                return
            self.metrics.data_waits.labels("answered").inc()
        finally:
            self.waiting -= 1

    async def _send_blob(self, writer: asyncio.StreamWriter, f, counted, sent: str) -> None:
        """Send the open blob file `f` whole with sendfile, counted in
        `counted` by result: `sent`, or broken (the client went away midway)."""
        size = os.fstat(f.fileno()).st_size
        try:
            n = await asyncio.get_running_loop().sendfile(writer.transport, f)
        except (OSError, RuntimeError) as exc:
            log.info("data plane: a send broke off (%s)", exc)
            counted.labels("broken").inc()
            return
        self.metrics.bytes.labels("out").inc(n)
        counted.labels(sent if n == size else "broken").inc()

    async def _take_upload(self, upload: _Upload, writer: asyncio.StreamWriter) -> None:
        """Receive an upload's bytes and publish them. The event loop stops
        reading the connection (nothing has come past the token: the client
        waits for the go) and a thread reads it, a CHUNK at a time."""
        header = upload.header
        transport = writer.transport
        assert isinstance(transport, asyncio.ReadTransport)
        transport.pause_reading()
        sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))

        async def chunks() -> AsyncIterator[DataChunk]:
            left = header.size
            while left:
                piece = await asyncio.to_thread(_receive, sock, min(left, CHUNK))
                left -= len(piece)
                yield DataChunk(piece)
            if not header.digest:  # it comes after the bytes
                digest = await asyncio.to_thread(_receive, sock, DIGEST_HEX)
                header.digest = validate.digest(bytes(digest).decode("ascii", "replace"))

        try:
            sock.settimeout(UPLOAD_STALL_S)
            writer.write(status_frame(0))
            await writer.drain()
            try:
                info = await upload.publish(header, chunks())
            except OSError:
                raise
            except Exception as exc:
                if not isinstance(exc, CompilecastError):
                    log.exception("data plane: the upload of %s failed", header.key)
                self.metrics.data_uploads.labels("refused").inc()
                reply = refusal_frame(exc, "OpenUpload")
            else:
                self.metrics.data_uploads.labels("published").inc()
                reply = status_frame(0, pb.PublishResponse(artifact=info).SerializeToString())
            with contextlib.suppress(OSError):  # counted: the client's leaving changes nothing
                writer.write(reply)
                await writer.drain()
                if reply[0]:
                    # Refused before the last byte, maybe: what the client sends until it
                    # reads the refusal is taken and dropped, so that closing with it
                    # unread does not reset the connection (and the refusal with it).
                    sock.shutdown(socket.SHUT_WR)
                    await asyncio.to_thread(_drop, sock, DRAIN_S)
        except OSError as exc:  # broken, stalled, or cut short
            log.info("data plane: the upload of %s broke off (%s)", header.key, exc)
            self.metrics.data_uploads.labels("broken").inc()
        finally:
            # Wakes a reading thread still waiting (a stop cancelled this task).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _receive(sock: socket.socket, n: int) -> memoryview:
    """Exactly `n` bytes from `sock` (a read-only view of a fresh buffer:
    the blob's hashing thread may keep it); ConnectionError when it ends first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the connection ended {n - got} bytes short")
        got += k
    return view.toreadonly()


def _drop(sock: socket.socket, limit_s: float) -> None:
    """Read and drop what comes until the client closes, for at most `limit_s`."""
    end = time.monotonic() + limit_s
    buf = bytearray(CHUNK)
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        if not sock.recv_into(buf):
            return
