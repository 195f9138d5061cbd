"""The asynchronous shell of the client policy (worker/inprocess/policy.py):
a host's worker API called from an event loop (the PJRT gate) as a process
of the host calls it. Every call goes through the async edge
(compilecast/rpcedge.py: compilecast's errors, never gRPC's) and the retry
policy of its kind (compilecast/retry.py); fetched bytes are verified
against their digest (CorruptBlob), and a fetch whose bytes stop coming is
given up (Stalled). Each call carries its caller's credential (`md`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from compilecast import retry, validate, wire
from compilecast.deadline import Deadline
from compilecast.decide import ends_wait
from compilecast.errors import CompilecastError, CorruptBlob, CutOff, Unavailable
from compilecast.grpcutil import aio_channel
from compilecast.rpcedge import aedged
from compilecast.streams import idle_timeout
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import TRANSFER_S, as_chunks

from .clientpublish import publish_messages
from .identity import Identity
from .policy import keepalive_every
from .received import Stalled

log = logging.getLogger(__name__)


def _nothing(n: int) -> None:
    return None


class AsyncCacheClient:
    """The CompileCache API at `target` (a host's worker), asynchronously;
    `rpc_s` bounds each call but the waits (which their server bounds) and
    the transfers (which go on while bytes move, each gap at most `rpc_s`)."""

    def __init__(self, target: str, rpc_s: float) -> None:
        self.target = target
        self.rpc_s = rpc_s
        self.channel = aio_channel(target, None)
        self.stub = aedged(wire.stub(self.channel))

    async def close(self) -> None:
        await self.channel.close()

    async def acquire(self, request: pb.AcquireRequest, md: tuple) -> pb.AcquireResponse:
        return await retry.ACQUIRE.arun(
            lambda: self.stub.Acquire(request, timeout=self.rpc_s, metadata=md),
            what=f"the ask for {request.key}")

    async def wait(self, key: str, identity: Identity, deadline: Deadline,
                   md: tuple) -> pb.WaitEvent:
        """The event that ends a wait for `key` (HIT, COMPILE, COMPILE_LOCALLY)
        by `deadline` (the door's share-binary deadline)."""

        async def once() -> pb.WaitEvent:
            call = self.stub.Wait(pb.WaitRequest(key=key, requester=identity.requester(),
                                                 timeout_ms=deadline.left_ms()),
                                  timeout=max(0.001, deadline.left_s()) + self.rpc_s,
                                  metadata=md)
            try:
                async for event in call:
                    if ends_wait(event, False):
                        return event
            finally:
                call.cancel()
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason="the wait ended early")

        return await retry.WAIT.arun(once, what=f"the wait for {key}", deadline=deadline)

    async def fetch(self, key: str, digest: str, md: tuple, *,
                    take: Callable[[int], None] = _nothing,
                    give: Callable[[int], None] = _nothing) -> bytes:
        """The artifact's bytes, verified against `digest`; `take` and `give`
        charge its size to a memory budget while it is received."""
        return await retry.FETCH.arun(lambda: self._fetch_once(key, digest, md, take, give),
                                      what=f"the fetch of {key}")

    async def _fetch_once(self, key: str, digest: str, md: tuple,
                          take: Callable[[int], None], give: Callable[[int], None]) -> bytes:
        call = self.stub.Fetch(pb.FetchRequest(key=key, digest=digest), timeout=TRANSFER_S,
                               metadata=md)
        parts: list[bytes] = []
        h = hashlib.sha256()
        held = 0
        try:
            async for chunk in idle_timeout(call, self.rpc_s):
                if chunk.HasField("artifact") and not held:
                    if chunk.artifact.digest != digest:
                        raise CorruptBlob(f"the worker answered {key} with "
                                          f"{chunk.artifact.digest}, not {digest}")
                    take(chunk.artifact.size)
                    held = chunk.artifact.size
                if chunk.data:
                    h.update(chunk.data)
                    parts.append(chunk.data)
        except TimeoutError:
            raise Stalled(f"the fetch of {key} moved nothing for {self.rpc_s:g}s") from None
        except Unavailable as exc:
            if held and not isinstance(exc, CutOff):
                raise CutOff(str(exc)) from None
            raise
        finally:
            call.cancel()
            give(held)
        if h.hexdigest() != digest:
            raise CorruptBlob(f"the bytes of {key} hash to {h.hexdigest()}, not {digest}; "
                              "discarded")
        return b"".join(parts)

    async def keep(self, key: str, lease: pb.Lease, md: tuple) -> None:
        """Renew the lease until cancelled, or until it is no more."""
        every = keepalive_every(lease)
        while True:
            await asyncio.sleep(every)
            try:
                left = await self.stub.KeepAlive(pb.KeepAliveRequest(key=key, lease=lease),
                                                 timeout=self.rpc_s, metadata=md)
            except CompilecastError as exc:
                log.debug("keepalive for %s failed: %s", key, exc.status.name)
                continue
            if left.ttl_seconds <= 0:
                return

    async def publish(self, key: str, lease: pb.Lease, identity: Identity, data: bytes,
                      seconds: float, md: tuple) -> pb.ArtifactInfo:
        digest = hashlib.sha256(data).hexdigest()
        header = pb.PublishHeader(key=key, lease=lease, size=len(data),
                                  compile_time_seconds=seconds, requester=identity.requester(),
                                  digest=digest)

        async def once() -> pb.ArtifactInfo:
            got = await self.stub.Publish(as_chunks(publish_messages(header, data)),
                                          timeout=TRANSFER_S, metadata=md)
            return got.artifact

        # (AlreadyPublished after a lost answer: the policy's settle finds its own bytes)
        return await retry.PUBLISH.arun(once, what=f"the publish of {key}")

    async def describe(self, key: str, md: tuple) -> pb.DescribeKeyResponse:
        return await self.stub.DescribeKey(pb.DescribeKeyRequest(key=key), timeout=self.rpc_s,
                                           metadata=md)

    async def release(self, key: str, lease: pb.Lease, reason: pb.ReleaseReason.ValueType,
                      detail: str, md: tuple) -> None:
        await self.stub.Release(pb.ReleaseRequest(key=key, lease=lease, reason=reason,
                                                  detail=detail[:validate.MAX_DETAIL_LEN]),
                                timeout=self.rpc_s, metadata=md)
