"""The one edge where compilecast errors become gRPC statuses, plus channel
helpers shared by servers and clients."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from compilecast import tracing, wire
from compilecast.config import ConfigError, read_small_file
from compilecast.errors import CompilecastError, InvalidRequest, Status, Unauthenticated, received

log = logging.getLogger(__name__)

# Chunks of 1 MiB; messages up to 8 MiB leave room for headers.
MAX_MESSAGE = 8 << 20
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
# A client's channel keeps its connections to itself. gRPC shares them
# process-wide by default, and with them the backoff of one that failed: a new
# client of a coordinator restarted on the same address was refused at once
# ("connection refused", from the old server's last attempt) until an older
# channel's backoff ran out.
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
# A worker's channel to a peer (a relay) pings it while calls are open: a peer
# that stops without closing (a paused VM, a stopped process) is let go after
# KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS, and its calls fail (servers accept a
# ping as often as every PING_EVERY_MS: serving.SERVER_OPTIONS).
KEEPALIVE_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
PING_EVERY_MS = 10_000
PEER_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                ("grpc.http2.max_pings_without_data", 0)]


# Why a connection could not be made, as gRPC's details say it (the OS's
# words, after a chain of resolver and subchannel context), in a few words.
_CONNECT_FAILURES = (
    ("No such file or directory", "no socket at that path"),
    ("Connection refused", "connection refused"),
    ("Permission denied", "permission denied"),
    ("Domain name not found", "no such host"),
    ("Name or service not known", "no such host"),
    ("Network is unreachable", "network unreachable"),
    ("No route to host", "no route to host"),
    ("Socket closed", "the connection was closed"),
    ("failed to connect to all addresses", "cannot connect"),
)


def rpc_problem(exc: grpc.RpcError | CompilecastError) -> str:
    """A failed call as one readable line: its status and details, or, for a
    server that could not be reached, "unreachable: " and why in a few words
    (gRPC's own details for that run to a few hundred characters)."""
    if isinstance(exc, CompilecastError):
        code, details = exc.status, str(exc)
    else:
        code, details = status(exc.code()), exc.details() or ""
    if code == Status.UNAVAILABLE:
        for needle, why in _CONNECT_FAILURES:
            if needle in details:
                return f"unreachable: {why}"
    return f"{code.name}: {details}"


def one_line(exc: BaseException) -> str:
    """Any failure as one line for a log: a call's status and details (no
    gRPC repr of five lines), else its type and the first line of its text."""
    if isinstance(exc, CompilecastError) or (isinstance(exc, grpc.RpcError)
                                              and callable(getattr(exc, "code", None))):
        return rpc_problem(exc)
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def unreachable(exc: grpc.RpcError | CompilecastError) -> str:
    """rpc_problem for a server that did not answer: always "unreachable",
    with why (a connection that failed) or the status (a deadline)."""
    problem = rpc_problem(exc)
    return problem if problem.startswith("unreachable") else f"unreachable ({problem})"


def _read(path: str) -> bytes | None:
    return _read_required(path) if path else None


def _read_required(path: str) -> bytes:
    """A certificate or key file: a regular file, bounded (config.read_small_file);
    an OSError to callers otherwise."""
    try:
        return read_small_file(path, "TLS file")
    except ConfigError as exc:
        raise OSError(errno.EINVAL, str(exc), path) from None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = ""
                       ) -> grpc.ServerCredentials | None:
    """TLS for a server (mTLS when client_ca_file is set); None: plaintext."""
    if not cert_file:
        return None
    return grpc.ssl_server_credentials(
        [(_read_required(key_file), _read_required(cert_file))],
        root_certificates=_read(client_ca_file),
        require_client_auth=bool(client_ca_file))


@dataclass(frozen=True)
class TlsFiles:
    """How a client trusts its server: the CA's certificate (none:
    plaintext), and its own certificate and key for mTLS."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def credentials(self) -> grpc.ChannelCredentials | None:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = ""
                        ) -> grpc.ChannelCredentials | None:
    """TLS for a client (with a client certificate for mTLS); None: plaintext."""
    if not ca_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file),
                                        private_key=_read(key_file),
                                        certificate_chain=_read(cert_file))


def aio_channel(target: str, creds: grpc.ChannelCredentials | None, options=()) -> grpc.aio.Channel:
    opts = [*CHANNEL_OPTIONS, *options]
    if creds is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, creds, options=opts)


MAX_TOKEN_CHARS = 4096


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one);
    Unauthenticated for a token no header can carry (anything but 1 to
    MAX_TOKEN_CHARS printable ASCII characters), which is never sent."""
    if not token:
        return ()
    if len(token) > MAX_TOKEN_CHARS or not all("!" <= ch <= "~" for ch in token):
        raise Unauthenticated(f"a bearer token is 1 to {MAX_TOKEN_CHARS} printable ASCII "
                              "characters without spaces; this one is not (not sent)")
    return (("authorization", f"Bearer {token}"),)


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status code of a Status (or of its number; UNKNOWN for a
    number that names none)."""
    return _GRPC_CODES[Status.of_number(status)]


def status(code: grpc.StatusCode) -> Status:
    """The Status of a gRPC status code."""
    return Status[code.name]


def from_rpc(exc: grpc.RpcError) -> CompilecastError:
    """A failed call as compilecast's error: the one place a client turns
    gRPC's errors into its own."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return received(status(code) if code is not None else Status.UNKNOWN, details or "")


