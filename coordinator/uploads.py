"""Artifacts being published, streamed to fetchers while they upload.

Without this a waiter's download follows the holder's upload: compile, then
upload every byte, then every waiter downloads every byte. Here a waiter
learns from its Wait stream that the holder has started to publish (a WAIT
event that carries the artifact's digest and size) and fetches at once: the
replica that receives the upload streams its bytes to fetchers as they are
written, so the downloads overlap the upload. Other replicas answer with the
published blob, as before.

Trust: the digest is the publish header's, from a lease holder this replica
has checked; a fetcher verifies every byte against it, as it does any fetch.
When the upload fails, the stream ends with UNAVAILABLE and the fetcher waits
again.

Only a blob stored raw (one that does not compress: JAX's cache entries are
zstd already) can be read while it is written; a compressed upload's
fetchers get the blob once it is committed. The temp file stays readable
through its open descriptor after the commit renames it.

The upload is what every fetcher waits on, so it must not be starved: at
most `max_readers` fetchers read an upload in flight (the rest get the
committed blob), and the publish writes on threads of its own.

Concurrency: one event loop. The publish task calls `advance` after each
write and `finish` once; any number of fetch tasks read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator

from compilecast.errors import Unavailable
from compilecast.store import BlobSink
from compilecast.streams import CHUNK, RAW_MAGIC
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import HEARTBEAT_S, DataChunk

PARTIAL_WAIT_S = 0.05  # how long a fetcher waits for a whole chunk before taking less


class Upload:
    def __init__(self, info: pb.ArtifactInfo, writer: BlobSink) -> None:
        self.info = info
        self.writer = writer
        self.available = 0  # bytes readable from writer.path after RAW_MAGIC
        self.state = "open"  # then "committed" (the blob is in the store) or "failed"
        self.readers = 0  # fetchers reading it in flight
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def advance(self) -> None:
        readable = self.writer.readable()
        if readable is not None and readable > self.available:
            self.available = readable
            self._notify()

    def finish(self, ok: bool) -> None:
        self.advance()
        self.state = "committed" if ok else "failed"
        self._notify()

    async def changed(self) -> None:
        await self._changed.wait()


class Uploads:
    """The uploads in progress on this replica, by scoped key."""

    def __init__(self, on_start: Callable[[str], None]) -> None:
        self._by_key: dict[str, Upload] = {}
        self._on_start = on_start  # wakes the key's waiters

    def get(self, sk: str) -> Upload | None:
        return self._by_key.get(sk)

    @contextlib.contextmanager
    def track(self, sk: str, info: pb.ArtifactInfo, writer: BlobSink) -> Iterator[Upload]:
        """Registered for the block; failed unless marked committed in it.
        An upload whose digest comes last is not registered: its fetchers
        could not be told what to verify it against (they get the blob once
        it is committed)."""
        upload = Upload(info, writer)
        if not info.digest:
            yield upload
            return
        self._by_key[sk] = upload
        self._on_start(sk)
        try:
            yield upload
        finally:
            if self._by_key.get(sk) is upload:
                del self._by_key[sk]
            if upload.state == "open":
                upload.finish(ok=False)


async def stream(upload: Upload, offset: int,
                 committed: Callable[[int], AsyncIterator[DataChunk]],
                 max_readers: int) -> AsyncIterator[DataChunk]:
    """The upload's bytes from `offset` as they arrive; the rest from the
    committed blob (`committed(offset)`) when they cannot be read in flight."""
    size, pos = upload.info.size, offset
    fd: int | None = None
    if upload.readers < max_readers:
        with contextlib.suppress(FileNotFoundError):  # committed (renamed) or failed already
            fd = os.open(upload.writer.path, os.O_RDONLY)
    if fd is not None:
        upload.readers += 1
    try:
        while pos < size:
            ready = upload.available - pos
            # Whole chunks while the upload runs (fewer, larger reads and sends),
            # unless the upload pauses: then what is there.
            if fd is not None and 0 < ready < CHUNK and upload.state == "open" \
                    and upload.available < size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(upload.changed(), PARTIAL_WAIT_S)
                    continue
            if fd is not None and ready > 0:
                n = min(CHUNK, upload.available - pos)
                chunk = await asyncio.to_thread(_read_framed, fd, n, len(RAW_MAGIC) + pos)
                if not chunk.data:
                    raise Unavailable(f"the upload of key {upload.info.key} was cut short")
                pos += len(chunk.data)
                yield chunk
                continue
            if upload.state == "failed":
                raise Unavailable(f"the publish of key {upload.info.key} failed before its "
                                  "end; wait for the key again")
            if upload.state == "committed" and (fd is None or upload.writer.readable() is None):
                async for chunk in committed(pos):
                    yield chunk
                return
            try:
                await asyncio.wait_for(upload.changed(), HEARTBEAT_S)
            except TimeoutError:  # nothing to send yet: show the fetcher we are alive
                yield DataChunk(b"")
    finally:
        if fd is not None:
            os.close(fd)
            upload.readers -= 1


def _read_framed(fd: int, n: int, at: int) -> DataChunk:
    return DataChunk.framed(os.pread(fd, n, at))
