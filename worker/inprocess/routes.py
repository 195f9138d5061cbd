"""How a client's bytes travel besides gRPC: over a coordinator's data plane
(plain TCP, sendfile, a one-time ticket), and handed to the host's worker as
a sealed memory file (worker/daemon/handoff.py), with the memory that leaves. Used
by worker/inprocess/client.py's CacheClient.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
from collections.abc import Callable

from compilecast import wire
from compilecast.streams import Sha256
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

# A handed-over file is sealed against every change (worker/daemon/handoff.py, the
# worker's end, checks that it is).
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(
    fcntl, "F_SEAL_WRITE") else 0


def handoff_supported() -> bool:
    """Whether this platform can hand files over (memfd, seals, SCM_RIGHTS)."""
    return bool(SEALS) and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


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
    (a refused or broken connection, a read that waited `stall_s`) or
    CorruptBlob; the caller then fetches over gRPC."""
    sock, where = connect_data_plane(ticket, target, stall_s)
    with sock:
        sock.sendall(wire.DATA_PLANE_REQUEST + ticket.token)
        with sock.makefile("rb", buffering=0) as f:
            return read_stored(key, info, f, where)


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


HANDOFF_PIECE = 8 << 20  # bytes written into a handed file per call
HANDOFF_SPARE = 256 << 20  # memory a handoff leaves free beside its file, at least


def memory_headroom(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process may still take before the host's available memory
    runs out or its memory cgroup (v2 or v1) reaches its limit, counting the
    cgroup's inactive file cache as free (as the kernel would reclaim it);
    None when neither can be read."""
    room = None
    with contextlib.suppress(OSError, ValueError):
        with open(f"{proc}/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError):
        with open(f"{proc}/self/cgroup") as f:
            lines = f.read().splitlines()
        for line in lines:
            hier, controllers, path = line.split(":", 2)
            if hier == "0" and not controllers:  # v2
                files = (f"{cgroups}{path}", "memory.max", "memory.current", "inactive_file")
            elif "memory" in controllers.split(","):  # v1
                files = (f"{cgroups}/memory{path}", "memory.limit_in_bytes",
                         "memory.usage_in_bytes", "total_inactive_file")
            else:
                continue
            with contextlib.suppress(OSError, ValueError):
                left = _cgroup_room(*files)
                if left is not None:
                    room = left if room is None else min(room, left)
    return room


def _cgroup_room(where: str, limit_file: str, usage_file: str, inactive: str) -> int | None:
    with open(f"{where}/{limit_file}") as f:
        limit = f.read().strip()
    if limit == "max" or int(limit) >= 1 << 60:  # no limit
        return None
    with open(f"{where}/{usage_file}") as f:
        used = int(f.read())
    with open(f"{where}/memory.stat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == inactive:
                used -= int(value)
    return int(limit) - max(used, 0)


class NoFile(OSError):
    """A publish's memory file could not be made: it goes over gRPC."""


def hand_off(data: bytes, ticket: pb.DataTicket, stall_s: float) -> pb.ArtifactInfo:
    """Publish `data` by handing it to this host's worker as a sealed memory
    file (worker/daemon/handoff.py): written once, sealed, passed over the
    ticket's unix socket. Unreachable when its socket cannot be connected
    to, NoFile when the file cannot be made (both before anything was
    handed); UploadRefused as its Publish stream would have been refused;
    OSError when the connection broke or stalled after the handoff."""
    try:
        fd = os.memfd_create("compilecast-publish", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise NoFile(exc.errno, f"cannot make a memory file: {exc.strerror or exc}") from None
    try:
        try:
            os.ftruncate(fd, len(data))
            view = memoryview(data)
            written = 0
            while written < len(data):
                written += os.pwrite(fd, view[written:written + HANDOFF_PIECE], written)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        except OSError as exc:  # no memory for it, say
            raise NoFile(exc.errno, f"cannot fill a memory file: {exc.strerror or exc}") from None
        path = ticket.address.removeprefix("unix:")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(stall_s, DATA_PLANE_CONNECT_S))
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise Unreachable(exc.errno, f"cannot connect to {path}: "
                                          f"{exc.strerror or exc}") from None
        sock.settimeout(stall_s)  # the worker sends an empty frame every 10 s meanwhile
        where = f"the worker's handoff socket {path}"
        with sock, sock.makefile("rb", buffering=0) as answers:
            socket.send_fds(sock, [wire.DATA_PLANE_HANDOFF + ticket.token], [fd])
            os.close(fd)  # the worker holds it now: its memory goes when the worker is done
            fd = -1
            while not (payload := answer_status(answers, where)):
                pass  # a heartbeat
            return pb.PublishResponse.FromString(payload).artifact
    finally:
        if fd >= 0:
            os.close(fd)


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
