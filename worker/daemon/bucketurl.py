"""A download straight from the coordinator's object-store bucket.

A coordinator whose store is a bucket may answer a worker's Fetch with a
presigned GET of the artifact's object (FetchChunk.url, cache.proto) instead
of its bytes: the bytes then go from the bucket to the worker and never
through the coordinator. The object's body is the artifact, uncompressed;
the worker verifies its digest as for every download.
"""

from __future__ import annotations

import asyncio
import functools
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

from compilecast.negotiate import Route
from compilecast.streams import opened
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk

from .dataplane import FillEnd

PIECE = 4 << 20
CONNECT_S = 10.0


class BucketUrl(FillEnd):
    """The bucket itself, by the presigned GET a Fetch was answered with."""

    route = Route.BUCKET_URL

    async def chunks(self, call, target: str, used: list[FillEnd],
                     where: str = "") -> AsyncIterator:
        """A URL (the only message, next to the artifact) stands for the
        chunks its GET brings, as a gRPC fetch of the raw artifact would
        send them; this route's failure when the GET fails or ends short
        (lasting: it could not connect)."""
        async for chunk in call:
            if not (chunk.HasField("artifact") and chunk.url):
                yield chunk
                continue
            info = chunk.artifact
            yield pb.FetchChunk(artifact=info)
            used.append(self)
            try:
                resp = await opened(functools.partial(urllib.request.urlopen, chunk.url,
                                                       timeout=CONNECT_S))
            except urllib.error.HTTPError as exc:
                raise self.failed(f"the bucket answered its presigned GET with "
                                  f"{exc.code}") from None
            except (OSError, ValueError) as exc:
                raise self.failed(f"the bucket could not be reached: {exc}",
                                  lasting=True) from None
            got = 0
            with resp:
                try:
                    while piece := await asyncio.to_thread(resp.read, PIECE):
                        got += len(piece)
                        yield DataChunk(piece)
                except OSError as exc:
                    raise self.failed(f"the bucket's GET broke off after {got} "
                                      f"bytes: {exc}") from None
            if got != info.size:
                raise self.failed(f"the bucket's GET sent {got} of {info.size} bytes")
            return
