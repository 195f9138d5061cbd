"""The gRPC edges of compilecast's clients: stubs whose calls raise
compilecast's own errors (compilecast.errors) in place of gRPC's, whether a
unary call fails, a stream breaks while it is read, or a stream-unary call
ends badly. Everything above an edge branches on those errors, never on
gRPC's.

    edged(stub)            a sync channel's stub (the in-process client, the
                           JAX door, the CLI): compilecast.grpcutil.from_rpc
    aedged(stub, error)    an aio channel's stub: the PJRT gate's client of
                           its worker (from_rpc), the worker's link to its
                           coordinator and peers (`error`: the status relayed
                           to the worker's own caller, UpstreamError)

The Decide stream's client (compilecast/decide.py) is an edge of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any, TypeVar, cast

import grpc

from compilecast.errors import Cancelled, CompilecastError
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


# -- the asynchronous edge ------------------------------------------------------

ErrorOf = Callable[[grpc.RpcError], CompilecastError]


class _ACall:
    """An aio call under way: awaited (a unary answer) or iterated (a
    stream's messages), and `cancel`; gRPC's errors come out as `error` made
    them."""

    def __init__(self, call: Any, error: ErrorOf) -> None:
        self._call = call
        self._error = error

    def __await__(self) -> Generator[Any, None, Any]:
        return self._result().__await__()

    async def _result(self) -> Any:
        try:
            return await self._call
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        try:
            async for message in self._call:
                yield message
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def done(self) -> bool:
        return bool(self._call.done())


class _AMethod:
    def __init__(self, multicallable: Any, error: ErrorOf) -> None:
        self._call = multicallable
        self._error = error

    def __call__(self, *args: Any, **kwargs: Any) -> _ACall:
        return _ACall(self._call(*args, **kwargs), self._error)


class _AMethods:
    def __init__(self, stub: Any, error: ErrorOf) -> None:
        self._stub = stub
        self._error = error

    def __getattr__(self, name: str) -> _AMethod:
        return _AMethod(getattr(self._stub, name), self._error)


def aedged(stub: Stub, error: ErrorOf = from_rpc) -> Stub:
    """`stub` (an aio channel's) whose calls raise `error(exc)` in place of
    gRPC's errors; typed as the stub itself."""
    return cast(Stub, _AMethods(stub, error))
