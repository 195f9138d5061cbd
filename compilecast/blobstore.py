"""Content-addressed artifact store on local disk.

Blobs are named by the sha256 of their uncompressed bytes and stored
zstd-compressed, or raw (after an 8-byte marker) when their first MiB does not
compress: compressing incompressible bytes costs CPU on every write and read
and saves nothing. A zstd frame starts with its own magic number, so the two
forms never mistake each other:

    ROOT/blobs/ab/abcdef....zst   committed blobs (ab = first two hex digits)
    ROOT/tmp/                     writes in progress; emptied on open
    ROOT/quarantine/              blobs that failed verification, kept for study

Write protocol: stream into a temp file while hashing, fsync, verify the
digest and size, then rename atomically into place and fsync the directory. A
crash at any point leaves either nothing or a complete blob; temp files are
swept on the next open. A store opened with durable=False (a cache that can
fetch again: the worker's host cache) skips both fsyncs, which cost as much as
writing the bytes: a blob that a crash left short or empty fails its digest
on the first read after the restart and is quarantined, never served.

Reads hash what they return; a mismatch quarantines the blob and raises
CorruptBlob after the last chunk, so a reader must not use the bytes before
the stream ends cleanly. A blob this process wrote or verified less than
`reverify_s` ago, in a file that has not changed since, is served without
hashing it again (its readers verify every byte they receive).

Concurrency: any number of readers and writers, threads or processes. Two
writers of the same digest race harmlessly (the rename is idempotent). The
optional size bound evicts least-recently-read blobs; the running total is kept
in memory and the directory is scanned only when the bound is exceeded.

Out of space: the volume may fill before the bound is reached (an unbounded
store, or a host disk shared with a training job's checkpoints). `make_room`
evicts least-recently-read blobs until a blob of a given size fits above
`min_free` bytes kept free; other files on the volume are never touched. A
write that still finds no space raises StoreFull, or, for a writer opened with
`discard_when_unwritable` (a cache that can serve its readers without a copy of its
own), stops keeping the bytes but goes on hashing them: its commit verifies
and returns None. Such a writer does the same on any other failure to write
(a directory that became unwritable): a cache's disk never denies a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from compilecast import validate
from compilecast.errors import (
    CorruptBlob,
    DigestMismatch,
    InvalidRequest,
    NotFound,
)
from compilecast.store import ArtifactStore
from compilecast.wire import Zstd

from .blobwriter import (
    ROOM_SLACK,
    BlobWriter,
    T,
    as_is,
    file_identity,
)
from .streams import CHUNK, RAW_MAGIC, Inflate, Sha256

log = logging.getLogger(__name__)

def blob_path(root: str | os.PathLike[str], digest: str) -> Path:
    """Where the store at `root` keeps the blob of `digest`."""
    return Path(root) / "blobs" / digest[:2] / f"{digest}.zst"


class DiskBlobStore:
    """A directory of content-addressed, zstd-compressed blobs."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        max_blob_size: int = 8 << 30,
        level: int = 3,
        reverify_s: float = 600.0,
        durable: bool = True,
        on_evict: Callable[[int], None] | None = None,
        min_free: int = 0,
        file_mode: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.file_mode = file_mode  # of the blobs it writes (None: 0600, mkstemp's)
        self.blob_dir = self.root / "blobs"
        self._blob_prefix = f"{self.blob_dir}/"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        self._make_dirs()
        for stale in self.tmp_dir.iterdir():
            with contextlib.suppress(OSError):
                stale.unlink()
        self.max_bytes = max_bytes
        self.max_blob_size = max_blob_size
        self.level = level
        self.quarantined = 0
        self.reverify_s = reverify_s  # 0: hash every byte of every read
        self.durable = durable
        self.min_free = min_free  # bytes of the volume make_room keeps free
        self._verified: dict[str, tuple[tuple[int, ...], float]] = {}
        self._lock = threading.Lock()
        self.on_evict = on_evict  # called with each evicted blob's stored size
        self._total = sum(size for _, size, _ in self._scan())

    # -- queries ---------------------------------------------------------
    def path_of(self, digest: str) -> Path:
        return blob_path(self.root, digest)

    def has(self, digest: str) -> bool:
        # One stat on a string path: every HIT asks (pathlib's Path objects cost
        # more than the stat; 12 % of the coordinator's CPU under a hit load).
        return os.path.exists(f"{self._blob_prefix}{digest[:2]}/{digest}.zst")

    def known(self, digest: str) -> bool | None:
        """A disk store always knows: has() is one stat."""
        return self.has(digest)

    @property
    def stored_bytes(self) -> int:
        return self._total

    def count(self) -> int:
        return sum(1 for _ in self.blob_dir.glob("*/*.zst"))

    # -- writes ----------------------------------------------------------
    def writer(self, *, discard_when_unwritable: bool = False) -> BlobWriter:
        return BlobWriter(self, self.max_blob_size, discard_when_unwritable=discard_when_unwritable)

    def _make_dirs(self) -> None:
        for d in (self.blob_dir, self.tmp_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)

    def restore(self) -> None:
        """Make the store's directories again after something removed them
        while it ran (an operator freeing a disk, a cleaner): it goes on
        serving, as empty as what is left, and counts what is left."""
        log.warning("the store's directory %s was removed while in use: made again; its "
                    "blobs that went with it are fetched or compiled again", self.root)
        self._make_dirs()
        self.rescan()

    def free_bytes(self) -> int:
        """Free bytes on the store's volume (one statvfs)."""
        try:
            return shutil.disk_usage(self.root).free
        except FileNotFoundError:
            self.restore()
            return shutil.disk_usage(self.root).free

    def _room(self, nbytes: int) -> int:
        """Bytes the volume lacks for a blob of `nbytes` above min_free (<= 0: it fits)."""
        free = self.free_bytes()
        return nbytes + nbytes // 128 + ROOM_SLACK + self.min_free - free

    def fits(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits above min_free as the volume is (one statvfs)."""
        return self._room(nbytes) <= 0

    def make_room(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits on the volume above min_free, after
        evicting least recently read blobs until it does. Nothing but this
        store's blobs is ever removed: when the volume fills, the store gives
        way. A blob that could not fit even in an empty store evicts nothing."""
        short = self._room(nbytes)
        if short <= 0:
            return True
        if short > self._total:
            return False
        evicted = freed = 0
        for _, size, p in self._scan():
            if self._evict_one(p, size):
                evicted, freed = evicted + 1, freed + size
            short = self._room(nbytes)
            if short <= 0:
                break
        log.warning("the volume under %s is short of space: evicted %d blobs (%d bytes) to "
                    "make room for %d bytes, keeping %d free%s", self.root, evicted, freed,
                    nbytes, self.min_free, "" if short <= 0 else f"; still {short} bytes short")
        return short <= 0

    def put_bytes(self, data: bytes) -> str:
        """Store a small in-memory blob; returns its digest."""
        digest = hashlib.sha256(data).hexdigest()
        with self.writer() as w:
            w.write(data)
            w.commit(digest, len(data))
        return digest

    def account(self, delta: int) -> None:
        with self._lock:
            self._total += delta
            over = self.max_bytes is not None and self._total > self.max_bytes
        if over:
            self._evict()

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(last read or written, stored size, path) of every blob, oldest first."""
        entries = []
        for p in self.blob_dir.glob("*/*.zst"):
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        entries.sort()
        return entries

    def rescan(self) -> int:
        """Count the directory again and evict when it is over the bound;
        returns the stored bytes. For a store that other processes write too
        (coordinator replicas on one shared volume): each counts only its own
        writes between scans."""
        entries = self._scan()
        with self._lock:
            self._total = sum(size for _, size, _ in entries)
            over = self.max_bytes is not None and self._total > self.max_bytes
        if over:
            self._evict(entries)
        return self._total

    def _evict(self, entries: list[tuple[float, int, Path]] | None = None) -> None:
        """Least recently read first, down to 90 % of the bound."""
        assert self.max_bytes is not None
        target = int(self.max_bytes * 0.9)
        for _, size, p in self._scan() if entries is None else entries:
            with self._lock:
                if self._total <= target:
                    return
            if self._evict_one(p, size):
                log.info("evicted blob %s (%d bytes) from the bounded store", p.stem, size)

    def _evict_one(self, p: Path, size: int) -> bool:
        """Remove one blob; whether this call removed it."""
        try:
            p.unlink()
        except FileNotFoundError:
            gone = False  # another process sharing the store evicted it: gone all the same
        else:
            gone = True
            if self.on_evict is not None:
                self.on_evict(size)
        with self._lock:
            self._total -= size
            self._verified.pop(p.stem, None)
        return gone

    def delete(self, digest: str) -> bool:
        """Remove a blob; whether it was there."""
        self._distrust(digest)
        p = self.path_of(digest)
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            self._total -= size
        return True

    def quarantine(self, digest: str, why: str) -> None:
        self._distrust(digest)
        p = self.path_of(digest)
        dest = self.quarantine_dir / f"{digest}.{int(time.time() * 1000)}.zst"
        with contextlib.suppress(FileNotFoundError):
            size = p.stat().st_size
            os.replace(p, dest)
            with self._lock:
                self._total -= size
        self.quarantined += 1
        log.error("quarantined blob %s: %s (kept at %s)", digest, why, dest)

    # -- reads -----------------------------------------------------------
    def _trusted(self, digest: str, st: os.stat_result) -> float | None:
        """When this process last verified the file behind `st`, if recently."""
        with self._lock:
            seen = self._verified.get(digest)
        if seen is not None and seen[0] == file_identity(st) \
                and time.monotonic() - seen[1] < self.reverify_s:
            return seen[1]
        return None

    def trust(self, digest: str, st: os.stat_result, since: float | None = None) -> None:
        if self.reverify_s > 0:
            with self._lock:
                self._verified[digest] = (file_identity(st), time.monotonic() if since is None
                                          else since)

    def _distrust(self, digest: str) -> None:
        with self._lock:
            self._verified.pop(digest, None)

    def _touch(self, digest: str, path: Path, stat: Callable[[], os.stat_result]) -> bool:
        """Whether the blob is trusted (below); in a bounded store, its mtime
        is set to now as well, for eviction by last read. Our own touch does
        not make it another file: it stays trusted."""
        since = self._trusted(digest, stat())
        if self.max_bytes is not None:
            with contextlib.suppress(OSError):
                os.utime(path)
            if since is not None:
                self.trust(digest, stat(), since)
        return since is not None

    def verify(self, digest: str) -> bool:
        """Hash a blob as a read does, without counting as a read (its place
        in the eviction order stays): False when it proved corrupt (and is
        quarantined now). NotFound when it is gone."""
        try:
            for _ in self.read(digest, scrub=True):
                pass
        except CorruptBlob:
            return False
        return True

    def scrub(self, bytes_per_s: float, stop: threading.Event,
              on_corrupt: Callable[[str], None] | None = None) -> tuple[int, int]:
        """One pass over every blob, oldest read first, verifying each
        (`verify`) at most `bytes_per_s` stored bytes a second: blobs nobody
        reads are found corrupt too, not only when a reader finally asks.
        Ends early when `stop` is set. (blobs verified, blobs quarantined)."""
        checked = corrupt = 0
        started, done = time.monotonic(), 0
        for _, size, path in self._scan():
            if stop.is_set():
                break
            digest = path.name.split(".")[0]
            try:
                ok = self.verify(digest)
            except (NotFound, InvalidRequest, OSError):  # evicted meanwhile, or not one of ours
                continue
            checked += 1
            if not ok:
                corrupt += 1
                if on_corrupt is not None:
                    on_corrupt(digest)
            done += size
            ahead = done / bytes_per_s - (time.monotonic() - started)
            if ahead > 0 and stop.wait(ahead):
                break
        return checked, corrupt

    def read(self, digest: str, chunk_size: int = CHUNK, *, offset: int = 0,
             as_stored: bool = False, scrub: bool = False) -> Iterator[bytes]:
        """Yield the uncompressed bytes of a blob from `offset` on, verifying its digest.
        With `as_stored` (and offset 0), a blob stored as zstd is yielded as
        it is stored, in Zstd chunks (which decode to the blob), and verified
        by decoding it here unless it is trusted (below): the reader then
        sends a tenth of the bytes and this store decodes none of them.

        Raises NotFound if absent, CorruptBlob (after quarantining it) if the
        stored bytes do not hash to `digest`; the error comes after the last
        chunk, so consumers must treat the data as unverified until then.
        Bytes before `offset` are read and hashed, not returned. A blob this
        store wrote or verified within `reverify_s`, whose file has not
        changed since (inode, size, mtime, ctime), is not hashed again: its
        readers verify what they receive anyway, and on a busy coordinator
        the second hash of every byte costs a core's worth of throughput.
        `scrub`: hash every byte, and leave the file's read time as it is.
        """
        validate.digest(digest)
        path = self.path_of(digest)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in the store") from None
        h = Sha256()  # a big blob's hashing overlaps its reading and decoding
        try:
            started = time.monotonic()
            # A scrub hashes every byte and leaves the file as it was.
            trusted = not scrub and self._touch(digest, path, lambda: os.fstat(f.fileno()))
            raw = f.read(len(RAW_MAGIC)) == RAW_MAGIC
            if raw and trusted and offset:
                f.seek(len(RAW_MAGIC) + offset)
                offset = 0
            elif not raw:
                f.seek(0)
            stored = as_stored and not raw and not offset
            check = None
            if stored and not trusted:
                check = Inflate(h.update, limit=1 << 62)
            reader = f if raw or stored else zstandard.ZstdDecompressor().stream_reader(
                f, closefd=False)
            try:
                while True:
                    chunk = reader.read(chunk_size)
                    if not chunk:
                        break
                    if stored:
                        if check is not None:
                            check.feed(chunk)
                        yield Zstd(chunk)
                        continue
                    if not trusted:
                        h.update(chunk)
                    if offset:
                        n = min(offset, len(chunk))
                        chunk, offset = chunk[n:], offset - n
                        if not chunk:
                            continue
                    yield chunk
            except (zstandard.ZstdError, CorruptBlob) as exc:
                self.quarantine(digest, f"undecodable: {exc}")
                raise CorruptBlob(f"blob {digest} is corrupt (undecodable)") from None
            if not trusted and h.hexdigest() == digest:
                self.trust(digest, os.fstat(f.fileno()), started)
        finally:
            h.close()
            f.close()
        if not trusted and h.hexdigest() != digest:
            self.quarantine(digest, f"hashes to {h.hexdigest()}")
            raise CorruptBlob(f"blob {digest} is corrupt: its bytes hash to {h.hexdigest()}")

    def hand_out(self, digest: str) -> str | None:
        """The path of a blob that a reader on this host reads for itself
        (and verifies, as every reader does), touched as a read here would be
        so that eviction sees it used; None when it is not in the store."""
        validate.digest(digest)
        path = self.path_of(digest)
        try:
            if self.file_mode is not None and stat.S_IMODE(os.stat(path).st_mode) != self.file_mode:
                os.chmod(path, self.file_mode)  # written before, under another mode
            self._touch(digest, path, lambda: os.stat(path))
        except FileNotFoundError:
            return None
        return str(path)

    def open_trusted(self, digest: str) -> BinaryIO | None:
        """The blob's file, open for reading as stored, when this process
        wrote or verified that very file within `reverify_s` (touched as a
        read is); None otherwise (absent, or to be verified by a `read`).
        For a sender that passes the file on unread (sendfile): its reader
        verifies the digest, as every reader does."""
        validate.digest(digest)
        path = self.path_of(digest)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        try:
            if self._touch(digest, path, lambda: os.fstat(f.fileno())):
                return f
        except OSError:
            pass
        f.close()
        return None

    def open_sendable(self, digest: str, zstd_ok: bool) -> BinaryIO | None:
        """open_trusted, for a sender whose reader takes the file as it is
        stored: None for a zstd blob unless `zstd_ok` (that reader must get
        decoded bytes, over gRPC)."""
        f = self.open_trusted(digest)
        if f is None:
            return None
        try:
            if zstd_ok or f.read(len(RAW_MAGIC)) == RAW_MAGIC:
                f.seek(0)
                return f
        except OSError:
            pass
        f.close()
        return None

    def read_bytes(self, digest: str) -> bytes:
        return b"".join(self.read(digest))


async def amake_room(store: ArtifactStore, nbytes: int) -> bool:
    """`store.make_room` for an event loop: one statvfs on the loop when the
    volume has the room, a thread only when blobs must go."""
    return store.fits(nbytes) or await asyncio.to_thread(store.make_room, nbytes)


async def aread(store: ArtifactStore, digest: str, *, depth: int = 4, chunk_size: int = CHUNK,
                offset: int = 0, transform: Callable[[bytes], T] = as_is,
                as_stored: bool = False) -> AsyncIterator[T]:
    """`store.read` for an event loop: a thread reads, decompresses and
    verifies up to `depth` chunks ahead while the caller sends, and applies
    `transform` to each chunk (the wire framing: off the event loop); errors
    (CorruptBlob after the last chunk) are raised in the caller."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    room = threading.Semaphore(depth)  # backpressure without a loop round trip per chunk
    stop = threading.Event()
    done = object()

    def produce() -> None:
        item: Any = done
        try:
            for chunk in store.read(digest, chunk_size, offset=offset, as_stored=as_stored):
                out = transform(chunk)
                room.acquire()
                if stop.is_set():
                    return
                loop.call_soon_threadsafe(queue.put_nowait, out)
        except BaseException as exc:
            item = exc
        loop.call_soon_threadsafe(queue.put_nowait, item)

    producer = loop.run_in_executor(None, produce)
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            room.release()
            yield item
    finally:
        stop.set()
        room.release()  # wake a producer blocked on a full window
        await asyncio.shield(producer)


__all__ = ["CHUNK", "BlobWriter", "DigestMismatch", "DiskBlobStore", "amake_room", "aread"]
