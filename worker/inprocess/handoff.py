"""A process's end of the handoff (worker/daemon/handoff.py is the worker's):
a publish handed to this host's worker as a sealed memory file, and the
memory that leaves. Used by worker/inprocess/clientpublish.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from compilecast import wire
from compilecast.v1 import cache_pb2 as pb

from .dataplane import DATA_PLANE_CONNECT_S, answer_status
from .received import Unreachable

# A handed-over file is sealed against every change (worker/daemon/handoff.py, the
# worker's end, checks that it is).
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(
    fcntl, "F_SEAL_WRITE") else 0


def handoff_supported() -> bool:
    """Whether this platform can hand files over (memfd, seals, SCM_RIGHTS)."""
    return bool(SEALS) and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


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
