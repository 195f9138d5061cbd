"""A download in progress on the worker (a fill): its copy in the host cache as it is written, the readers that follow it, and the zstd packing and unpacking on the way."""

from __future__ import annotations

import asyncio
import os
import threading

import zstandard

from compilecast.blobwriter import PROBE, BlobWriter, worth_compressing
from compilecast.errors import (
    CorruptBlob,
    Status,
    UpstreamError,
)
from compilecast.streams import Inflate
from compilecast.v1 import cache_pb2 as pb
from compilecast.wire import HEARTBEAT_S, DataChunk

from .upstream import (
    heartbeats_until,
)


class _Backlog:
    """The chunks a fill keeps for readers that join late, while they total
    at most `limit` bytes; past that, `chunks` is None (later readers wait
    for the committed blob)."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.chunks: list | None = []
        self.limit = limit
        self.size = 0

    def add(self, chunk, nbytes: int) -> None:
        if self.chunks is None:
            return
        self.size += nbytes
        if self.size > self.limit:
            self.chunks = None
        else:
            self.chunks.append(chunk)


class Fill:
    """One download into the host cache, streamed to its readers as it arrives.

    A reader that joins while the download runs first gets the chunks sent
    so far (kept while they total at most MAX_BACKLOG bytes), then follows
    live: that is how a relaying worker passes an artifact on to the peers
    the coordinator points at it. Later readers read the committed blob.
    Readers get unverified bytes and, at the end, None once the digest
    verified or the error; every client verifies the digest too.

    A download that arrives as the coordinator's stored zstd stream goes on
    to readers that take zstd (peers ask for it) as that stream, with its own
    backlog: a tenth of the bytes between peers for an artifact that
    compresses 10x, and nothing for the peer to compress again. The others
    get the decoded bytes. A reader that takes zstd and joins before the
    first byte follows whichever way the bytes come."""

    MAX_BACKLOG = 64 << 20

    def __init__(self, max_backlog: int = MAX_BACKLOG) -> None:
        self.readers: list[asyncio.Queue] = []  # decoded bytes
        self.zstd_readers: list[asyncio.Queue] = []  # the zstd stream as it came
        self._undecided: set[asyncio.Queue] = set()  # take zstd; joined before any data
        self.zstd: bool | None = None  # whether the data comes as zstd (None: no data yet)
        self.started = False
        self.finished = False
        self.backlog = _Backlog(max_backlog)  # decoded bytes
        self.zstd_backlog = _Backlog(max_backlog)  # the stream (chunks None once cut off)
        self.kept = True  # False: served without a copy in the host cache (its disk is full)
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.info: pb.ArtifactInfo | None = None  # once the header came
        self.writer: BlobWriter | None = None  # the host cache's, once it is made
        self._written: int | None = None  # what the writer had written, at its last write's end
        self._changed = asyncio.Event()  # set (and replaced) at each write and at the end

    def advance(self) -> None:
        """A write ended (or the fill did): wake who follows its file. (The
        writer's own count runs ahead of its file while a write is under way
        on its thread: only what a finished write left counts.)"""
        self._written = self.writer.readable() if self.writer is not None else None
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> bool:
        """Whether it advanced within `timeout_s`."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def readable(self) -> int | None:
        """Bytes of the artifact its file holds now, for a reader on this
        host; None unless the file is one a reader may follow as it grows
        (stored raw, with the header known)."""
        if self.info is None or self.finished:
            return None
        return self._written

    def join(self, zstd: bool = False) -> asyncio.Queue | None:
        """A reader's queue, or None: wait for the committed blob. With zstd,
        the reader takes the zstd stream if that is how the bytes come."""
        if self.finished:
            return None
        if zstd and self.zstd and self.zstd_backlog.chunks is not None:
            return self._add(self.zstd_readers, self.zstd_backlog.chunks)
        if self.started and self.backlog.chunks is None:
            return None
        q = self._add(self.readers, self.backlog.chunks or [])
        if zstd and self.zstd is None:
            self._undecided.add(q)
        return q

    @staticmethod
    def _add(readers: list[asyncio.Queue], backlog: list) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=len(backlog) + 8)
        for chunk in backlog:
            q.put_nowait(chunk)
        readers.append(q)
        return q

    def leave(self, q: asyncio.Queue) -> None:
        for readers in (self.readers, self.zstd_readers):
            if q in readers:
                readers.remove(q)
        self._undecided.discard(q)
        while not q.empty():  # unblock a send waiting on this reader
            q.get_nowait()

    async def send(self, chunk: pb.FetchChunk | DataChunk) -> None:
        """Decoded bytes, the header or a heartbeat (those go to every reader)."""
        self.started = True
        data = len(chunk.data)
        if data and self.zstd is None:
            self.zstd = False
            self._undecided.clear()
        self.backlog.add(chunk, data)
        readers = self.readers
        if not data:
            readers = readers + self.zstd_readers
            self.zstd_backlog.add(chunk, 0)
        await self._put(readers, chunk)

    async def send_zstd(self, chunk) -> None:
        """A piece of the zstd stream as it came (before its decoded bytes)."""
        self.started = True
        if self.zstd is None:
            self.zstd = True
            for q in self._undecided:  # they have had the header only: the stream from here
                if q in self.readers:
                    self.readers.remove(q)
                    self.zstd_readers.append(q)
            self._undecided.clear()
        self.zstd_backlog.add(chunk, len(chunk.zstd_data))
        await self._put(self.zstd_readers, chunk)

    async def cut_zstd(self, why: str) -> None:
        """The zstd stream stops midway (the rest comes decoded): its readers
        fail, and fetch the rest elsewhere from the offset they reached."""
        self.zstd_backlog.chunks = None
        readers, self.zstd_readers = self.zstd_readers, []
        await self._put(readers, UpstreamError(Status.UNAVAILABLE, why))

    async def _put(self, readers: list[asyncio.Queue], item) -> None:
        for q in list(readers):
            if q in readers:
                await q.put(item)

    async def finish(self, info: pb.ArtifactInfo | None, error: BaseException | None) -> None:
        self.started = self.finished = True
        self.backlog.chunks = self.zstd_backlog.chunks = None
        self.advance()
        await self._put(self.readers + self.zstd_readers, error)  # None: verified, committed
        if not self.done.done():
            if error is None:
                self.done.set_result(info)
            else:
                self.done.set_exception(error)
                self.done.exception()  # retrieved: late joiners get it via await


