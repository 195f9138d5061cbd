"""What a client receives, and how it can fail: the error statuses it raises, the watchdog that gives up a stalled transfer, the buffer a download is put together in, and the readers of a host cache file (whole, or followed as it grows)."""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, cast

import zstandard

from compilecast.errors import (
    CompilecastError,
    CorruptBlob,
    DeadlineExceeded,
    Status,
    received,
)
from compilecast.streams import RAW_MAGIC, Inflate, Sha256
from compilecast.v1 import cache_pb2 as pb

LOCAL_PIECE = 4 << 20  # a host cache file is read (and hashed) in pieces of this size


class Stalled(DeadlineExceeded):
    """A transfer that moved no bytes (nor a heartbeat) for `stall_s`."""


class UploadRefused(Exception):
    """A data plane's status frame other than OK: the status and message a
    call would have ended with (`error` is that as compilecast's error)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.status = Status.of_number(code)
        self.details = details

    @property
    def error(self) -> CompilecastError:
        return received(self.status, self.details)


class Watchdog:
    """Cancels a transfer (`cancel`) once `tick` has not been called for
    `stall_s`: a big artifact on a slow link takes as long as it moves, a
    stuck peer is given up in `stall_s` (a deadline on the whole call would
    fail the former or wait on the latter)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last = time.monotonic()
        self.fired = False
        self._cancel: Callable[[], object] = lambda: None
        self._stop = threading.Event()

    def watching(self, cancel: Callable[[], object]) -> Watchdog:
        """Start watching; `cancel` ends the transfer when it stalls."""
        self._cancel = cancel
        self.tick()
        threading.Thread(target=self._watch, name="cc-watchdog", daemon=True).start()
        return self

    def tick(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.stall_s / 4)):
            if time.monotonic() - self.last > self.stall_s:
                self.fired = True
                self._cancel()
                return

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inflater(key: str, info: pb.ArtifactInfo | None, received: Received, take) -> Inflate:
    """The decoder of a Fetch stream sent as zstd (after its header, before any data)."""
    if info is None or received.size:
        raise CorruptBlob(f"fetch of {key} sent zstd_data before its header or after data")
    return Inflate(take, info.size)


