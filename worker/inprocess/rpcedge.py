"""The in-process client's one gRPC edge: a stub whose calls raise
compilecast's own errors (compilecast.errors.received) in place of gRPC's,
whether a unary call fails, a stream breaks while it is read, or a
stream-unary call's future ends badly. Everything above it (the client, the
JAX integration, the CLI) branches on those errors, never on gRPC's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar, cast

import grpc

from compilecast.errors import Cancelled
from compilecast.grpcutil import from_rpc

Stub = TypeVar("Stub")


class _Stream:
    """A server stream being read: its messages, and `cancel`."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None

    def cancel(self) -> bool:
        return bool(self._call.cancel())


class _Future:
    """A stream-unary call under way: `result` and `cancel`."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None
        except grpc.FutureCancelledError:
            raise Cancelled("the call was cancelled") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What `result` would raise (None: it returns)."""
        try:
            exc = self._future.exception(timeout)
        except grpc.FutureCancelledError:
            return Cancelled("the call was cancelled")
        return from_rpc(exc) if isinstance(exc, grpc.RpcError) else exc

    def cancel(self) -> bool:
        return bool(self._future.cancel())


class _Call:
    def __init__(self, multicallable: Any) -> None:
        self._call = multicallable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            got = self._call(*args, **kwargs)
        except grpc.RpcError as exc:
            raise from_rpc(exc) from None
        # A server stream is read later: its errors come as it is read.
        return _Stream(got) if isinstance(got, grpc.Call) and hasattr(got, "__next__") else got

    def future(self, *args: Any, **kwargs: Any) -> _Future:
        return _Future(self._call.future(*args, **kwargs))


class _Calls:
    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._stub, name))


def edged(stub: Stub) -> Stub:
    """`stub` (a sync channel's) with compilecast's errors at its edge; its
    calls are the stub's own, typed as such."""
    return cast(Stub, _Calls(stub))
