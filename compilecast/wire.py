"""Artifact bytes on the wire without protobuf's copies.

Almost every message of a Fetch or Publish stream is a FetchChunk or
PublishChunk that holds nothing but `data` (field 2, bytes). Building and
parsing those through protobuf copies each chunk into and out of the
message's arena, and on a loopback stream that cost two thirds of the
throughput (1 MiB messages: 280-310 MB/s through protobuf, 750-1,000 MB/s for
the same bytes unframed; BENCHMARKS.md). Here such a message is encoded by hand, the field's
tag and length in front of the bytes, and decoded as a view of the received
buffer. The bytes on the wire are exactly what protobuf would write, so any
gRPC client of the API reads and writes them as usual; messages that carry
anything else go through protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast, overload

import grpc
from google.protobuf.message import Message

from compilecast import validate
from compilecast.errors import InvalidRequest, status_of
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

log = logging.getLogger(__name__)

# A data plane connection (coordinator/dataplane.py) begins with these 8
# bytes and a ticket's token; then the blob comes back as stored.
DATA_PLANE_REQUEST = b"CCGET01\n"
DATA_PLANE_TOKEN_BYTES = 32
# ... or, for an upload (a ticket from OpenUpload), with these 8 bytes and
# the token; status frames then tell the client to send, and how it ended.
DATA_PLANE_UPLOAD = b"CCPUT01\n"
# ... or, for a wait (a ticket from Wait), with these 8 bytes and the token;
# one status frame answers when the wait ends, and the blob may follow it.
DATA_PLANE_WAIT = b"CCWAT01\n"
# ... and on a worker's handoff socket (worker/daemon/handoff.py), a process hands a
# sealed file with these 8 bytes and the token.
DATA_PLANE_HANDOFF = b"CCFDS01\n"

# Timings every route shares (each defined here only):
HEARTBEAT_S = 10.0  # a stream that has nothing to carry sends an empty message this often
TRANSFER_S = 4 * 3600.0  # the longest a transfer may take while it moves
REQUEST_S = 10.0  # a data plane connection that has not sent its token by then is closed
TICKET_S = 30.0  # a one-time ticket not redeemed by then is dropped (its file closed)
UNACKED_S = 60  # a peer that takes nothing sent for this long is dropped (TCP_USER_TIMEOUT)
WAIT_RETRY_S = (0.5, 1.0, 2.0, 4.0)  # a wait cut off (a server restarting) is sent again after these


async def data_plane_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             timeout_s: float,
                             unacked_s: float) -> tuple[bytes, bytes] | None:
    """The 8 magic bytes and the token a data plane connection (asyncio's
    `reader` and `writer`) begins with; None when they do not come within
    `timeout_s`. A peer that takes nothing sent for `unacked_s` is dropped
    from then on (TCP_USER_TIMEOUT)."""
    with contextlib.suppress(OSError, AttributeError):
        writer.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(unacked_s * 1000))
    try:
        request = await asyncio.wait_for(
            reader.readexactly(len(DATA_PLANE_REQUEST) + DATA_PLANE_TOKEN_BYTES), timeout_s)
    except (TimeoutError, asyncio.IncompleteReadError, OSError):
        return None
    return request[:len(DATA_PLANE_REQUEST)], request[len(DATA_PLANE_REQUEST):]


class TicketServer:
    """The listener both data planes share (coordinator/dataplane.py,
    worker/daemon/relayplane.py): connections served by `self._serve` as tasks,
    one-time tickets each holding an open file."""

    name = "data plane"

    def __init__(self, listen: str) -> None:
        self.listen = listen
        self.port = 0
        self._tickets: dict[bytes, Any] = {}  # token -> a ticket with an open `file`
        self._server: asyncio.Server | None = None
        self._sends: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        host, _, port = self.listen.rpartition(":")
        self._server = await asyncio.start_server(self._serve, host.strip("[]"), int(port))
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s listening on %s:%d", self.name, host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._sends):
            task.cancel()
        for ticket in self._tickets.values():
            ticket.file.close()
        self._tickets.clear()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._sends)

    @property
    def address(self) -> str:
        """Where a ticket says its bytes are: ":port", on the host the client dialed."""
        return f":{self.port}"

    def _issue(self, tickets: dict[bytes, Any], ticket: Any) -> pb.DataTicket:
        """Keep `ticket` in `tickets` under a fresh one-time token; the
        client's DataTicket for it."""
        token = secrets.token_bytes(DATA_PLANE_TOKEN_BYTES)
        tickets[token] = ticket
        return pb.DataTicket(address=self.address, token=token)

    @staticmethod
    def _take_expired(tickets: dict[bytes, Any]) -> list[Any]:
        """Take the entries of `tickets` whose `expires` has passed out of
        it; those entries."""
        now = time.monotonic()
        return [tickets.pop(t) for t in [t for t, v in tickets.items() if v.expires < now]]

    def _expire_tickets(self) -> int:
        """Drop the tickets whose `expires` has passed, closing their files;
        how many went."""
        gone = self._take_expired(self._tickets)
        for ticket in gone:
            ticket.file.close()
        return len(gone)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


