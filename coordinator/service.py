"""The CompileCache gRPC service of the coordinator: decoding, then the core."""

from __future__ import annotations

from collections.abc import AsyncIterator

from compilecast.errors import InvalidRequest
from compilecast.grpcutil import rpc_errors
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc

from .state import CoordinatorState


async def publish_stream(request_iterator) -> tuple[pb.PublishHeader, AsyncIterator[bytes]]:
    """Split a Publish stream into its header and its data chunks."""
    first = None
    async for msg in request_iterator:
        first = msg
        break
    if first is None or not first.HasField("header"):
        raise InvalidRequest("the first Publish message must carry the header")

    async def data() -> AsyncIterator[bytes]:
        if first.data:
            yield first.data
        async for msg in request_iterator:
            if msg.HasField("header"):
                raise InvalidRequest("only the first Publish message may carry a header")
            yield msg.data

    return first.header, data()


class CoordinatorService(rpc.CompileCacheServicer):
    def __init__(self, state: CoordinatorState) -> None:
        self.state = state

    @rpc_errors
    async def Acquire(self, request, context):
        return await self.state.acquire(request.key, request.requester,
                                        dict(request.key_components), request.program_name)

    @rpc_errors
    async def Wait(self, request, context):
        async for event in self.state.wait(request.key, request.requester, request.timeout_ms):
            yield event

    @rpc_errors
    async def Publish(self, request_iterator, context):
        header, chunks = await publish_stream(request_iterator)
        info = await self.state.publish(header, chunks)
        return pb.PublishResponse(artifact=info)

    @rpc_errors
    async def Release(self, request, context):
        await self.state.release(request.key, request.lease, request.reason, request.detail)
        return pb.ReleaseResponse()

    @rpc_errors
    async def Fetch(self, request, context):
        info, chunks = await self.state.fetch(request.key, request.digest)
        first = True
        async for data in chunks:
            if first:
                yield pb.FetchChunk(artifact=info, data=data)
                first = False
            else:
                yield pb.FetchChunk(data=data)

    @rpc_errors
    async def KeepAlive(self, request, context):
        ttl = await self.state.keepalive(request.key, request.lease)
        return pb.KeepAliveResponse(ttl_seconds=ttl)

    @rpc_errors
    async def DescribeKey(self, request, context):
        return await self.state.describe(request.key)

    @rpc_errors
    async def Status(self, request, context):
        return await self.state.status()
