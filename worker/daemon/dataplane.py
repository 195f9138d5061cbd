"""The worker's end of the coordinator's data plane (coordinator/dataplane.py)
and of a peer's relay plane: downloads whose bytes a Fetch call's ticket
stands for (`DataPlaneFill`, `RelayFill`: a fill's ends of those routes),
and the connection and status frames of an upload (worker/daemon/publishes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

from compilecast import wire
from compilecast.negotiate import Route, RouteEnd
from compilecast.streams import RAW_MAGIC, ZSTD_MAGIC, due
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk

from ..inprocess.dataplane import (
    DATA_PLANE_CONNECT_S,
    DATA_PLANE_MIN_RATE,
    DATA_PLANE_STALL_S,
    data_plane_address,
)
from ..inprocess.received import UploadRefused

DATA_PLANE_PIECE = 1 << 20  # a data plane download passes through in pieces of this size


RELAY_LEAST = 256 << 10  # from a peer, bytes go on once this many have come (see _recv_piece)


async def _recv_piece(loop, sock: socket.socket, least: int = DATA_PLANE_PIECE) -> memoryview:
    """The next bytes of the connection, received straight into a buffer of
    their own (read-only: hashed without a copy): DATA_PLANE_PIECE, or as
    many as have come once there are `least` and no more wait to be read;
    fewer only at its end. A relay passes on only what it holds, so each hop
    of a chain delays the stream by a piece's time on its link: from a peer,
    what came, not a whole piece (on a fast link the pieces fill anyway)."""
    piece = memoryview(bytearray(DATA_PLANE_PIECE))
    n = 0
    while n < len(piece):
        try:
            k = sock.recv_into(piece[n:])
        except BlockingIOError:
            if n >= least:
                break
            k = await loop.sock_recv_into(sock, piece[n:])
        if not k:
            break
        n += k
    if n <= len(piece) // 4:  # a few of these would hold many whole buffers
        return memoryview(bytes(piece[:n]))
    return piece[:n].toreadonly()


async def _paced_piece(loop, sock: socket.socket, least: int, start: float, got: int,
                       end: RouteEnd, where: str) -> memoryview:
    """The next piece of a download begun at `start` with `got` bytes come,
    due DATA_PLANE_STALL_S plus those bytes at DATA_PLANE_MIN_RATE after the
    start: a stalled or dripping data plane fails the route, lasting (only
    the first transfer pays the bound)."""
    left = due(start, got, DATA_PLANE_STALL_S, DATA_PLANE_MIN_RATE) - time.monotonic()
    try:
        return await asyncio.wait_for(_recv_piece(loop, sock, least), max(0.0, left))
    except TimeoutError:
        raise end.failed(f"its data plane fell behind {DATA_PLANE_MIN_RATE >> 20} MiB/s",
                         lasting=True, where=where) from None


async def dial(ticket: pb.DataTicket, target: str, end: RouteEnd,
               where: str = "") -> socket.socket:
    """A non-blocking connection to the data plane of `ticket`; the failure
    of `end`'s route (toward `where`: lasting) when it cannot be made."""
    loop = asyncio.get_running_loop()
    sock = None
    try:
        host, port = data_plane_address(ticket, target)
        family, kind, proto, _, address = (await loop.getaddrinfo(
            host, port, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, address), DATA_PLANE_CONNECT_S)
    except (OSError, TimeoutError) as exc:
        if sock is not None:
            sock.close()
        raise end.failed(f"cannot connect to its data plane: {exc!r}",
                         lasting=True, where=where) from None
    return sock


async def _recv_exactly(loop, sock: socket.socket, n: int) -> bytes:
    """`n` bytes of the connection; fewer only where it ended."""
    got = bytearray()
    while len(got) < n and (more := await loop.sock_recv(sock, n - len(got))):
        got += more
    return bytes(got)


async def upload_status(loop, sock: socket.socket, where: str) -> bytes:
    """The payload of an upload's next status frame (wire.status_frame);
    UploadRefused for a status other than OK, OSError for no frame."""
    head = await _recv_exactly(loop, sock, 5)
    if len(head) < 5:
        raise ConnectionError(f"{where} closed the connection")
    n = wire.status_length(head, where)
    payload = await _recv_exactly(loop, sock, n)
    if len(payload) < n:
        raise ConnectionError(f"{where} closed the connection")
    if head[0]:
        raise UploadRefused(head[0], payload.decode("utf-8", "replace"))
    return payload


def answered(sock: socket.socket) -> bool:
    """Whether the (non-blocking) connection has something to read now."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    return True  # a byte, or its end


class FillEnd(RouteEnd):
    """A route a fill's Fetch may be answered with: how the worker takes the
    bytes from there. `chunks` is the call's chunks, where the answer that
    names this route stands for the chunks that route brings, as a gRPC
    fetch would send them; it appends itself to `used` once it took the
    answer, and raises its route's failure (toward `where`, a peer) when
    they do not come whole."""

    def chunks(self, call, target: str, used: list[FillEnd],
               where: str = "") -> AsyncIterator:
        raise NotImplementedError


class DataPlaneFill(FillEnd):
    """The coordinator's data plane, for the ticket a Fetch was answered
    with: the stored blob, raw after RAW_MAGIC (data) or one zstd stream
    (zstd_data)."""

    route = Route.DATA_PLANE
    least = DATA_PLANE_PIECE  # see _recv_piece

    async def chunks(self, call, target: str, used: list[FillEnd],
                     where: str = "") -> AsyncIterator:
        async for chunk in call:
            if not (chunk.HasField("artifact") and chunk.HasField("data_ticket")):
                yield chunk
                continue
            info = chunk.artifact
            yield pb.FetchChunk(artifact=info)
            used.append(self)
            loop = asyncio.get_running_loop()
            least = self.least
            with await dial(chunk.data_ticket, target, self, where) as sock:
                if least < DATA_PLANE_PIECE:  # a peer on a slow link: woken for `least`
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, least)
                start, got = time.monotonic(), 0
                try:
                    await loop.sock_sendall(sock,
                                            wire.DATA_PLANE_REQUEST + chunk.data_ticket.token)
                    piece = await _paced_piece(loop, sock, least, start, got, self, where)
                    raw = piece[:len(RAW_MAGIC)] == RAW_MAGIC  # else the zstd stream's first bytes
                    if not raw and len(piece) and \
                            piece[:len(ZSTD_MAGIC)] != ZSTD_MAGIC[:len(piece)]:
                        raise self.failed("its data plane sent neither a raw blob nor a zstd "
                                          "stream", where=where)
                    piece = piece[len(RAW_MAGIC):] if raw else piece
                    while len(piece):
                        got += len(piece)
                        yield DataChunk(piece) if raw else DataChunk(b"", piece)
                        piece = await _paced_piece(loop, sock, least, start, got, self, where)
                except OSError as exc:
                    raise self.failed(f"its data plane broke off: {exc}", where=where) from None
                if raw and got != info.size:
                    raise self.failed(f"its data plane sent {got} of {info.size} bytes",
                                      where=where)
            return


class RelayFill(DataPlaneFill):
    """A peer worker's relay plane (worker/daemon/relayplane.py), the same
    protocol as the coordinator's data plane: bytes go on as they come, not
    a whole piece at a time (each hop of a chain would delay the stream)."""

    route = Route.RELAY_PLANE
    least = RELAY_LEAST