def status_frame(code: int, payload: bytes = b"") -> bytes:
    """A data plane upload's status frame: a gRPC status code (0: OK), the
    payload's length (4 bytes, big-endian) and the payload."""
    return bytes((code,)) + len(payload).to_bytes(4, "big") + payload


STATUS_FRAME_MAX = 1 << 20  # a longer payload is not a status frame


def refusal_frame(exc: BaseException, where: str) -> bytes:
    """The status frame of an upload that failed with `exc`: a
    CompilecastError's status and message, anything else (a bug, logged by
    the caller) INTERNAL without its details."""
    status, message = status_of(exc, where)
    return status_frame(status, message.encode()[:4096])


def status_length(head: bytes, where: str) -> int:
    """The payload length a status frame's 5-byte head announces; OSError
    (EPROTO) when it is no status frame's."""
    n = int.from_bytes(head[1:5], "big")
    if len(head) != 5 or n > STATUS_FRAME_MAX:
        raise OSError(errno.EPROTO, f"{where} sent no status frame")
    return n


DATA_TAG = 0x12  # field 2, length-delimited: `data` in both FetchChunk and PublishChunk
ZSTD_TAG = 0x22  # field 4, length-delimited: `zstd_data` in both
assert pb.FetchChunk.DESCRIPTOR.fields_by_name["data"].number == 2
assert pb.PublishChunk.DESCRIPTOR.fields_by_name["data"].number == 2
assert pb.FetchChunk.DESCRIPTOR.fields_by_name["zstd_data"].number == 4
assert pb.PublishChunk.DESCRIPTOR.fields_by_name["zstd_data"].number == 4


class Zstd(bytes):
    """Bytes of a blob's zstd stream (not the artifact's bytes): framed as
    `zstd_data`."""

    __slots__ = ()


class DataChunk:
    """A FetchChunk or PublishChunk whose only field is `data`, or whose
    only field is `zstd_data` (bytes or a memoryview): read like the message
    it stands for."""

    __slots__ = ("data", "wire", "zstd_data")
    relay_from = ""
    local_growing = False

    def __init__(self, data: bytes | memoryview, zstd_data: bytes | memoryview = b"") -> None:
        self.data = data
        self.zstd_data = zstd_data
        self.wire: bytes | None = None

    @classmethod
    def framed(cls, data: bytes | memoryview) -> DataChunk:
        """Encoded now (on a reader thread, off the event loop); `data` (or,
        for Zstd bytes, `zstd_data`) is then a view of the encoded message."""
        zstd = type(data) is Zstd
        wire = _encode(data, ZSTD_TAG if zstd else DATA_TAG)
        view = memoryview(wire)[len(wire) - len(data):]
        chunk = cls(b"", view) if zstd else cls(view)
        chunk.wire = wire
        return chunk

    @property
    def size(self) -> int:
        """Bytes it carries on the wire (of the artifact, or of its zstd stream)."""
        return len(self.data) + len(self.zstd_data)

    def HasField(self, name: str) -> bool:
        return False


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _encode(data: bytes | memoryview, tag: int = DATA_TAG) -> bytes:
    return b"".join((bytes((tag,)), _varint(len(data)), data))


def serialize(msg: Message | DataChunk | bytes) -> bytes:
    if isinstance(msg, bytes):  # serialized once, sent to many (SERIALIZED)
        return msg
    if isinstance(msg, DataChunk):
        if msg.wire is not None:
            return msg.wire
        return _encode(msg.zstd_data, ZSTD_TAG) if msg.zstd_data else _encode(msg.data)
    wire: bytes = msg.SerializeToString()
    return wire


