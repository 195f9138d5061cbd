"""Writing a blob: the BlobWriter that puts a verified blob into a DiskBlobStore atomically (temp file, fsync, rename), hashing as the bytes come (compilecast/streams.py). The store's layout and reads are compilecast/blobstore.py."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Protocol, TypeVar

import zstandard

from compilecast import validate
from compilecast.errors import (
    DigestMismatch,
    StoreFull,
    TooLarge,
)
from compilecast.streams import RAW_MAGIC, Sha256

PROBE = 1 << 20  # bytes whose compressibility decides how a blob is stored
MIN_SAVING = 0.05  # store raw unless zstd saves at least this fraction of the probe
OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT}
ROOM_SLACK = 64 << 10  # what a blob may take beyond its bytes: marker, zstd frames, blocks



class Home(Protocol):
    """What a BlobWriter needs of the store it writes into (blobstore.DiskBlobStore)."""

    root: Path
    tmp_dir: Path
    file_mode: int | None
    level: int
    durable: bool

    def path_of(self, digest: str) -> Path: ...

    def restore(self) -> None: ...

    def trust(self, digest: str, st: os.stat_result, since: float | None = None) -> None: ...

    def account(self, delta: int) -> None: ...


T = TypeVar("T")


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or written to."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def as_is(chunk: bytes) -> Any:
    return chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A durable write asks the kernel to start writing its bytes out every
# WRITEBACK_EVERY bytes, without waiting (Linux's sync_file_range): the fsync
# at commit then waits for the last few MiB instead of the whole blob, and the
# waiters of a publish are told sooner (187 MB on this machine's disk: the
# commit from 0.11-0.13 s to 0.003 s, BENCHMARKS.md). Elsewhere, nothing.
WRITEBACK_EVERY = 8 << 20


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range, bound on first use (never in a process that
    writes no durable blob, such as a user's JAX process); None where there
    is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Have the kernel start writing out a range of the file, without
    waiting (SYNC_FILE_RANGE_WRITE); whether it took the request."""
    call = _sync_file_range()
    return call is not None and call(fd, offset, nbytes, 2) == 0


def worth_compressing(sample: bytes, level: int) -> bool:
    """Whether zstd at `level` saves at least MIN_SAVING of `sample` (a blob's
    first PROBE bytes): else it is stored, and sent, raw."""
    if not sample:
        return True
    return len(zstandard.ZstdCompressor(level=level).compress(sample)) <= (
        len(sample) * (1 - MIN_SAVING))


