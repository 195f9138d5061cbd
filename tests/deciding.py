"""Shared by the Decide stream's tests: requests, a fed message stream, and
a Decider over a real channel (to a coordinator, or to a server of the
test's own)."""

from __future__ import annotations

import asyncio

import grpc

from compilecast import decide
from compilecast.grpcutil import aio_channel
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient

DATA = b"decided" * 10_000


def ask(key: str, **requester) -> pb.AcquireRequest:
    return pb.AcquireRequest(key=key, requester=pb.Requester(**requester))


def published(target: str, key: str) -> pb.ArtifactInfo:
    """Publish DATA under `key` as its first asker; its ArtifactInfo."""
    c = CacheClient(target)
    try:
        return c.publish(key, c.acquire(key).lease, DATA, 1.0)
    finally:
        c.close()


def fed():
    """A queue to put Decide messages in (None ends the stream) and the
    stream `serve` reads them from."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def messages():
        while (msg := await inbox.get()) is not None:
            yield msg

    return inbox, messages()


async def with_decider(target: str, body, metadata: tuple = ()):
    channel = aio_channel(target, None)
    decider = decide.Decider(rpc.CompileCacheStub(channel), metadata, timeout_s=10)
    try:
        return await body(decider)
    finally:
        await decider.close()
        await channel.close()


async def against(servicer, body):
    """with_decider against a server of the test's own (an odd coordinator)."""
    server = grpc.aio.server()
    rpc.add_CompileCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await with_decider(f"127.0.0.1:{port}", body)
    finally:
        await server.stop(0)
