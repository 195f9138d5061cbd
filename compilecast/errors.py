"""The error type of compilecast's core.

Grouped by what the caller should do. Each class carries its status, a
google.rpc.Code (`Status`, the numbers gRPC's status codes have): a failure
travels as that number where it is not a gRPC call's own status (a Decide
answer's error_code, a data plane's status frame). The core imports no gRPC;
exactly one edge (`compilecast.grpcutil`) turns a Status into a gRPC status
code and back, for both servers and for the clients.

    CompilecastError
    ├── InvalidRequest        fix the request          -> INVALID_ARGUMENT
    │   └── DigestMismatch    bytes differ from digest -> INVALID_ARGUMENT
    ├── NotFound              nothing under that key   -> NOT_FOUND
    ├── LeaseError            not (or no longer) the lease holder
    │                                                  -> FAILED_PRECONDITION
    ├── AlreadyPublished      write-once key taken     -> ALREADY_EXISTS
    ├── Revoked               the bytes were purged and may not come back
    │                                                  -> FAILED_PRECONDITION
    ├── TooLarge              over a size limit        -> RESOURCE_EXHAUSTED
    ├── StoreFull             the store's volume is out of space, nothing
    │                         left to evict             -> RESOURCE_EXHAUSTED
    ├── CorruptBlob           stored bytes fail their digest; quarantined
    │                                                  -> DATA_LOSS
    ├── Unauthenticated       present a valid credential -> UNAUTHENTICATED
    ├── PermissionDenied      the identity lacks the permission -> PERMISSION_DENIED
    ├── UpstreamError         a coordinator status relayed by a worker (same code)
    └── Unavailable           etcd or the coordinator cannot be reached;
                              retry later or compile locally -> UNAVAILABLE
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """google.rpc.Code: the numbers of gRPC's status codes."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of_number(cls, number: int) -> Status:
        """The status a number names; UNKNOWN for one that names none."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN


class CompilecastError(Exception):
    """Base of every error compilecast raises on purpose."""

    status = Status.INTERNAL


def status_of(exc: BaseException, where: str) -> tuple[Status, str]:
    """The status and message a failure ends a request with: a
    CompilecastError's own, anything else (a bug, logged by the caller)
    INTERNAL without its details."""
    if isinstance(exc, CompilecastError):
        return exc.status, str(exc)
    return Status.INTERNAL, f"{where}: internal error"


class InvalidRequest(CompilecastError):
    status = Status.INVALID_ARGUMENT


class DigestMismatch(InvalidRequest):
    pass


class NotFound(CompilecastError):
    status = Status.NOT_FOUND


class LeaseError(CompilecastError):
    status = Status.FAILED_PRECONDITION


class AlreadyPublished(CompilecastError):
    status = Status.ALREADY_EXISTS


class Revoked(CompilecastError):
    """A publish of bytes an operator purged (their digest is revoked)."""

    status = Status.FAILED_PRECONDITION


class TooLarge(CompilecastError):
    status = Status.RESOURCE_EXHAUSTED


class StoreFull(CompilecastError):
    """The volume under a blob store has no room left, even after evicting
    every blob the store could."""

    status = Status.RESOURCE_EXHAUSTED


class TooMany(CompilecastError):
    """A per-stream limit reached (e.g. waits on one Decide stream)."""

    status = Status.RESOURCE_EXHAUSTED


class CorruptBlob(CompilecastError):
    status = Status.DATA_LOSS


class Unavailable(CompilecastError):
    status = Status.UNAVAILABLE


class CutOff(Unavailable):
    """A transfer that started and then broke (UNAVAILABLE after its first
    message): worth trying again, where a call refused at once is not."""


class Unimplemented(CompilecastError):
    """A call this server does not answer (it is another role's)."""

    status = Status.UNIMPLEMENTED


class UpstreamError(CompilecastError):
    """A status returned by the coordinator, relayed unchanged by a worker."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class Unauthenticated(CompilecastError):
    """No or an unknown credential: -> UNAUTHENTICATED."""

    status = Status.UNAUTHENTICATED


class PermissionDenied(CompilecastError):
    """A known identity without the permission the call needs: -> PERMISSION_DENIED."""

    status = Status.PERMISSION_DENIED


class DeadlineExceeded(CompilecastError):
    """A call or a transfer that ran out of time."""

    status = Status.DEADLINE_EXCEEDED


class Cancelled(CompilecastError):
    status = Status.CANCELLED


# The class a client raises for each status a call can end with (one class
# per status: Revoked, TooLarge and StoreFull share theirs with LeaseError
# and TooMany); any other status is an UpstreamError.
_RECEIVED: dict[Status, type[CompilecastError]] = {
    cls.status: cls for cls in (
        Cancelled, InvalidRequest, DeadlineExceeded, NotFound, AlreadyPublished,
        PermissionDenied, TooMany, LeaseError, Unimplemented, Unavailable, CorruptBlob,
        Unauthenticated)
}


def received(status: Status, details: str) -> CompilecastError:
    """The error for a call that ended with `status` and `details`: what a
    client of compilecast raises, and branches on, in place of gRPC's."""
    cls = _RECEIVED.get(status)
    return cls(details) if cls is not None else UpstreamError(status, details)
