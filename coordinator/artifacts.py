"""An artifact's way in and out of the coordinator: publishes (write-once,
by the lease holder only, fenced by the lease's revision, after the blob is
durably stored: the rules in coordinator/state.py's opening), releases and
lease renewals, and fetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from compilecast import tracing, validate
from compilecast.blobstore import amake_room, aread
from compilecast.errors import (
    AlreadyPublished,
    CorruptBlob,
    InvalidRequest,
    LeaseError,
    NotFound,
    Revoked,
    StoreFull,
    Unavailable,
)
from compilecast.store import ArtifactStore
from compilecast.streams import Inflate
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import DataChunk

from .claims import Claims
from .etcd import (
    KV,
    cmp_absent,
    cmp_mod_revision,
    op_delete,
    op_put,
)
from .farm import Farm
from .keystate import (
    KeyState,
    revocation_reason,
)
from .keyview import Keyspace
from .records import (
    DEFAULT_TENANT,
    info_from,
    info_json,
    plain,
    read_info,
    scope,
    tenant_of,
)
from .uploads import Uploads
from .uploads import stream as stream_upload

log = logging.getLogger("compilecast.coordinator.state")


def _in_flight(key: str, header: pb.PublishHeader) -> pb.ArtifactInfo:
    """What fetchers of an upload in progress are told about it."""
    return pb.ArtifactInfo(key=key, digest=header.digest, size=header.size,
                           compile_time_seconds=header.compile_time_seconds)

def _store_zstd(writer, inflate: Inflate, stream) -> None:
    """Store a publish sent as zstd as it came, its decoded bytes verified
    (a stream that does not decode, or decodes past the declared size, is
    the publisher's error)."""
    writer.write_zstd(stream)
    try:
        inflate.feed(stream)
    except CorruptBlob as exc:
        raise InvalidRequest(f"zstd_data: {exc}") from None


@dataclass(frozen=True)
class ArtifactSettings:
    publish_stream_readers: int = 0  # waiters an upload in progress streams to (0: none)
    max_artifact_bytes: int = 4 << 30  # a larger publish is refused
    local_marker_ttl_s: int = 30  # how long a "compile locally" verdict stands


class ArtifactMetrics(Protocol):
    """What the artifacts' way in and out records (CoordinatorMetrics is one)."""

    @property
    def bytes(self) -> Any: ...

    @property
    def corrupt_blobs(self) -> Any: ...

    @property
    def publishes(self) -> Any: ...

    @property
    def releases(self) -> Any: ...

    @property
    def streamed_while_publishing(self) -> Any: ...


class Artifacts:
    """Publish, Release, KeepAlive and Fetch of one replica."""

    def __init__(self, settings: ArtifactSettings, keys: Keyspace, claims: Claims,
                 store: ArtifactStore, metrics: ArtifactMetrics, uploads: Uploads,
                 farm: Farm) -> None:
        self.settings = settings
        self.view = keys.view
        self.claims = claims
        self.etcd = keys.etcd
        self.store = store
        self.presence = keys.view.presence  # the replica's one, which the view checks with too
        self.metrics = metrics
        self.uploads = uploads
        self.farm = farm
        self.leases = keys.leases
        # Publishes write on threads of their own, never queued behind readers.
        self._publish_threads = ThreadPoolExecutor(4, thread_name_prefix="publish")

    def close(self) -> None:
        self._publish_threads.shutdown(wait=False)

    # -- Publish ---------------------------------------------------------
    async def publish(self, header: pb.PublishHeader, chunks: AsyncIterator[DataChunk], *,
                      tenant: str = DEFAULT_TENANT) -> pb.ArtifactInfo:
        key = self._checked_header(header)
        with self._counting_refusals(key):
            return await self._publish(scope(tenant, key), header, chunks)

    async def check_publish(self, header: pb.PublishHeader, *,
                            tenant: str = DEFAULT_TENANT) -> None:
        """Raise what a Publish with this header would be refused with before
        its first byte (a bad header, a lease not held, a key published or a
        digest purged); the upload's publish checks it all again."""
        key = self._checked_header(header)
        with self._counting_refusals(key):
            await self._may_publish(scope(tenant, key), header)

    @contextlib.contextmanager
    def _counting_refusals(self, key: str) -> Iterator[None]:
        """Count a publish that fails in the block by its exception (and log
        a full store)."""
        try:
            yield
        except Exception as exc:
            self.metrics.publishes.labels(type(exc).__name__).inc()
            if isinstance(exc, StoreFull):
                log.error("refused the publish of %s: %s", key, exc, extra={"key": key})
            raise

    def _checked_header(self, header: pb.PublishHeader) -> str:
        key = validate.publish_header(header, self.settings.max_artifact_bytes)
        if header.HasField("recipe"):
            validate.recipe(header.recipe, need_target=False)
        return key

    async def _may_publish(self, sk: str, header: pb.PublishHeader) -> str:
        """Which record the header's lease holds (see _check_holder), once
        the key is not published and a digest sent first is not purged."""
        kind = await self.claims.check_holder(sk, header.lease, header.requester)
        reads = [self.view.k("a", sk)]
        if header.digest:  # else sent last: checked against revocations once known
            reads.append(self.view.revocation(tenant_of(sk), header.digest))
        entry, *revoked = await self.etcd.get_many(reads)
        if entry is not None:
            raise AlreadyPublished(f"key {plain(sk)} is already published")
        if revoked and revoked[0] is not None:
            raise await self._refuse_revoked(sk, kind, header, revoked[0], "was purged")
        return kind

    async def _publish(self, sk: str, header: pb.PublishHeader,
                       chunks: AsyncIterator[DataChunk]) -> pb.ArtifactInfo:
        key = plain(sk)
        later = not header.digest  # sent last: checked against revocations once known
        kind = await self._may_publish(sk, header)
        if not await amake_room(self.store, header.size):
            raise StoreFull(f"the artifact store has no room for {header.size} bytes, even "
                            "after evicting what it could (its volume is full)")
        writer = self.store.writer()
        loop = asyncio.get_running_loop()
        received = self.metrics.bytes.labels("in")
        inflate: Inflate | None = None
        with writer, self.uploads.track(sk, _in_flight(key, header), writer) as upload:
            async for chunk in chunks:
                received.inc(chunk.size)
                if chunk.zstd_data:
                    if inflate is None:
                        if writer.size:
                            raise InvalidRequest("a Publish sends data or zstd_data, not both")
                        inflate = Inflate(writer.write, header.size)
                    await loop.run_in_executor(self._publish_threads, _store_zstd, writer,
                                               inflate, chunk.zstd_data)
                    continue
                data = chunk.data
                if inflate is not None and data:
                    raise InvalidRequest("a Publish sends data or zstd_data, not both")
                if writer.size + len(data) > header.size:
                    raise InvalidRequest(f"received more than the declared {header.size} bytes")
                await loop.run_in_executor(self._publish_threads, writer.write, data)
                upload.advance()  # fetchers of the upload may read this far
            if later:  # the digest the last message carried: never a purged one's bytes
                revoked, = await self.etcd.get_many([self.view.revocation(tenant_of(sk),
                                                                      header.digest)])
                if revoked is not None:
                    raise await self._refuse_revoked(sk, kind, header, revoked, "was purged")
            await loop.run_in_executor(self._publish_threads, writer.commit, header.digest,
                                       header.size)
            upload.finish(ok=True)
            return await self._announce(sk, kind, header)

    async def _announce(self, sk: str, kind: str, header: pb.PublishHeader) -> pb.ArtifactInfo:
        """Index a committed blob in etcd under the key, if the lease still holds."""
        key = plain(sk)
        revocation = self.view.revocation(tenant_of(sk), header.digest)
        recipe = None
        if header.HasField("recipe"):  # stored before the index entry that names it
            recipe = pb.Recipe()
            recipe.CopyFrom(header.recipe)
            recipe.key = key
            if not recipe.job:
                recipe.job = header.requester.job
        info = pb.ArtifactInfo(key=key, digest=header.digest, size=header.size,
                               compile_time_seconds=header.compile_time_seconds,
                               created_unix=time.time(),
                               recipe_digest=await self.farm.store_recipe(recipe) if recipe else "")
        ok, revision, _ = await self.etcd.txn(
            [cmp_mod_revision(self.view.k(kind, sk), header.lease.revision),
             cmp_absent(self.view.k("a", sk)), cmp_absent(revocation)],
            # The first valid publish wins; it ends the lease and any hedge.
            [op_put(self.view.k("a", sk), info_json(info)), op_delete(self.view.k("l", sk)),
             op_delete(self.view.k("h", sk))],
        )
        if not ok:
            # A retried txn (the first attempt's reply lost with an etcd member)
            # fails its compares after succeeding: the entry is then ours.
            entry, revoked = await self.etcd.get_many([self.view.k("a", sk), revocation])
            if revoked is not None and entry is None:
                raise await self._refuse_revoked(sk, kind, header, revoked,
                                                 "was purged while it was being published")
            if entry is None or json.loads(entry.value).get("digest") != header.digest:
                raise LeaseError(f"the compile lease for key {key} was lost before the "
                                 "publish completed (expired or taken over)")
            info = info_from(key, entry.value)
            revision = entry.mod_revision
        self.view.remember_artifact(sk, info, revision)
        if recipe is not None and info.recipe_digest:
            await self.farm.record(tenant_of(sk), recipe, info.recipe_digest)
        self.metrics.publishes.labels("ok").inc()
        log.info("published %s digest=%s size=%d compile_time=%.2fs", key, header.digest,
                 header.size, header.compile_time_seconds,
                 extra={"key": sk, "job": header.requester.job,
                        "process_id": header.requester.process_id})
        return info

    # -- Release ---------------------------------------------------------
    async def release(self, key: str, lease: pb.Lease, reason: pb.ReleaseReason.ValueType,
                      detail: str, *,
                      tenant: str = DEFAULT_TENANT) -> None:
        validate.key(key)
        validate.lease(lease)
        if reason not in pb.ReleaseReason.values() or reason == pb.RELEASE_REASON_UNSPECIFIED:
            raise InvalidRequest("reason must be COMPILE_FAILED, BELOW_THRESHOLD, ABANDONED or "
                                 "PUBLISH_REFUSED")
        sk = scope(tenant, key)
        kind = await self.claims.check_holder(sk, lease)
        name = pb.ReleaseReason.Name(reason)
        why = {pb.COMPILE_FAILED: "the compile failed on the holder",
               pb.BELOW_THRESHOLD: "the entry is below the caching thresholds",
               pb.PUBLISH_REFUSED: "the coordinator refused the holder's executable"}.get(reason)
        if why is not None and reason == pb.PUBLISH_REFUSED and detail:
            why += f" ({detail[:200]})"
        cause = pb.LOCAL_CAUSE_BELOW_THRESHOLD if reason == pb.BELOW_THRESHOLD else 0
        if not await self._give_up(sk, kind, lease, why, detail, cause):
            raise LeaseError(f"the compile lease for key {key} is no longer held")
        self.metrics.releases.labels(name.lower()).inc()
        log.info("released %s (%s) %s", key, name, detail[:200], extra={"key": sk})

    async def _give_up(self, sk: str, kind: str, lease: pb.Lease, why: str | None,
                       detail: str, cause: int = pb.LOCAL_CAUSE_UNSPECIFIED) -> bool:
        """End the claim P/kind that `lease` holds; with `why`, every waiter
        compiles locally at once (a "compile locally" verdict for
        local_marker_ttl_s) instead of one being promoted. False when the
        claim was no longer held."""
        ops = [op_delete(self.view.k(kind, sk))]
        if why is not None:
            marker_lease = await self.etcd.grant(self.settings.local_marker_ttl_s)
            body = json.dumps({"reason": f"{why}; compile locally", "cause": cause,
                               "detail": detail[:validate.MAX_DETAIL_LEN]})
            ops.append(op_put(self.view.k("x", sk), body.encode(), lease=marker_lease))
        ok, _, _ = await self.etcd.txn([cmp_mod_revision(self.view.k(kind, sk), lease.revision)], ops)
        return ok

    async def _refuse_revoked(self, sk: str, kind: str, header: pb.PublishHeader,
                              revoked: KV, what: str) -> Revoked:
        """A publish of revoked bytes: its claim ends with a "compile locally"
        verdict (a deterministic compile would give every promoted waiter the
        same bytes again, one after another), and the error to raise."""
        with contextlib.suppress(Unavailable):
            await self._give_up(sk, kind, header.lease,
                                "the compiled bytes were purged by an operator", revocation_reason(revoked))
        return Revoked(f"artifact {header.digest} {what} ({revocation_reason(revoked)}); "
                       "it may not be published again")

    # -- KeepAlive -------------------------------------------------------
    async def keepalive(self, key: str, lease: pb.Lease, *,
                        tenant: str = DEFAULT_TENANT) -> int:
        validate.key(key)
        validate.lease(lease)
        try:
            await self.claims.check_holder(scope(tenant, key), lease)
        except LeaseError:
            return 0
        left = await self.etcd.keepalive_once(lease.id)
        self.leases.renewed(lease.id, left)
        return left

    # -- Fetch -----------------------------------------------------------
    async def fetch(self, key: str, digest: str, *, tenant: str = DEFAULT_TENANT,
                    offset: int = 0, as_stored: bool = False
                    ) -> tuple[pb.ArtifactInfo, AsyncIterator[DataChunk]]:
        """The artifact of `key` and its bytes from `offset` on; `as_stored`:
        a blob stored as zstd goes as it is stored (FetchChunk.zstd_data), for
        a client that decodes it (an upload still in flight goes as data)."""
        validate.key(key)
        if digest:
            validate.digest(digest)
        if offset < 0:
            raise InvalidRequest("offset must be >= 0")
        sk = scope(tenant, key)
        info = self.view.cached_artifact(sk)
        if info is None:
            rec = await self.etcd.get(self.view.k("a", sk))
            if rec is None:
                upload = self.uploads.get(sk)
                if upload is None or (digest and upload.info.digest != digest):
                    raise NotFound(f"no artifact is published under key {key}")
                if offset > upload.info.size:
                    raise InvalidRequest(f"offset {offset} is past the artifact's "
                                         f"{upload.info.size} bytes")
                self.metrics.streamed_while_publishing.inc()
                return upload.info, self._counted(stream_upload(
                    upload, offset, lambda at: self._stream(sk, upload.info, at),
                    self.settings.publish_stream_readers))
            info = read_info(key, rec.value)
            if info is None:
                await self.view.drop_unreadable(sk, "a", rec)
                raise NotFound(f"the index entry of key {key} could not be read; recompile")
            self.view.remember_artifact(sk, info, rec.mod_revision)
        if digest and info.digest != digest:
            raise NotFound(f"key {key} holds digest {info.digest}, not {digest}")
        if await self.presence.check(info.digest) is False:  # (None: the read will tell)
            entry = await self.etcd.get(self.view.k("a", sk))
            if entry is not None:
                await self.view.usable_artifact(sk, KeyState(info, entry.mod_revision, None, 0, None))
            raise NotFound(f"the blob of key {key} is missing; recompile")
        if offset > info.size:
            raise InvalidRequest(f"offset {offset} is past the artifact's {info.size} bytes")
        return info, self._counted(self._stream(sk, info, offset, as_stored))

    async def _counted(self, chunks: AsyncIterator[DataChunk]) -> AsyncIterator[DataChunk]:
        out = self.metrics.bytes.labels("out")
        async for chunk in chunks:
            out.inc(chunk.size)
            yield chunk

    async def _stream(self, sk: str, info: pb.ArtifactInfo, offset: int = 0,
                      as_stored: bool = False) -> AsyncIterator[DataChunk]:
        try:
            # Resuming at `offset`: what the caller already has is not sent again.
            with tracing.detached_span("store.read", key=info.key, bytes=info.size):
                async for chunk in aread(self.store, info.digest, offset=offset,
                                         transform=DataChunk.framed, as_stored=as_stored):
                    yield chunk
        except (CorruptBlob, NotFound) as exc:
            # Bytes that proved bad, or an object gone from a bucket behind
            # our back: the entry goes, and the key compiles again.
            if isinstance(exc, CorruptBlob):
                self.metrics.corrupt_blobs.inc()
            self.view.index.pop(sk, None)
            with contextlib.suppress(Exception):
                await self.etcd.delete(self.view.k("a", sk))
            raise
