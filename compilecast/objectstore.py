"""Artifact bytes in an S3-compatible bucket, behind the store interface.

The bucket is the truth; each coordinator replica keeps a bounded local disk
cache in front of it (a DiskBlobStore: what it served or published lately),
so replicas share no volume:

    BUCKET/PREFIX/blobs/DI/DIGEST    the artifact's bytes, as published
                                     (uncompressed: a presigned GET is the
                                     artifact), written once, never changed

- A publish is committed to the local cache (digest verified), then uploaded
  to the bucket (multipart past MULTIPART_FROM, streamed from the local file,
  never the whole artifact in memory), and only then indexed in etcd by the
  caller: an index entry never names an object that is not complete.
- A read the local cache cannot serve downloads the object into it first
  (streamed, hashed as it comes; a digest mismatch is CorruptBlob, and the
  object is deleted), then serves it from there as the disk store does.
- Objects are content-addressed: two replicas racing to upload one digest
  write the same bytes; an upload skips an object that is already there.
- A missing object is NotFound: the caller drops the index entry and the key
  compiles again (a miss, not an error loop).

Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, AWS_PROFILE and its credentials file, workload
identity); they are never logged. Eviction from the bucket is its lifecycle
rules' (docs/operations.md).

Concurrency: every method may block on the network; callers on an event loop
run them in a thread (as they do the disk store's).
"""

from __future__ import annotations

import collections
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from compilecast import tracing
from compilecast.blobstore import DiskBlobStore
from compilecast.blobwriter import BlobWriter
from compilecast.errors import CorruptBlob, DigestMismatch, NotFound, Unavailable
from compilecast.store import ArtifactStore
from compilecast.streams import CHUNK

log = logging.getLogger("compilecast.objectstore")

MULTIPART_FROM = 64 << 20  # parts of this size, two in flight: 128 MiB in memory at most
KNOWN_MAX = 100_000  # digests remembered as present in the bucket


class BucketError(Unavailable):
    """The bucket cannot be used (missing, refused, unreachable)."""


Observe = Callable[[str, float, bool, int], None]  # (operation, seconds, ok, bytes)


class Bucket:
    """The S3 calls compilecast makes, each observed (`observe`)."""

    def __init__(self, bucket: str, *, prefix: str = "", endpoint: str = "", region: str = "",
                 observe: Observe | None = None) -> None:
        import boto3.session
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.name = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint = endpoint
        self._observe = observe
        config = Config(retries={"max_attempts": 3, "mode": "standard"},
                        max_pool_connections=32, connect_timeout=5, read_timeout=60,
                        s3={"addressing_style": "path"} if endpoint else None)
        self._s3 = boto3.session.Session().client("s3", endpoint_url=endpoint or None,
                                                  region_name=region or None, config=config)
        self._transfer = TransferConfig(multipart_threshold=MULTIPART_FROM,
                                        multipart_chunksize=MULTIPART_FROM, max_concurrency=2,
                                        use_threads=True)

    def key(self, digest: str) -> str:
        return f"{self.prefix}blobs/{digest[:2]}/{digest}"

    def _call(self, op: str, fn: Callable[[], Any], nbytes: int = 0) -> Any:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        start = time.monotonic()
        ok = False
        try:
            with tracing.span(f"bucket.{op}", bytes=nbytes or None):
                out = fn()
            ok = True
            return out
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                ok = True  # an answer, not a failure of the bucket
                raise NotFound(f"object {op} in bucket {self.name}: not found") from None
            raise BucketError(f"bucket {self.name}: {op} refused: {code or exc}") from None
        except (BotoCoreError, Boto3Error) as exc:  # (Boto3Error: a transfer that failed)
            raise BucketError(f"bucket {self.name} ({self.endpoint or 'AWS'}): {op} failed: "
                              f"{exc}") from None
        finally:
            if self._observe is not None:
                self._observe(op, time.monotonic() - start, ok, nbytes if ok else 0)

    def check(self) -> None:
        """BucketError naming the problem when the bucket cannot be used."""
        try:
            self._call("head_bucket", lambda: self._s3.head_bucket(Bucket=self.name))
        except NotFound:
            raise BucketError(f"bucket {self.name} does not exist at "
                              f"{self.endpoint or 'AWS S3'}") from None

    def size(self, digest: str) -> int | None:
        try:
            head = self._call("head", lambda: self._s3.head_object(
                Bucket=self.name, Key=self.key(digest)))
        except NotFound:
            return None
        return int(head["ContentLength"])

    def upload(self, digest: str, body: io.RawIOBase, size: int) -> None:
        """Write the object from `body` (read in parts, never whole)."""
        self._call("upload", lambda: self._s3.upload_fileobj(
            body, self.name, self.key(digest), Config=self._transfer), size)

    def download(self, digest: str) -> Iterator[bytes]:
        """The object's bytes, in chunks as they arrive."""
        got = self._call("get", lambda: self._s3.get_object(Bucket=self.name,
                                                            Key=self.key(digest)))
        body = got["Body"]
        n = 0
        try:
            for chunk in body.iter_chunks(CHUNK):
                n += len(chunk)
                yield chunk
        except Exception as exc:  # the connection broke mid-object
            raise BucketError(f"bucket {self.name}: the download of {digest} broke off after "
                              f"{n} bytes: {exc}") from None
        finally:
            body.close()
            if self._observe is not None:
                self._observe("get_bytes", 0.0, True, n)

    def delete(self, digest: str) -> None:
        self._call("delete", lambda: self._s3.delete_object(Bucket=self.name,
                                                            Key=self.key(digest)))

    def presign(self, digest: str, ttl_s: int) -> str:
        return str(self._s3.generate_presigned_url(
            "get_object", Params={"Bucket": self.name, "Key": self.key(digest)},
            ExpiresIn=ttl_s))