class BlobWriter:
    """One blob being written. Use as a context manager: leaving the block
    without `commit()` removes the temp file."""

    def __init__(self, store: Home, max_size: int, *,
                 discard_when_unwritable: bool = False) -> None:
        self._store = store
        self._max_size = max_size
        self._discard = discard_when_unwritable
        self.discarded = ""  # why the bytes are hashed but not kept
        self._path: Path | None = None
        self._file: Any = None
        try:
            try:
                fd, name = tempfile.mkstemp(dir=store.tmp_dir, suffix=".part")
            except FileNotFoundError:  # removed under the running store
                store.restore()
                fd, name = tempfile.mkstemp(dir=store.tmp_dir, suffix=".part")
        except OSError as exc:
            self._write_failed(exc)
        else:
            self._path = Path(name)
            if store.file_mode is not None:
                os.fchmod(fd, store.file_mode)
            self._file = os.fdopen(fd, "wb")
        self._level = store.level
        # A zstd stream writer, once the probe says compress.
        self._zw: zstandard.ZstdCompressionWriter | None = None
        self._raw = False
        self._as_sent = False  # storing a zstd stream as it came (write_zstd)
        self._probe: list[bytes] = []
        self._probed = 0
        self._hash = Sha256()
        self.size = 0
        self._done = False
        # Up to where the kernel was asked to write the file out (durable only).
        self._written_back: int | None = 0 if store.durable else None

    def write(self, data: bytes | memoryview) -> None:
        self.size += len(data)
        if self.size > self._max_size:
            raise TooLarge(f"artifact exceeds the limit of {self._max_size} bytes")
        self._hash.update(data)
        if self.discarded or self._as_sent:
            return
        try:
            if self._zw is not None:
                self._zw.write(data)
            elif self._raw:
                self._file.write(data)
                self._file.flush()  # visible to readers of the file as it grows
            else:
                self._probe.append(bytes(data))
                self._probed += len(data)
                if self._probed >= PROBE:
                    self._decide()
            if self._written_back is not None:
                self._write_back()
        except OSError as exc:
            self._write_failed(exc)

    def _write_back(self) -> None:
        """Have the kernel start writing out what this file holds beyond the
        last request, once that is WRITEBACK_EVERY bytes. Best effort: the
        fsync at commit is what makes the blob durable, and reports errors."""
        end, done = self._file.tell(), self._written_back or 0
        if end - done < WRITEBACK_EVERY:
            return
        self._file.flush()
        if _start_writeback(self._file.fileno(), done, end - done):
            self._written_back = end
        else:
            self._written_back = None  # refused once: leave it all to the fsync

    def write_zstd(self, stream: Any) -> None:
        """Store the blob as the zstd stream it came in (a blob another store
        sent as stored), written as it is: nothing compressed again. The
        decoded bytes still go to `write`, which then hashes and counts them."""
        if not self._as_sent:
            if self.size or self._probed or self._zw is not None or self._raw:
                raise ValueError("a blob is stored as its zstd stream from its first byte")
            self._as_sent = True
        if self.discarded:
            return
        try:
            self._file.write(stream)
            if self._written_back is not None:
                self._write_back()
        except OSError as exc:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        """A write failed. Opened with discard_when_unwritable, go on hashing
        without keeping the bytes, whatever the failure; else raise StoreFull
        for want of space, and anything else as it is."""
        full = exc.errno in OUT_OF_SPACE
        if full:
            why = f"no space left on the volume under {self._store.root}"
        else:
            why = f"cannot write under {self._store.root}: {exc.strerror or exc}"
        if not self._discard:
            if not full:
                raise exc
            raise StoreFull(f"the blob store is full: {why}") from None
        self.stop_keeping(why)

    def stop_keeping(self, why: str) -> None:
        """Hash the rest of the blob without keeping it: commit then verifies
        the bytes and returns None."""
        if not self.discarded:
            self.discarded = why
            self._zw, self._probe, self._raw = None, [], False
            self._remove()

    def restart(self) -> bool:
        """Start the blob again from its first byte, where none has been
        taken yet (a zstd stream whose first frame did not decode): its file
        emptied, nothing decided. False where it cannot (bytes taken, or the
        blob no longer kept)."""
        if self.size or self.discarded or self._file is None:
            return False
        try:
            self._file.seek(0)
            self._file.truncate()
        except OSError as exc:
            self._write_failed(exc)
            return False
        self._zw, self._raw, self._as_sent, self._probe, self._probed = None, False, False, [], 0
        return True

    def store_raw(self) -> None:
        """Store the blob raw from its first byte, without the probe: for
        bytes their sender stored raw (its own probe of the same first MiB
        said no). Readers may follow the file from the first write on."""
        if self.discarded:  # (the rest is hashed, not kept)
            return
        if self.size or self._probed or self._zw is not None or self._as_sent:
            raise ValueError("a blob is stored raw without the probe from its first byte")
        if self._raw:
            return
        self._raw = True
        try:
            self._file.write(RAW_MAGIC)
        except OSError as exc:
            self._write_failed(exc)

    def _decide(self) -> None:
        """Compress or not, from the first PROBE bytes; then write them."""
        head = b"".join(self._probe)
        self._probe = []
        zc = zstandard.ZstdCompressor(level=self._level)
        if not worth_compressing(head[:PROBE], self._level):
            self._raw = True
            self._file.write(RAW_MAGIC)
            self._file.write(head)
            self._file.flush()
        else:
            zw = self._zw = zc.stream_writer(self._file, closefd=False)
            zw.write(head)

    @property
    def level(self) -> int:
        """The zstd level its store compresses at."""
        return self._level

    @property
    def stored_raw(self) -> bool:
        return self._raw

    @property
    def path(self) -> Path:
        """The temp file being written (renamed into place by commit);
        FileNotFoundError for a blob not kept (`discarded`)."""
        if self._path is None:
            raise FileNotFoundError(f"no file: {self.discarded}")
        return self._path

    def readable(self) -> int | None:
        """How many bytes of the blob another reader may take from `path`,
        after RAW_MAGIC, between writes; None unless stored raw (undecided
        or compressed: wait for the committed blob). Raw writes are flushed
        as they are made, so that is every byte written."""
        return self.size if self._raw and not self.discarded else None

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def _finish_file(self, parent: Path) -> None:
        if self._zw is None and not self._raw and not self._as_sent:
            self._decide()
        if self._zw is not None:
            self._zw.flush(zstandard.FLUSH_FRAME)
        self._file.flush()
        if self._store.durable:
            os.fsync(self._file.fileno())
        self._file.close()
        parent.mkdir(parents=True, exist_ok=True)

    def commit(self, digest: str, size: int) -> Path | None:
        """Verify and move the blob into place; returns its path, or None when
        the bytes were verified but not kept (`discarded`)."""
        validate.digest(digest)
        try:
            final = self._store.path_of(digest)
            if not self.discarded:
                try:
                    self._finish_file(final.parent)
                except OSError as exc:
                    self._write_failed(exc)
            actual = self._hash.hexdigest()
            if actual != digest:
                raise DigestMismatch(
                    f"digest mismatch: the publish says {digest}, its bytes hash to {actual}"
                )
            if self.size != size:
                raise DigestMismatch(f"size mismatch: header says {size}, received {self.size}")
            if self.discarded:
                self._done = True
                return None
            path = self._path
            if path is None:  # (kept bytes always have their file)
                raise FileNotFoundError(f"no file for {digest}")
            stored = path.stat().st_size
            existed = final.exists()
            os.replace(path, final)
            if self._store.durable:
                _fsync_dir(final.parent)
            self._done = True
            self._store.trust(digest, final.stat())  # hashed on the way in
            if not existed:
                self._store.account(stored)
            return final
        finally:
            if not self._done:
                self.abort()

    def _remove(self) -> None:
        with contextlib.suppress(Exception):  # a full volume fails the close's flush too
            if self._file is not None:
                self._file.close()
        with contextlib.suppress(FileNotFoundError):
            if self._path is not None:
                self._path.unlink()

    def abort(self) -> None:
        self._done = True
        self._hash.close()
        self._remove()

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()
