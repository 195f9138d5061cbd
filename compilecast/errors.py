"""The error type of compilecast's core.

Grouped by what the caller should do. Each class carries its gRPC status
code; exactly one edge (`compilecast.grpcutil.rpc_errors`) turns them into
statuses, for both servers.

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

import grpc


class CompilecastError(Exception):
    """Base of every error compilecast raises on purpose."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(CompilecastError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DigestMismatch(InvalidRequest):
    pass


class NotFound(CompilecastError):
    code = grpc.StatusCode.NOT_FOUND


class LeaseError(CompilecastError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyPublished(CompilecastError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Revoked(CompilecastError):
    """A publish of bytes an operator purged (their digest is revoked)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class TooLarge(CompilecastError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StoreFull(CompilecastError):
    """The volume under a blob store has no room left, even after evicting
    every blob the store could."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooMany(CompilecastError):
    """A per-stream limit reached (e.g. waits on one Decide stream)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class CorruptBlob(CompilecastError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(CompilecastError):
    code = grpc.StatusCode.UNAVAILABLE


class UpstreamError(CompilecastError):
    """A status returned by the coordinator, relayed unchanged by a worker."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Unauthenticated(CompilecastError):
    """No or an unknown credential: -> UNAUTHENTICATED."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(CompilecastError):
    """A known identity without the permission the call needs: -> PERMISSION_DENIED."""

    code = grpc.StatusCode.PERMISSION_DENIED