_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise on Linux (where MADV_POPULATE_WRITE is 23; other
    systems number their advice otherwise), else None."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).madvise
    except (ImportError, OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return f


@functools.cache
def _bytes_address() -> Callable[[bytes], int] | None:
    """PyBytes_AsString (the address of a bytes object's own bytes), or None
    off CPython."""
    try:
        import ctypes

        f = ctypes.pythonapi.PyBytes_AsString
    except (ImportError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_void_p, [ctypes.py_object]
    return f


class Received:
    """A download's bytes, put together as they arrive. Once the artifact's
    size is known (its header comes first), into one bytes object of that
    size, written in place while nothing else can see it (as C code fills
    the bytes objects it creates): no list of chunks to join, so half the
    memory and page faults of a join (187 MB here: 0.53-0.55 s -> 0.38-0.43 s,
    BENCHMARKS.md). A list joined at the end where that cannot be done:
    bytes before the header, a small artifact, no ctypes."""

    IN_PLACE_FROM = 4 << 20
    # The result's pages are faulted in ahead of the bytes, this many at a
    # time, in one call (MADV_POPULATE_WRITE): one fault for every 4 KiB
    # written cost a quarter of filling it (BENCHMARKS.md, "Artifact fetch throughput and memory").
    POPULATE_STEP = 16 << 20

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0  # bytes received
        self._parts: list = []
        self._out: bytes | None = None
        self._view: memoryview | None = None
        # Addresses: the result's start, how far its whole pages are populated, their end.
        self._base = self._populated = self._pages_end = 0

    def expect(self, size: int) -> None:
        """The artifact's size, from its header (before its bytes)."""
        if self.size or self._out is not None or size < self.IN_PLACE_FROM \
                or (address_of := _bytes_address()) is None:
            return
        import ctypes

        try:
            out = bytes(size)  # calloc'd: its pages come as they are written
        except (MemoryError, OverflowError):
            return  # a size this process cannot hold: the join says so if it comes
        self._out = out
        self._base = address_of(out)
        self._view = memoryview((ctypes.c_char * size).from_address(self._base)).cast("B")
        if _madvise() is not None:
            self._populated = -(-self._base // _PAGE) * _PAGE
            self._pages_end = (self._base + size) // _PAGE * _PAGE

    def _populate(self, upto: int) -> None:
        """Fault in the result's whole pages up to `upto` bytes, and on to
        the next POPULATE_STEP; where the kernel refuses, they fault as written."""
        end = self._base + upto
        madvise = _madvise()
        if madvise is None:
            return
        while self._populated < min(end, self._pages_end):
            step = min(self.POPULATE_STEP, self._pages_end - self._populated)
            if madvise(self._populated, step, _MADV_POPULATE_WRITE) != 0:
                self._pages_end = 0  # not on this kernel (or not here): no more tries
                return
            self._populated += step

    def add(self, data) -> None:
        n = len(data)
        if self._view is None:
            self._parts.append(data)
        elif self.size + n > len(self._view):
            raise CorruptBlob(f"fetch of {self.key} sent more bytes than its size")
        else:
            self._populate(self.size + n)
            self._view[self.size:self.size + n] = data
        self.size += n

    def room(self, n: int) -> memoryview | None:
        """The next at most `n` bytes of the result, to be filled in place
        (then `filled`); None when it is not put together in place."""
        if self._view is None:
            return None
        self._populate(self.size + n)
        return self._view[self.size:self.size + n]

    def filled(self, n: int) -> None:
        self.size += n

    def result(self) -> bytes:
        if self._view is None:
            return b"".join(self._parts)
        self._view.release()
        self._view = None
        assert self._out is not None  # (set with the view)
        if self.size != len(self._out):
            raise CorruptBlob(f"fetch of {self.key} ended after {self.size} of "
                              f"{len(self._out)} bytes")
        return self._out



class Unfollowable(Exception):
    """The file a worker switched a fetch to (`path`) could not be read here
    (its cause says why)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class Unreachable(OSError):
    """The data plane's address cannot be connected to from here."""


class _Prefixed:
    """`source` with `prefix` put back in front of it: what was read to tell
    a raw blob from a zstd stream, for a source that cannot seek back."""

    def __init__(self, prefix: bytes, source) -> None:
        self._prefix, self._source = prefix, source

    def read(self, n: int = -1) -> bytes:
        if not self._prefix:
            return self._source.read(n)
        out, self._prefix = self._prefix, b""
        return out


def read_exactly(f, n: int) -> bytes:
    out = b""
    while len(out) < n and (piece := f.read(n - len(out))):
        out += piece
    return out


def _read_into(reader, room: memoryview) -> int:
    """Fill `room` from `reader` (a socket returns what has arrived: whole
    pieces keep the hashing thread's hand-offs few); fewer bytes only at the end."""
    n = 0
    while n < len(room) and (got := reader.readinto(room[n:])):
        n += got
    return n


def _read_hashed(reader, received: Received, h: Sha256, end: int) -> None:
    """Read from `reader` into `received` until it holds `end` bytes or the
    reader has no more, hashing on the way. The bytes go straight into the
    result where it is put together in place (no copy), and are hashed from
    read-only views of it."""
    while (left := end - received.size) > 0:
        room = received.room(min(left, LOCAL_PIECE))
        if room is None:  # a small artifact: pieces, joined at the end
            piece = reader.read(min(left, LOCAL_PIECE))
            if not piece:
                return
            h.update(piece)
            received.add(piece)
        elif n := _read_into(reader, room):
            h.update(room[:n].toreadonly())  # (never written again: not copied)
            received.filled(n)
        else:
            return


def read_stored(key: str, info: pb.ArtifactInfo, f, where: str) -> bytes:
    """The artifact from `f`, a blob as a store keeps it (RAW_MAGIC and the
    bytes, or one zstd stream that decodes to them; read to its end),
    verified. OSError when it cannot be read; CorruptBlob when its bytes are
    not the artifact's. The bytes go straight into the result (no copy), and
    are hashed on the hashing thread from read-only views of it."""
    received = Received(key)
    received.expect(info.size)
    h = Sha256()
    with contextlib.closing(h):
        head = read_exactly(f, len(RAW_MAGIC))
        raw = head == RAW_MAGIC
        reader = f if raw else zstandard.ZstdDecompressor().stream_reader(
            cast("IO[bytes]", _Prefixed(head, f)), closefd=False)
        try:
            _read_hashed(reader, received, h, info.size)
            if reader.read(1):
                raise CorruptBlob(f"{where} of {key} holds more than its {info.size} bytes")
        except zstandard.ZstdError as exc:
            raise CorruptBlob(f"{where} of {key} does not decode: {exc}") from None
    if h.hexdigest() != info.digest:
        raise CorruptBlob(f"{where} of {key} hashes to {h.hexdigest()}, "
                          f"expected {info.digest}")
    return received.result()


def _open_host_file(path: str, check=None):
    """A worker's host cache file at `path`, open unbuffered for reading;
    `check(fd)` runs before. Only a regular file: a FIFO or a device named
    here would block or never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if check is not None:
            check(fd)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_local(key: str, info: pb.ArtifactInfo, path: str) -> bytes:
    """The artifact from the worker's host cache file at `path`, verified."""
    with _open_host_file(path) as f:
        return read_stored(key, info, f, "the host cache file")


class _Following:
    """A download the worker goes on with in its host cache's file, which it
    is still writing (FetchChunk.local_growing): read from the artifact's
    byte the download reached, up to what the worker says the file holds,
    straight into the result and hashed as the rest of it is."""

    def __init__(self, key: str, path: str, received: Received, h: Sha256) -> None:
        self.key, self.received, self.h = key, received, h

        def at_the_byte_reached(fd: int) -> None:
            if os.pread(fd, len(RAW_MAGIC), 0) != RAW_MAGIC:
                raise CorruptBlob(f"the host cache file of {key} is not a raw blob")
            os.lseek(fd, len(RAW_MAGIC) + received.size, os.SEEK_SET)

        self.f = _open_host_file(path, at_the_byte_reached)

    def to(self, available: int) -> None:
        _read_hashed(self.f, self.received, self.h, available)
        if self.received.size < available:
            raise CorruptBlob(f"the host cache file of {self.key} ends at byte "
                              f"{self.received.size}, short of the {available} its worker said")

    def close(self) -> None:
        self.f.close()


class Follower:
    """A fetch's switch to the worker's growing file (FetchChunk.local_growing),
    and why that file could not be followed, kept until the download ends."""

    def __init__(self, key: str, received: Received, h: Sha256) -> None:
        self.key, self.received, self.h = key, received, h
        self.following: _Following | None = None
        self.unfollowable: BaseException | None = None
        self.path = ""

    def take(self, chunk: pb.FetchChunk, info: pb.ArtifactInfo | None,
             zstd: bool) -> pb.ArtifactInfo:
        """One chunk of the growing file; the artifact's info, the last
        chunk's (with its digest, if that came last) once it comes."""
        if info is None or zstd:
            raise CorruptBlob(f"fetch of {self.key} switched to a file before its header, "
                              "or in a zstd stream")
        if chunk.HasField("artifact"):
            if info.digest and chunk.artifact.digest != info.digest:
                raise CorruptBlob(f"{self.key} changed digest mid-fetch")
            info = chunk.artifact
        if self.unfollowable is None:  # else on to how the download ends
            try:
                if self.following is None:
                    self.path = chunk.local_path
                    self.following = _Following(self.key, self.path, self.received, self.h)
                self.following.to(chunk.local_available)
            except (OSError, CorruptBlob) as exc:  # not there, or short
                self.unfollowable = exc
        return info

    def close(self) -> None:
        if self.following is not None:
            self.following.close()

    def check(self) -> None:
        """Unfollowable when the file could not be followed (the download
        went well: its file is whole now)."""
        if self.unfollowable is not None:
            raise Unfollowable(self.path) from self.unfollowable