_GRPC_CODES = {s: grpc.StatusCode[s.name] for s in Status}


def token_from(context: grpc.aio.ServicerContext) -> str | None:
    """The bearer token a call carries (`bearer`'s reverse); None without one."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            if not isinstance(value, str):  # (a -bin key's value alone is bytes)
                raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
    return None


async def _abort(context: grpc.aio.ServicerContext, exc: CompilecastError, name: str) -> None:
    log.info("%s refused: %s: %s", name, exc.status.name, exc)
    await context.abort(grpc_code(exc.status), str(exc))


def rpc_errors(fn: Callable) -> Callable:
    """Map CompilecastError raised by a grpc.aio handler to its status code.

    Works for unary handlers and for async-generator (server-streaming)
    handlers. Anything else is a bug: it is logged with its traceback and
    reported as INTERNAL without leaking details.
    """
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except CompilecastError as exc:
                await _abort(context, exc, name)
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception:
                log.exception("%s failed", name)
                await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error")

        return gen_wrapper

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except CompilecastError as exc:
            await _abort(context, exc, name)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error")

    return wrapper



def _parser(cls):
    from_string = wire.parser(cls) if cls.DESCRIPTOR.full_name in wire.BULK else cls.FromString

    def parse(raw: bytes):
        try:
            return from_string(raw)
        except Exception:  # DecodeError and friends: the client sent garbage
            raise InvalidRequest(f"request is not a valid {cls.DESCRIPTOR.full_name}") from None

    return parse


async def _parsed(raw_iter, parse):
    async for raw in raw_iter:
        yield parse(raw)


def _stream_stream(impl: Callable, parse: Callable) -> Callable:
    async def handler(raw_iter, context):
        async for item in impl(_parsed(raw_iter, parse), context):
            yield item
    return handler


def _stream_unary(impl: Callable, parse: Callable) -> Callable:
    async def handler(raw_iter, context):
        return await impl(_parsed(raw_iter, parse), context)
    return handler


async def _parsed_or_refused(raw: bytes, parse: Callable, context: Any) -> Any:
    try:
        return parse(raw)
    except InvalidRequest as exc:
        await context.abort(grpc_code(exc.status), str(exc))


def _unary_stream(impl: Callable, parse: Callable) -> Callable:
    async def handler(raw, context):
        async for item in impl(await _parsed_or_refused(raw, parse, context), context):
            yield item
    return handler


def _unary_unary(impl: Callable, parse: Callable) -> Callable:
    async def handler(raw, context):
        return await impl(await _parsed_or_refused(raw, parse, context), context)
    return handler


# (client streaming, server streaming) -> the handler's shape and gRPC's maker of it
_SHAPES: dict[tuple[bool, bool], tuple[Callable, Callable]] = {
    (True, True): (_stream_stream, grpc.stream_stream_rpc_method_handler),
    (True, False): (_stream_unary, grpc.stream_unary_rpc_method_handler),
    (False, True): (_unary_stream, grpc.unary_stream_rpc_method_handler),
    (False, False): (_unary_unary, grpc.unary_unary_rpc_method_handler),
}


def add_service(server: grpc.aio.Server, servicer: object, service_descriptor: Any,
                message_classes: dict[str, Any]) -> None:
    """Register `servicer` so that undecodable requests get INVALID_ARGUMENT.

    The generated add_*_to_server lets gRPC deserialize requests, and gRPC
    answers a request it cannot decode with INTERNAL. Here requests arrive as
    raw bytes and are parsed inside the handler, where a failure is our
    InvalidRequest. `message_classes` maps message full names to classes.
    """
    handlers = {}
    for method in service_descriptor.methods:
        parse = _parser(message_classes[method.input_type.full_name])
        serialize = (wire.serialize if method.output_type.full_name in wire.BULK + wire.SERIALIZED
                     else message_classes[method.output_type.full_name].SerializeToString)
        shape, make = _SHAPES[(method.client_streaming, method.server_streaming)]
        fn = getattr(servicer, method.name)
        if not (method.client_streaming or method.server_streaming):
            fn = tracing.traced_unary(fn, f"{type(servicer).__name__}.{method.name}")
        handlers[method.name] = make(shape(fn, parse),
                                     request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
