"""A process's ends of the routes besides gRPC (compilecast/negotiate.py):
for each route it offers, how this process takes a fetch's answer there or
sends a publish there, whether it suits, and what its failures mean.

    LocalFile     the host cache's file a worker answered with, read and verified
    GrowingFile   a download the worker is still writing, followed in its file
    DataPlane     a coordinator's data plane: fetches, and waits that go on there
    DataPlaneUpload  a publish uploaded to a coordinator's data plane
    Handoff       a publish handed to this host's worker as a sealed memory file
    UploadTickets the ticket a publish over a data plane or a handoff needs
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, ClassVar

from google.protobuf.message import DecodeError

from compilecast import wire
from compilecast.deadline import Deadline
from compilecast.errors import CorruptBlob, TooMany
from compilecast.negotiate import Route, RouteEnd, RouteFailed
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from .dataplane import answer_status, connect_data_plane, read_data_plane, upload_data_plane
from .handoff import HANDOFF_SPARE, NoFile, hand_off, memory_headroom
from .received import Unfollowable, Unreachable, UploadRefused, read_local, read_stored

log = logging.getLogger("compilecast.worker.inprocess.client")


def on_this_host(path: str) -> bool:
    """Whether the host cache a worker's file is in is on this host."""
    return os.path.isdir(os.path.dirname(path))


class Taker(RouteEnd):
    """A route a fetch's answer may name: how this process takes the
    verified bytes from there (RouteFailed of its route where it cannot)."""

    def take(self, key: str, info: pb.ArtifactInfo, answer: Any) -> bytes:
        raise NotImplementedError


class Sender(RouteEnd):
    """A route a publish may take for an upload ticket: how this process
    sends the bytes there. A refusal is raised as the status its Publish
    stream would have ended with; anything else that keeps the bytes from
    going this way is this route's failure."""

    handed: ClassVar[bool] = False  # whether its tickets are a unix socket's (a handoff)

    def send(self, header: pb.PublishHeader, data: bytes,
             ticket: pb.DataTicket) -> pb.ArtifactInfo:
        if ticket.address.startswith("unix:") != self.handed:
            raise self.failed(f"the server offered a ticket of another route ({ticket.address})")
        try:
            return self.deliver(header, data, ticket)
        except UploadRefused as exc:  # what its Publish stream would have ended with
            raise exc.error from None
        except NoFile as exc:
            raise self.failed(str(exc)) from None
        except OSError as exc:
            raise self.failed(f"the upload of {header.key} broke off ({exc})",
                              lasting=isinstance(exc, Unreachable)) from None

    def deliver(self, header: pb.PublishHeader, data: bytes,
                ticket: pb.DataTicket) -> pb.ArtifactInfo:
        raise NotImplementedError


class LocalFile(Taker):
    """The host cache's file, read here and verified; one on another host
    (a worker that is not this host's) is off for good."""

    route = Route.LOCAL_FILE

    def take(self, key: str, info: pb.ArtifactInfo, answer: Any) -> bytes:
        try:
            return read_local(key, info, answer)
        except (OSError, CorruptBlob) as exc:
            raise self.failed(f"cannot read {answer} ({exc})",
                              lasting=isinstance(exc, OSError) and not on_this_host(answer)) \
                from None


class GrowingFile(RouteEnd):
    """A download the worker is still writing, followed in its file as part
    of the fetch's stream (received.Follower)."""

    route = Route.GROWING_FILE

    def unfollowable(self, exc: Unfollowable) -> RouteFailed:
        """The fetch is asked again: the file is then whole in the host
        cache, or comes over the socket."""
        return self.failed(f"cannot follow {exc.path} ({exc.__cause__ or exc})",
                           lasting=not on_this_host(exc.path))


