"""A process's end of the coordinator's data plane (coordinator/dataplane.py
is the other): an artifact's bytes for a Fetch's ticket, a wait that goes on
there, and a publish's upload for an OpenUpload ticket, over plain TCP. Used
by worker/inprocess/client.py and clientpublish.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import time
from collections.abc import Callable

from compilecast import wire
from compilecast.streams import Sha256, due
from compilecast.v1 import cache_pb2 as pb

from .received import (
    Unreachable,
    UploadRefused,
    read_exactly,
    read_stored,
)

log = logging.getLogger("compilecast.worker.inprocess.client")

PUBLISH_CHUNK = 1 << 20
DATA_PLANE_CONNECT_S = 5.0  # a data plane that does not take the connection by then: gRPC
# A download over a data plane that moves nothing for DATA_PLANE_STALL_S, or
# falls behind DATA_PLANE_MIN_RATE (past its first DATA_PLANE_STALL_S), is
# given up for the gRPC stream: a stalled or dripping data plane costs one
# transfer that bound, and the route is then off for the end's life.
DATA_PLANE_STALL_S = 10.0
DATA_PLANE_MIN_RATE = 4 << 20  # bytes a second


class _Paced:
    """A connection's file, read within a deadline that grows with what has
    come (DATA_PLANE_STALL_S plus the bytes at DATA_PLANE_MIN_RATE):
    OSError(ETIMEDOUT) once it falls behind, however the reads trickle."""

    def __init__(self, f, sock: socket.socket, where: str) -> None:
        self.f, self.sock, self.where = f, sock, where
        self.start = time.monotonic()
        self.got = 0

    def _left(self) -> float:
        return due(self.start, self.got, DATA_PLANE_STALL_S, DATA_PLANE_MIN_RATE) - \
            time.monotonic()

    def _check(self) -> None:
        left = self._left()
        if left <= 0:
            raise OSError(errno.ETIMEDOUT, f"{self.where} fell behind "
                                           f"{DATA_PLANE_MIN_RATE >> 20} MiB/s")
        self.sock.settimeout(min(left, DATA_PLANE_STALL_S))

    def read(self, n: int = -1) -> bytes:
        self._check()
        data = self.f.read(n)
        self.got += len(data)
        return data

    def readinto(self, b) -> int:
        self._check()
        n = self.f.readinto(b)
        self.got += n or 0
        return n

def data_plane_address(ticket: pb.DataTicket, target: str) -> tuple[str, int]:
    """Where a ticket's bytes are: its address, or for ":port" the host of
    the gRPC `target` the client dialed."""
    host, _, port = ticket.address.rpartition(":")
    if not host:
        host = target.removeprefix("dns:///").removeprefix("ipv4:").rpartition(":")[0]
    if not port.isdigit() or not host:
        raise OSError(errno.EINVAL, f"unusable data plane address {ticket.address!r}")
    return host.strip("[]"), int(port)


def read_data_plane(key: str, info: pb.ArtifactInfo, ticket: pb.DataTicket, target: str,
                     stall_s: float) -> bytes:
    """The artifact over the coordinator's data plane, verified. OSError
    (a refused or broken connection, a read that waited `stall_s`, a
    download that fell behind: _Paced) or CorruptBlob; the caller then
    fetches over gRPC."""
    sock, where = connect_data_plane(ticket, target, min(stall_s, DATA_PLANE_STALL_S))
    with sock:
        sock.sendall(wire.DATA_PLANE_REQUEST + ticket.token)
        with sock.makefile("rb", buffering=0) as f:
            return read_stored(key, info, _Paced(f, sock, where), where)


def connect_data_plane(ticket: pb.DataTicket, target: str,
                        stall_s: float) -> tuple[socket.socket, str]:
    """A connection to the ticket's data plane, each read and write on it
    given up after `stall_s`, and what to call it; Unreachable when it
    cannot be made."""
    address = data_plane_address(ticket, target)
    # An ASCII host goes to getaddrinfo as bytes: the same name, without the
    # idna codec a str is encoded with, whose first use in a process imports
    # modules for 1.7-4.8 CPU-ms (here), on a waiter's way to its bytes.
    host = address[0].encode("ascii") if address[0].isascii() else address[0]
    try:
        sock = socket.create_connection((host, address[1]),  # type: ignore[arg-type]
                                        timeout=min(stall_s, DATA_PLANE_CONNECT_S))
        sock.settimeout(stall_s)
    except OSError as exc:
        raise Unreachable(exc.errno, f"cannot connect to {address[0]}:{address[1]}: "
                                      f"{exc.strerror or exc}") from None
    return sock, f"the data plane at {address[0]}:{address[1]}"


def upload_data_plane(header: pb.PublishHeader, data: bytes, ticket: pb.DataTicket,
                       target: str, stall_s: float) -> pb.ArtifactInfo:
    """Publish `data` over the coordinator's data plane (cache.proto,
    DataTicket): the bytes go straight from `data` to the socket, hashed on
    the way when the header has no digest. UploadRefused as its Publish
    stream would have been refused; Unreachable when the data plane cannot
    be connected to; OSError when the connection broke or stalled."""
    sock, where = connect_data_plane(ticket, target, stall_s)
    with sock, sock.makefile("rb", buffering=0) as answers:
        sock.sendall(wire.DATA_PLANE_UPLOAD + ticket.token)
        answer_status(answers, where)  # go
        h = None if header.digest else Sha256()
        with contextlib.closing(h) if h is not None else contextlib.nullcontext():
            view = memoryview(data)
            answered = _readable(sock)
            try:
                for off in range(0, len(data), PUBLISH_CHUNK):
                    if answered():  # refused before the end
                        answer_status(answers, where)
                        raise OSError(errno.EPROTO, f"{where} answered before the last byte")
                    piece = view[off:off + PUBLISH_CHUNK]
                    if h is not None:
                        h.update(piece)
                    sock.sendall(piece)
                if h is not None:
                    sock.sendall(h.hexdigest().encode("ascii"))
            except OSError:
                # The connection broke: raise the refusal, if one was sent before.
                with contextlib.suppress(OSError):
                    sock.settimeout(1.0)
                    answer_status(answers, where)
                raise
        return pb.PublishResponse.FromString(answer_status(answers, where)).artifact


def _readable(sock: socket.socket) -> Callable[[], bool]:
    """Whether `sock` has something to read now, without waiting (poll, not
    select: a process with a thousand files open has descriptors select cannot
    take)."""
    if not hasattr(select, "poll"):
        return lambda: bool(select.select([sock], [], [], 0)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return lambda: bool(poller.poll(0))


def answer_status(answers, where: str) -> bytes:
    """The payload of the next status frame (wire.status_frame) of a data
    plane upload or wait, read from `answers` (its connection, as a file);
    UploadRefused for a status other than OK."""
    head = read_exactly(answers, 5)
    n = wire.status_length(head, where) if len(head) == 5 else 0
    payload = read_exactly(answers, n)
    if len(head) < 5 or len(payload) < n:
        raise ConnectionError(f"{where} closed the connection")
    if head[0]:
        raise UploadRefused(head[0], payload.decode("utf-8", "replace"))
    return payload
