"""Publishes handed to the worker as sealed memory files.

A process on the worker's host that publishes 16 MiB or more asks the worker
for an upload ticket (`OpenUpload`, as it would ask a coordinator), writes the
executable into a memfd, seals it against any further change (F_SEAL_WRITE,
F_SEAL_SHRINK, F_SEAL_GROW), and hands the file over the worker's handoff
socket, a unix socket next to its gRPC one:

    client -> worker   b"CCFDS01\\n" + token (32 bytes), the memfd attached
                       (SCM_RIGHTS, with the message's first byte)
    worker -> client   status frames (wire.status_frame): an empty OK frame
                       every HEARTBEAT_S while the publish goes on; then
                       the PublishResponse (OK, not empty), or the status a
                       Publish stream would have ended with

The worker checks that the file is sealed and of the header's size, maps it
read-only and publishes it as the chunks of a Publish stream from that
process (docs/architecture/transfers.md, "A host's processes hand their publishes
over"): its copy in the host cache, the bytes on to the coordinator, under
the caller's credential, with every check the coordinator makes. The seals make the bytes immutable from
the moment the worker holds them: what it hashes, keeps and sends is one
thing. The process writes the bytes once into memory instead of sending them
through gRPC, and the worker reads them from the mapping without a copy.

A token is good for one connection within TICKET_S of the ticket; an
unknown, used or expired one gets the connection closed without a byte. Any
failure before the bytes are handed over leaves the client to publish over
gRPC; a connection closed or broken after it is a broken publish
(UNAVAILABLE), which the client tries again over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

from compilecast.errors import CompilecastError, InvalidRequest
from compilecast.streams import CHUNK
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DATA_PLANE_HANDOFF as MAGIC
from compilecast.wire import DATA_PLANE_TOKEN_BYTES as TOKEN_BYTES
from compilecast.wire import (
    HEARTBEAT_S,
    REQUEST_S,
    TICKET_S,
    DataChunk,
    refusal_frame,
    status_frame,
)

from ..inprocess.handoff import SEALS

log = logging.getLogger(__name__)

MAX_HANDOFF_TICKETS = 256  # outstanding; past it, a publish goes over gRPC
STOP_GRACE_S = 5.0  # a stopping worker gives the handoffs in progress this long

# (namespace, upstream metadata, header, the chunks) -> the publish's answer
Publish = Callable[[str, tuple, pb.PublishHeader, AsyncIterator[DataChunk]],
                   Awaitable[pb.PublishResponse]]


@dataclass
class _Ticket:
    ns: str
    md: tuple
    header: pb.PublishHeader
    expires: float


class Handoffs:
    """The worker's handoff socket at `path` and its tickets."""

    def __init__(self, path: str, publish: Publish, counted: Counter) -> None:
        self.path = path
        self._publish = publish
        self._counted = counted  # handoffs by result
        self._tickets: dict[bytes, _Ticket] = {}
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # handoffs in progress

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket of an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o660)  # as the worker's gRPC socket
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept())

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no more handoffs; give those in progress `grace_s` to end."""
        if self._accepting is not None:
            self._accepting.cancel()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def ticket(self, ns: str, md: tuple, header: pb.PublishHeader) -> pb.DataTicket | None:
        """A one-time ticket to hand over the bytes of the publish `header`
        describes (checked by the caller), for a caller of namespace `ns`
        and upstream credential `md`; None when too many are out."""
        now = time.monotonic()
        for token in [t for t, v in self._tickets.items() if v.expires < now]:
            del self._tickets[token]
        if len(self._tickets) >= MAX_HANDOFF_TICKETS:
            return None
        token = secrets.token_bytes(TOKEN_BYTES)
        kept = pb.PublishHeader()
        kept.CopyFrom(header)
        self._tickets[token] = _Ticket(ns, md, kept, now + TICKET_S)
        return pb.DataTicket(address=self.address, token=token)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        listening = self._sock
        assert listening is not None  # (started)
        while True:
            try:
                conn, _ = await loop.sock_accept(listening)
            except OSError as exc:  # out of descriptors, say: its client goes over gRPC
                log.warning("handoff: cannot accept a connection (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                token, fd = await asyncio.wait_for(_handed(loop, conn), REQUEST_S)
            except (OSError, TimeoutError, ValueError) as exc:
                log.info("handoff: a connection sent no ticket and file (%s)", exc)
                return
            with contextlib.ExitStack() as held:
                held.callback(os.close, fd)
                ticket = self._tickets.pop(token, None)
                if ticket is None or ticket.expires < time.monotonic():
                    # Closed without a byte, as the coordinator's data plane does: the
                    # client publishes again over gRPC.
                    self._counted.labels("unknown_ticket").inc()
                    return
                try:
                    reply = await self._publish_file(loop, conn, ticket, fd)
                except OSError as exc:  # not mapped: closed without a byte, gRPC next
                    log.warning("handoff: cannot map the file of %s (%s)", ticket.header.key,
                                exc)
                    return
                self._counted.labels("refused" if reply[0] else "published").inc()
            with contextlib.suppress(OSError):  # the client gone: the publish stands
                await loop.sock_sendall(conn, reply)

    async def _publish_file(self, loop, conn: socket.socket, ticket: _Ticket, fd: int) -> bytes:
        """The publish of the file `fd` under `ticket`, as the frame to answer
        with; heartbeats to `conn` meanwhile."""
        header = ticket.header
        try:
            mapped = _mapped(fd, header.size)
        except CompilecastError as exc:
            return refusal_frame(exc, "handoff")
        task = asyncio.ensure_future(self._publish(ticket.ns, ticket.md, header,
                                                   _chunks(mapped)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_S)
                if done:
                    break
                with contextlib.suppress(OSError):  # its client gone: the publish goes on
                    await loop.sock_sendall(conn, status_frame(0))
            resp = task.result()
        except Exception as exc:
            if not isinstance(exc, CompilecastError):
                log.exception("handoff: the publish of %s failed", header.key)
            return refusal_frame(exc, "handoff")
        finally:
            if not task.done():  # cancelled (a stop): so is the publish
                task.cancel()
            with contextlib.suppress(BufferError):  # else when the last view goes
                mapped.close()
        return status_frame(0, resp.SerializeToString())


async def _handed(loop, conn: socket.socket) -> tuple[bytes, int]:
    """The token and the file a client hands over on `conn`."""
    want = len(MAGIC) + TOKEN_BYTES
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(conn, want, 1, socket.MSG_CMSG_CLOEXEC)
            break
        except BlockingIOError:
            await _readable(loop, conn)
    if not fds:
        raise ValueError("no file attached")
    with contextlib.ExitStack() as undo:
        undo.callback(os.close, fds[0])
        while msg and len(msg) < want:  # the rest of the message, without the file
            msg += await loop.sock_recv(conn, want - len(msg))
        if len(msg) != want or not msg.startswith(MAGIC):
            raise ValueError("not a handoff")
        undo.pop_all()
    return msg[len(MAGIC):], fds[0]


async def _readable(loop, conn: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


def _mapped(fd: int, size: int) -> mmap.mmap:
    """The handed file, mapped read-only: InvalidRequest unless it is a
    sealed file of `size` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest("the handed file is not a regular file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SEALS != SEALS:
        raise InvalidRequest("the handed file is not sealed against writes, growing and "
                             "shrinking (a memfd with F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW)")
    if st.st_size != size:
        raise InvalidRequest(f"the handed file holds {st.st_size} bytes; the header says {size}")
    if not size:
        raise InvalidRequest("an empty file is not handed over")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ)


async def _chunks(mapped: mmap.mmap) -> AsyncIterator[DataChunk]:
    view = memoryview(mapped)
    for off in range(0, len(view), CHUNK):
        yield DataChunk(view[off:off + CHUNK])