class DataPlane(Taker):
    """A coordinator's data plane (plaintext TCP, for a ticket): whole
    artifacts fetched, and waits that go on there and bring the bytes along
    (DATA_WAIT)."""

    route = Route.DATA_PLANE
    also = (Route.DATA_WAIT,)

    def __init__(self, target: str, *, stall_s: float, timeout_s: float) -> None:
        self.target = target
        self.stall_s = stall_s
        self.timeout_s = timeout_s

    def take(self, key: str, info: pb.ArtifactInfo, answer: Any) -> bytes:
        try:
            return read_data_plane(key, info, answer, self.target, self.stall_s)
        except (OSError, CorruptBlob) as exc:
            # Unreachable, stalled or dripping: it would again, so off for
            # this process (only the first transfer pays the stall bound).
            # A connection cut midway, or bytes that do not verify, cost
            # nothing to try again: not.
            lasting = isinstance(exc, Unreachable | TimeoutError) or \
                getattr(exc, "errno", None) == errno.ETIMEDOUT
            raise self.failed(str(exc), lasting=lasting) from None

    def wait(self, key: str, ticket: pb.DataTicket,
             deadline: Deadline) -> tuple[pb.WaitEvent, bytes | None]:
        """Go on with a wait over the data plane (cache.proto, DataTicket):
        blocked in recv until the event that ends it, which may be the WAIT
        of a publish that started, and after a HIT the verified bytes when
        they follow (None when they did not, or did not arrive whole and
        verified: the caller fetches). A connection that could not be made,
        broke or went silent before the event decided nothing: this route's
        failure. A refusal is raised as the status a Wait call would have
        ended with."""
        try:
            return self._wait(key, ticket, deadline)
        except OSError as exc:
            raise self.failed(f"the wait over it broke off ({exc})",
                              lasting=isinstance(exc, Unreachable)) from None

    def _wait(self, key: str, ticket: pb.DataTicket,
              deadline: Deadline) -> tuple[pb.WaitEvent, bytes | None]:
        sock, where = connect_data_plane(ticket, self.target, self.stall_s)
        with sock, sock.makefile("rb", buffering=0) as answers:
            sock.sendall(wire.DATA_PLANE_WAIT + ticket.token)
            # The coordinator answers by the deadline (COMPILE_LOCALLY at worst).
            sock.settimeout(max(0.001, deadline.left_s()) + self.timeout_s)
            try:
                event = pb.WaitEvent.FromString(answer_status(answers, where))
            except UploadRefused as exc:
                raise exc.error from None
            except DecodeError as exc:
                raise OSError(errno.EPROTO, f"{where} answered a wait with no WaitEvent: "
                                            f"{exc}") from None
            if not event.data_follows:
                return event, None
            sock.settimeout(self.stall_s)
            try:
                return event, read_stored(key, event.artifact, answers, where)
            except (OSError, CorruptBlob) as exc:
                log.info("the bytes of %s after the wait did not arrive whole and verified "
                         "(%s); fetching them", key, exc, extra={"key": key})
                return event, None


class DataPlaneUpload(Sender):
    """A publish uploaded to a coordinator's data plane, for a ticket."""

    route = Route.DATA_PLANE

    def __init__(self, target: str, *, stall_s: float) -> None:
        self.target = target
        self.stall_s = stall_s

    def deliver(self, header: pb.PublishHeader, data: bytes,
                ticket: pb.DataTicket) -> pb.ArtifactInfo:
        return upload_data_plane(header, data, ticket, self.target, self.stall_s)


class Handoff(Sender):
    """A publish handed to this host's worker as a sealed memory file. It
    suits a publish while the memory file fits: near a memory limit, the
    bytes go to the worker in pieces instead (a handed file holds them a
    second time)."""

    route = Route.HANDOFF
    handed = True

    def __init__(self, *, stall_s: float) -> None:
        self.stall_s = stall_s

    def suits(self, size: int) -> bool:
        room = memory_headroom()
        if room is None or room >= size + HANDOFF_SPARE:
            return True
        log.info("%d MB of memory left: a publish of %d MB goes over gRPC", room >> 20,
                 size >> 20)
        return False

    def deliver(self, header: pb.PublishHeader, data: bytes,
                ticket: pb.DataTicket) -> pb.ArtifactInfo:
        return hand_off(data, ticket, self.stall_s)


class UploadTickets(RouteEnd):
    """The server's upload tickets (OpenUpload): what a publish over a data
    plane or a handoff goes with. OpenUpload refuses what a Publish would
    refuse before its first byte, as the same error."""

    route = Route.UPLOAD_TICKET

    def __init__(self, stub: rpc.CompileCacheStub, target: str, *, timeout_s: float) -> None:
        self.stub = stub
        self.target = target
        self.timeout_s = timeout_s

    def open(self, header: pb.PublishHeader) -> pb.DataTicket:
        try:
            resp = self.stub.OpenUpload(pb.OpenUploadRequest(header=header),
                                        timeout=self.timeout_s)
        except TooMany as exc:
            # Too many tickets out, or an artifact too large: either way the
            # Publish stream says which (and refuses the latter as this would).
            raise self.failed(str(exc)) from None
        if not resp.HasField("ticket"):
            raise self.failed(f"{self.target} offers no upload tickets", lasting=True)
        return resp.ticket