def _data_only(raw: bytes) -> memoryview | None:
    """The payload when `raw` is exactly one `data` or `zstd_data` field, else None."""
    if not raw or raw[0] not in (DATA_TAG, ZSTD_TAG):
        return None
    n = shift = 0
    i = 1
    for i in range(1, min(len(raw), 11)):  # a length takes at most 10 bytes
        b = raw[i]
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    else:
        return None
    return memoryview(raw)[i + 1:] if i + 1 + n == len(raw) else None


def parser(cls: type[Message]) -> Callable[[bytes], Message | DataChunk]:
    """FromString for `cls`, with data-only messages as DataChunk views."""

    def parse(raw: bytes) -> Message | DataChunk:
        data = _data_only(raw)
        if data is None:
            return cls.FromString(raw)
        chunk = DataChunk(data) if raw[0] == DATA_TAG else DataChunk(b"", data)
        chunk.wire = raw  # passed on as received (a worker relaying it copies nothing)
        return chunk

    return parse


# Messages whose streams carry artifact bytes.
BULK = (pb.FetchChunk.DESCRIPTOR.full_name, pb.PublishChunk.DESCRIPTOR.full_name)
# Answers a handler may give already serialized (one job's manifest or news, sent to every host).
SERIALIZED = (pb.Manifest.DESCRIPTOR.full_name, pb.JobEvents.DESCRIPTOR.full_name)

_SERVICE = pb.DESCRIPTOR.services_by_name["CompileCache"].full_name
_FETCH = f"/{_SERVICE}/Fetch"
_PUBLISH = f"/{_SERVICE}/Publish"


@overload
def stub(channel: grpc.aio.Channel) -> rpc.CompileCacheAsyncStub: ...
@overload
def stub(channel: grpc.Channel) -> rpc.CompileCacheStub: ...  # type: ignore[overload-cannot-match]
# (mypy reads grpc untyped, so both channels as Any; Pyright reads grpc's stubs)
def stub(channel: Any) -> Any:
    """A CompileCache stub (sync or aio channel: typed as each) whose Fetch
    and Publish use the codec above."""
    s = rpc.CompileCacheStub(channel)
    s.Fetch = channel.unary_stream(_FETCH, request_serializer=pb.FetchRequest.SerializeToString,
                                   response_deserializer=parser(pb.FetchChunk))
    s.Publish = channel.stream_unary(_PUBLISH, request_serializer=serialize,
                                     response_deserializer=pb.PublishResponse.FromString)
    return s


__all__ = ["BULK", "SERIALIZED", "DataChunk", "Zstd", "as_chunks", "parser", "serialize", "stub"]


def as_chunks(messages: Iterator[pb.PublishChunk | DataChunk]) -> Iterator[pb.PublishChunk]:
    """A Publish's messages as the generated stub's type says it takes them
    (stub()'s Publish takes DataChunk as well: its codec writes either)."""
    return cast(Iterator[pb.PublishChunk], messages)


async def publish_stream(request_iterator: AsyncIterator[pb.PublishChunk | DataChunk]
                         ) -> tuple[pb.PublishHeader, AsyncIterator[DataChunk]]:
    """Split a Publish stream into its header and its data chunks (a chunk
    that arrived data-only keeps its frame: a worker forwards it as is).
    A header without a digest gets the one the last message carries once
    the chunks have all been read; a stream that ends without it, or goes
    on after it, is refused."""
    first = None
    async for msg in request_iterator:
        first = msg
        break
    if first is None or isinstance(first, DataChunk) or not first.HasField("header"):
        raise InvalidRequest("the first Publish message must carry the header")
    opening: pb.PublishChunk = first
    header = opening.header
    later = not header.digest  # the digest comes last

    def ends(msg: pb.PublishChunk) -> bool:
        if not msg.digest:
            return False
        if not later:
            raise InvalidRequest("a Publish sends its digest in the header or last, not both")
        header.digest = validate.digest(msg.digest)
        return True

    async def data() -> AsyncIterator[DataChunk]:
        if opening.data or opening.zstd_data:
            yield DataChunk(opening.data, opening.zstd_data)
        done = ends(opening)
        async for msg in request_iterator:
            if done:
                raise InvalidRequest("the message with the digest must be a Publish's last")
            if isinstance(msg, DataChunk):
                yield msg
                continue
            if msg.HasField("header"):
                raise InvalidRequest("only the first Publish message may carry a header")
            if msg.data or msg.zstd_data:
                yield DataChunk(msg.data, msg.zstd_data)
            done = ends(msg)
        if not header.digest:
            raise InvalidRequest("the Publish ended without its digest (the header left it "
                                 "empty, and no last message carried it)")

    return header, data()
