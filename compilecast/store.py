"""The artifact store's interface: what the coordinator (its publishes, fetches,
data plane, farm, sweeps and scrubs) asks of wherever the bytes live.

Two implementations: `blobstore.DiskBlobStore` (a directory on a volume) and
`objectstore.BucketStore` (an S3-compatible bucket, with a bounded disk store
of the replica's own in front of it). The worker's host cache is always a
DiskBlobStore and uses its local-only extra (paths handed to
the host's processes) directly.

Rules every implementation keeps:
- Blobs are named by the sha256 of their uncompressed bytes and are
  write-once: a digest's bytes never change.
- A blob is readable under its digest only after `commit` of its writer
  returned; a failed or aborted write leaves nothing readable.
- Every read verifies what it returns against the digest and raises
  CorruptBlob after the last chunk when it does not match; the blob is then
  gone from the store (quarantined, or deleted from the bucket).
- `has` may be answered from memory (a bucket's recently seen objects):
  `read` is the authority, and raises NotFound for a blob that is gone.
- `open_sendable` is the one optional capability: a file to send unread
  (sendfile), or None, and the caller reads through `read` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable


@runtime_checkable
class BlobSink(Protocol):
    """One blob being written (`ArtifactStore.writer`), used as a context
    manager: leaving it without `commit` removes what was written."""

    @property
    def size(self) -> int:
        """Bytes written so far (uncompressed)."""
        ...

    def write(self, data: bytes | memoryview) -> None: ...

    def write_zstd(self, stream: Any) -> None:
        """Take a zstd stream's frames as they are (the store decodes them
        only to verify)."""

    def commit(self, digest: str, size: int) -> Path | None:
        """Make the blob readable under `digest`: DigestMismatch when the
        bytes are not `size` bytes hashing to it."""

    def readable(self) -> int | None:
        """Bytes a reader may take from `path` so far (after RAW_MAGIC), or
        None when the blob is not being written raw."""

    @property
    def path(self) -> Path: ...

    def abort(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class ArtifactStore(Protocol):
    """Content-addressed, write-once, verified on every read (the rules above)."""

    @property
    def stored_bytes(self) -> int: ...

    def has(self, digest: str) -> bool: ...

    def known(self, digest: str) -> bool | None:
        """has() where it needs no network request, else None."""

    def writer(self, *, discard_when_unwritable: bool = False) -> BlobSink: ...

    def put_bytes(self, data: bytes) -> str:
        """Store a small in-memory blob; its digest."""
        ...

    def read(self, digest: str, chunk_size: int = ..., *, offset: int = 0,
             as_stored: bool = False, scrub: bool = False) -> Iterator[bytes]: ...

    def read_bytes(self, digest: str) -> bytes: ...

    def delete(self, digest: str) -> bool: ...

    def fits(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits as the store is (cheap)."""
        ...

    def make_room(self, nbytes: int) -> bool:
        """Whether a blob of `nbytes` fits after evicting what the store may."""
        ...

    def open_sendable(self, digest: str, zstd_ok: bool) -> Any:
        """A file of the blob to send as it is stored, or None (then `read`)."""

    def rescan(self) -> int: ...

    def scrub(self, bytes_per_s: float, stop: threading.Event,
              on_corrupt: Callable[[str], None] | None = None) -> tuple[int, int]: ...