class _Stream(io.RawIOBase):
    """A file object over an iterator of chunks (a blob read from the local
    cache, decompressed and verified as it goes) for a multipart upload."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


class _UploadingWriter:
    """The local cache's blob writer, whose commit also uploads the blob: a
    publish is in the bucket before the caller indexes it."""

    def __init__(self, inner: BlobWriter, store: BucketStore) -> None:
        self._inner = inner
        self._store = store

    @property
    def size(self) -> int:
        return self._inner.size

    @property
    def path(self) -> Path:
        return self._inner.path

    def write(self, data: bytes | memoryview) -> None:
        self._inner.write(data)

    def write_zstd(self, stream: Any) -> None:
        self._inner.write_zstd(stream)

    def readable(self) -> int | None:
        return self._inner.readable()

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> _UploadingWriter:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)

    def commit(self, digest: str, size: int) -> Path | None:
        path = self._inner.commit(digest, size)
        self._store.upload(digest, size)
        return path


class BucketStore:
    """The store interface (compilecast/store.py) over a bucket, with `local`
    (a bounded DiskBlobStore) as this replica's cache in front of it: its
    size, room, scans and scrubs are the local cache's."""

    def __init__(self, local: DiskBlobStore, bucket: Bucket,
                 on_local: Callable[[bool], None] | None = None) -> None:
        self.local = local
        self.bucket = bucket
        self._on_local = on_local  # called with whether a read found its blob here
        self._known: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def _remember(self, digest: str) -> None:
        with self._lock:
            self._known[digest] = None
            self._known.move_to_end(digest)
            if len(self._known) > KNOWN_MAX:
                self._known.popitem(last=False)

    def _forget(self, digest: str) -> None:
        with self._lock:
            self._known.pop(digest, None)

    # -- the store interface ---------------------------------------------
    @property
    def stored_bytes(self) -> int:
        return self.local.stored_bytes

    def fits(self, nbytes: int) -> bool:
        return self.local.fits(nbytes)

    def make_room(self, nbytes: int) -> bool:
        return self.local.make_room(nbytes)

    def rescan(self) -> int:
        return self.local.rescan()

    def scrub(self, bytes_per_s: float, stop: threading.Event,
              on_corrupt: Callable[[str], None] | None = None) -> tuple[int, int]:
        return self.local.scrub(bytes_per_s, stop, on_corrupt)

    def known(self, digest: str) -> bool | None:
        """True when the local cache holds the blob or the bucket was seen to;
        None when only a request to the bucket can tell."""
        if self.local.has(digest):
            return True
        with self._lock:
            return True if digest in self._known else None

    def has(self, digest: str) -> bool:
        if self.local.has(digest):
            return True
        with self._lock:
            if digest in self._known:
                return True
        if self.bucket.size(digest) is None:
            return False
        self._remember(digest)
        return True

    def writer(self, *, discard_when_unwritable: bool = False) -> _UploadingWriter:
        return _UploadingWriter(
            self.local.writer(discard_when_unwritable=discard_when_unwritable), self)

    def put_bytes(self, data: bytes) -> str:
        digest = self.local.put_bytes(data)
        self.upload(digest, len(data))
        return digest

    def read(self, digest: str, chunk_size: int = CHUNK, *, offset: int = 0,
             as_stored: bool = False, scrub: bool = False) -> Iterator[bytes]:
        self.ensure_local(digest)
        return self.local.read(digest, chunk_size, offset=offset, as_stored=as_stored,
                               scrub=scrub)

    def read_bytes(self, digest: str) -> bytes:
        self.ensure_local(digest)
        return self.local.read_bytes(digest)

    # A file to send unread (sendfile) only when the local cache has it: a
    # blob still in the bucket goes over gRPC (`read`), which brings it here,
    # verified, and sends it on as it comes.
    def open_sendable(self, digest: str, zstd_ok: bool) -> BinaryIO | None:
        return self.local.open_sendable(digest, zstd_ok) if self.local.has(digest) else None

    def open_trusted(self, digest: str) -> BinaryIO | None:
        return self.local.open_trusted(digest) if self.local.has(digest) else None

    def delete(self, digest: str) -> bool:
        """Out of the local cache only: the bucket keeps it (another replica,
        another tenant may serve it); the bucket's lifecycle evicts."""
        return self.local.delete(digest)

    # -- between the cache and the bucket ----------------------------------
    def upload(self, digest: str, size: int) -> None:
        """Put a blob of the local cache into the bucket, unless it is there."""
        if self.bucket.size(digest) == size:
            self._remember(digest)
            return
        self.bucket.upload(digest, _Stream(self.local.read(digest)), size)
        self._remember(digest)

    def ensure_local(self, digest: str) -> None:
        """Bring the blob into the local cache from the bucket when it is not
        here: NotFound when the bucket has no such object, CorruptBlob (and
        the object deleted) when its bytes are not the digest's."""
        if self.local.has(digest):
            if self._on_local is not None:
                self._on_local(True)
            return
        with self._lock:
            one = self._fetching.setdefault(digest, threading.Lock())
        with one:  # one download of a digest at a time; the others find it here
            if self.local.has(digest):
                return
            if self._on_local is not None:
                self._on_local(False)
            try:
                self._download(digest)
            finally:
                with self._lock:
                    self._fetching.pop(digest, None)

    def _download(self, digest: str) -> None:
        size = self.bucket.size(digest)
        if size is None:
            self._forget(digest)
            raise NotFound(f"blob {digest} is not in bucket {self.bucket.name}")
        if not self.local.make_room(size):
            raise Unavailable(f"no room in the local cache for blob {digest} ({size} bytes)")
        with self.local.writer() as w:
            for chunk in self.bucket.download(digest):
                w.write(chunk)
            try:
                w.commit(digest, size)
            except DigestMismatch:
                log.error("object %s in bucket %s does not hash to its name: deleted",
                          self.bucket.key(digest), self.bucket.name)
                self._forget(digest)
                self.bucket.delete(digest)
                raise CorruptBlob(f"blob {digest} in the bucket is corrupt") from None
        self._remember(digest)


def _implementations(disk: DiskBlobStore, bucket: BucketStore) -> tuple[ArtifactStore, ...]:
    """Both stores are ArtifactStores: mypy checks this in `make test`."""
    return disk, bucket
