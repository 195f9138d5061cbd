"""The ceiling for bench/decisions.py: a grpc.aio server whose Acquire
answers a fixed HIT and does nothing else, and whose Decide answers every
message as it reads it, each request a HIT (gRPC Python's own cost per
message on a stream).
Usage: python bench/_trivial_server.py PORT"""

from __future__ import annotations

import asyncio
import sys

import grpc

from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc


class Trivial(rpc.CompileCacheServicer):
    async def Acquire(self, request, context):
        return pb.AcquireResponse(decision=pb.HIT, artifact=pb.ArtifactInfo(
            key=request.key, digest="ab" * 32, size=100))

    async def Decide(self, request_iterator, context):
        async for msg in request_iterator:
            yield pb.DecideResponse(id=msg.id, responses=[
                pb.AcquireResponse(decision=pb.HIT, artifact=pb.ArtifactInfo(
                    key=r.key, digest="ab" * 32, size=100)) for r in msg.requests])


async def main(port: int) -> None:
    server = grpc.aio.server()
    rpc.add_CompileCacheServicer_to_server(Trivial(), server)  # type: ignore[abstract]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