# zstd's own threads compress a publish while this worker reads and sends the
# chunks around it (1 GB on 2 busy cores: ~430 -> ~620 MB/s); 0: zstd's
# single-threaded mode, for a one-core host.
PACK_THREADS = min(4, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0


class Packer:
    """A publish on its way to a coordinator that takes zstd: the first
    PROBE bytes decide, as for the store, whether it goes as a zstd stream
    (compressed here, the stream also kept in the host cache as it goes) or
    as the data it came as. Runs on a thread, a chunk at a time; returns the
    chunks to send."""

    def __init__(self, writer) -> None:
        self._writer = writer
        self._held: list = []  # chunks until PROBE bytes decide
        self._held_bytes = 0
        self._zstd: zstandard.ZstdCompressionObj | None = None  # once decided for it
        self._plain = False

    def add(self, chunk) -> list:
        if self._plain:
            self._writer.write(chunk.data)
            return [chunk]
        if self._zstd is not None:
            return self._pack(chunk.data)
        self._held.append(chunk)
        self._held_bytes += len(chunk.data)
        return self._decide() if self._held_bytes >= PROBE else []

    def end(self) -> list:
        out = self._decide() if self._zstd is None and not self._plain else []
        if self._zstd is not None:
            tail = self._zstd.flush()
            self._writer.write_zstd(tail)
            out.append(DataChunk(b"", tail))
        return out

    def _decide(self) -> list:
        held, self._held = self._held, []
        level = self._writer.level
        if not worth_compressing(b"".join(c.data for c in held)[:PROBE], level):
            self._plain = True
            for c in held:
                self._writer.write(c.data)
            return held
        self._zstd = zstandard.ZstdCompressor(level=level, threads=PACK_THREADS).compressobj()
        return [out for c in held for out in self._pack(c.data)]

    def _pack(self, data) -> list:
        assert self._zstd is not None  # (decided: worth compressing)
        stream = self._zstd.compress(data)
        self._writer.write_zstd(stream)  # first: the host cache keeps the stream as sent
        self._writer.write(data)  # hashed and counted
        return [DataChunk(b"", stream)] if stream else []


class Inflating:
    """A download sent as zstd (FetchChunk.zstd_data), decoded on a thread
    for the fill's readers, a bounded piece at a time (however well it
    compresses), and stored in the host cache as the stream it came in."""

    def __init__(self, key: str, info: pb.ArtifactInfo | None, fill: Fill, writer) -> None:
        if info is None or writer.size:
            raise CorruptBlob(f"{key}: zstd_data before the artifact's header or after data")
        self._loop = asyncio.get_running_loop()
        self._fill = fill
        self._writer = writer
        self._stop = threading.Event()
        self._inflate = Inflate(self._piece, info.size)

    def _piece(self, data: bytes) -> None:  # on the decoding thread
        sent = asyncio.run_coroutine_threadsafe(self._fill.send(DataChunk(data)), self._loop)
        while True:
            try:
                sent.result(timeout=1.0)
                break
            except TimeoutError:  # a slow reader; or the download was given up
                if self._stop.is_set():
                    sent.cancel()
                    raise CorruptBlob("download given up while decoding") from None
        self._writer.write(data)

    def _feed(self, data) -> None:  # on the decoding thread
        self._writer.write_zstd(data)  # kept as it came: nothing compressed again
        self._inflate.feed(data)

    async def feed(self, data) -> None:
        try:
            await asyncio.to_thread(self._feed, data)
        except BaseException:
            self._stop.set()  # cancelled or failed: the thread stops at its next piece
            raise

    async def cut(self, key: str, why: str, *, keep: bool = False) -> None:
        """The stream stopped midway and the rest comes decoded: the host
        cache keeps no copy (its stream is not whole; `keep`: the copy was
        started again from its first byte), and the fill's zstd readers
        fetch the rest elsewhere."""
        if not keep:
            self._writer.stop_keeping(why)
        await self._fill.cut_zstd(f"the relay's download of {key} was cut off")


FOLLOW_STEP = 4 << 20  # a reader following a fill's file is told of every this many bytes


async def following_fill(fill: Fill, available: int):
    """The messages of a fetch that a process on this host goes on with by
    reading the fill's file as it is written: where it is, then how far it
    is written (every FOLLOW_STEP, at HEARTBEAT_S when nothing comes), and
    the artifact's size once the fill committed it; the fill's error if it
    failed. (A file the fill stopped writing, its disk full, ends short: the
    reader finds the bytes missing and asks again without the file.)"""
    assert fill.writer is not None  # (a fill that is readable writes a file)
    yield pb.FetchChunk(local_path=str(fill.writer.path), local_growing=True,
                        local_available=available)
    told = available
    while not fill.finished:
        moved = await fill.changed(HEARTBEAT_S)
        now = fill.readable()
        if now is None:
            break
        if now >= told + FOLLOW_STEP or not moved:
            told = now
            yield pb.FetchChunk(local_available=now)
    # (Its file no longer followed, a disk that filled up: its end.)
    async for beat in heartbeats_until(fill.done, lambda: pb.FetchChunk(local_available=told)):
        yield beat
    info = fill.done.result()  # (or the fill's error)
    yield pb.FetchChunk(artifact=info, local_available=info.size)
