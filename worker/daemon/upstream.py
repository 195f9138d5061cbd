"""The worker's calls upstream, to the coordinator and to peer workers: idle and stall deadlines on their streams, a holder's Publish forwarded, relayed chunks, and the status a coordinator's refusal is passed on with."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable

import grpc

from compilecast import wire
from compilecast.errors import Status, UpstreamError
from compilecast.grpcutil import PEER_OPTIONS, aio_channel, bearer, status, token_from
from compilecast.rpcedge import aedged
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import HEARTBEAT_S, TRANSFER_S, DataChunk

from ..inprocess.received import UploadRefused

PEER_IDLE_S = 30.0  # a relaying peer that sends nothing this long is left for the coordinator
UPSTREAM_IDLE_S = 120.0  # a coordinator stream silent this long (it heartbeats every 10 s) failed
MAX_CREDENTIALS = 256  # callers' credentials whose host-cache namespace is remembered


class CoordinatorLink:
    """The worker's way upstream: its channel to the coordinator, channels
    to peer workers, and the credential each caller's calls go up with.

    A caller's own bearer token (a per-job token) is forwarded as is and gets
    a host-cache namespace of its own; callers without one act as this worker
    (namespace "host")."""

    def __init__(self, address: str, *, token: str, rpc_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None,
                 peer_credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self.token = token
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = aio_channel(address, credentials)
        # The link's error edge: a call upstream that fails raises Relayed,
        # never gRPC's error (compilecast/rpcedge.py). The Decide stream's
        # client (compilecast/decide.py) is an edge of its own, over `decisions`.
        self.up = aedged(wire.stub(self.channel), relayed)
        self.decisions = wire.stub(self.channel)
        self.peer_credentials = peer_credentials
        self._peers: dict[str, tuple[grpc.aio.Channel, rpc.CompileCacheAsyncStub]] = {}
        self.namespaces: dict[tuple, str] = {}  # upstream metadata -> host-cache namespace

    def peer(self, address: str) -> rpc.CompileCacheAsyncStub:
        if address not in self._peers:
            channel = aio_channel(address, self.peer_credentials, PEER_OPTIONS)
            self._peers[address] = (channel, aedged(wire.stub(channel), relayed))
        return self._peers[address][1]

    def credential(self, context: grpc.aio.ServicerContext) -> tuple[str, tuple]:
        """(host-cache namespace, upstream metadata) for a caller."""
        caller = token_from(context)
        if caller == self.token:  # a peer worker relaying for its host: the same identity
            caller = ""
        token = caller or self.token
        ns = hashlib.sha256(f"caller:{caller}".encode()).hexdigest()[:16] if caller else "host"
        if len(self.namespaces) >= MAX_CREDENTIALS:
            self.namespaces.pop(next(iter(self.namespaces)))
        self.namespaces[bearer(token)] = ns
        return ns, bearer(token)

    def namespace(self, md: tuple) -> str:
        """The host-cache namespace of upstream metadata `md`."""
        return self.namespaces.get(md, "host")

    async def close(self) -> None:
        await self.channel.close()
        for channel, _ in self._peers.values():
            await channel.close()



RELAY_PIECE = 512 << 10  # bytes of a message to a peer (chunks arrive 2 MiB at a time)


def relay_pieces(chunk):
    """`chunk` as messages of at most RELAY_PIECE bytes of data (or of zstd
    stream). A peer can pass bytes on only once it holds a whole message, so
    at every hop of a relay a chunk waits for the time its message takes on
    the link: pieces make that wait a quarter of a chunk's, at the price of
    one copy (a chunk otherwise goes on as it was received)."""
    if type(chunk) is not DataChunk or chunk.size <= RELAY_PIECE:
        yield chunk
        return
    zstd = len(chunk.zstd_data) > 0
    view = memoryview(chunk.zstd_data if zstd else chunk.data)
    for at in range(0, len(view), RELAY_PIECE):
        piece = view[at:at + RELAY_PIECE]
        yield DataChunk(b"", piece) if zstd else DataChunk(piece)


async def unless_stalled(call, moved: list[float], stall_s: float, what: str):
    """The result of a streaming `call`; cancelled, as DEADLINE_EXCEEDED, once
    `moved[0]` (when it last moved bytes) is `stall_s` old: a big artifact
    takes as long as it moves, a stuck one is given up."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=stall_s / 4)
            if done:
                return task.result()
            if time.monotonic() - moved[0] > stall_s:
                call.cancel()
                await asyncio.wait({task})
                if not task.cancelled():
                    task.exception()  # retrieved: the stall is what the caller hears
                raise UpstreamError(Status.DEADLINE_EXCEEDED,
                                    f"{what} moved nothing for {stall_s:g}s")
    finally:
        if not task.done():  # our caller went away: so does the call
            call.cancel()


async def forward_publish(stub, chunks: AsyncIterator[pb.PublishChunk], md: tuple,
                           moved: list[float], what: str) -> pb.PublishResponse:
    """Send `chunks` upstream as one Publish. Where reading them fails (the
    holder's stream was malformed: a second header, zstd_data, no digest at
    its end), the call is cancelled and that error is raised: gRPC itself
    would only log it and leave the call open until its deadline."""
    broken: list[BaseException] = []
    call = None

    async def guarded() -> AsyncIterator[pb.PublishChunk]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:
            broken.append(exc)
            if call is not None:
                call.cancel()
            raise

    call = stub.Publish(guarded(), timeout=TRANSFER_S, metadata=md)
    try:
        return await unless_stalled(call, moved, UPSTREAM_IDLE_S, what)
    except (asyncio.CancelledError, UpstreamError):
        if broken:
            raise broken[0] from None
        raise


async def heartbeats_until(done: asyncio.Future,
                           beat: Callable[[], pb.FetchChunk] = pb.FetchChunk):
    """`beat()` (an empty FetchChunk), one every HEARTBEAT_S, until `done`
    is: a fetch that waits for its bytes shows its reader it is alive."""
    while not done.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), HEARTBEAT_S)
        if not done.done():
            yield beat()


def digest_matches(info: pb.ArtifactInfo | None, digest: str) -> bool:
    """Whether `info` is the artifact a fetch asking for `digest` (or any) wants."""
    return info is not None and (not digest or info.digest == digest)


def ticketed(info: pb.ArtifactInfo, ticket: pb.DataTicket | None) -> pb.FetchChunk | None:
    """A relay's answer with a data ticket: the header and the ticket; None without one."""
    return pb.FetchChunk(artifact=info, data_ticket=ticket) if ticket else None


class Relayed(UpstreamError):
    """A call upstream (to the coordinator, or a peer worker) that failed, as
    the link's edge raises it: `status` is what the worker's own caller is
    told (a stream reset or an upstream bug, INTERNAL or UNKNOWN, is
    UNAVAILABLE: retry or compile locally); `code` and `details` are what the
    call itself ended with."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(Status.UNAVAILABLE if code in (Status.INTERNAL, Status.UNKNOWN)
                         else code, f"coordinator: {details}")
        self.code = code
        self.details = details


def relayed(exc: grpc.RpcError) -> Relayed:
    """The edge's error for a failed call upstream."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return Relayed(status(code) if code is not None else Status.UNKNOWN, details or "")


def relay_error(exc: UploadRefused | UpstreamError) -> UpstreamError:
    """The coordinator's status for our caller (see Relayed)."""
    if isinstance(exc, Relayed):
        return exc
    if isinstance(exc, UploadRefused):
        return Relayed(exc.status, exc.details)
    return Relayed(exc.status, str(exc))
