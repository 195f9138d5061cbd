"""The host cache: a size-bounded blob store plus a key index on local disk.

    ROOT/blobs/...             DiskBlobStore (LRU-evicted above max_bytes)
    ROOT/keys/NS/KEY.json      ArtifactInfo of KEY (written atomically), signed
    ROOT/entry.key             the worker's secret that signs entries (0600)

NS is the namespace of the credential the entry was fetched or published
with (see WorkerService), so a host-cache hit is only served to a caller
presenting the same credential: tenants never read each other's entries here.
Blobs are content-addressed and shared. A key entry whose blob was evicted
reads as a miss. Both the worker and a
restarted worker see the same entries; processes on the host never read this
directory themselves, they ask the worker.

An executable is code, and the digest check only proves that a blob is the
one its entry names: an entry rewritten to name another blob present here
would hand a job the wrong program. So every entry carries an HMAC-SHA256,
under a secret only the worker reads, over its namespace, key and info; an
entry whose MAC does not match (tampered with, or not written by this
worker) is removed, reported (`on_refused`) and read as a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from compilecast.blobstore import DiskBlobStore, amake_room
from compilecast.blobwriter import OUT_OF_SPACE
from compilecast.v1 import cache_pb2 as pb

from .fill import Fill
from .hits import HostHits
from .metrics import WorkerMetrics

MAX_ENTRY = 1 << 16  # an index entry is ~250 bytes; a bigger file is not one of ours
SECRET_BYTES = 32

log = logging.getLogger("compilecast.worker")


def _secret(path: Path) -> bytes:
    """The worker's entry-signing secret at `path`, made on first use (0600)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"{path} is not a compilecast entry key ({len(secret)} bytes)") \
                from None
        return secret
    secret = os.urandom(SECRET_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    return secret


class HostCache:
    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int, min_free: int = 0,
                 reverify_s: float = 600.0, readable: bool = False,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._secret = _secret(self.root / "entry.key")
        self._on_refused = on_refused
        # Not fsynced: what a crash cuts short fails verification and is fetched again.
        # `readable`: the blobs are readable by the worker's group as well (0640),
        # whose processes read their hits from the files: the group that may
        # connect to its socket (0660); the directory's mount decides who sees them.
        self.store = DiskBlobStore(self.root, max_bytes=max_bytes, durable=False,
                                   reverify_s=reverify_s, min_free=min_free,
                                   file_mode=0o640 if readable else None)
        self.keys = self.root / "keys"
        self.keys.mkdir(parents=True, exist_ok=True)

    def _entry_path(self, ns: str, key: str) -> str:
        return f"{self.keys}/{ns}/{key}.json"

    def _entry(self, ns: str, key: str) -> Path:
        return Path(self._entry_path(ns, key))

    def lookup(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        # A string path and plain os calls: every host hit reads an entry, and
        # pathlib's objects and io's file cost more than the read (a third of
        # a lookup).
        try:
            fd = os.open(self._entry_path(ns, key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            raw = os.read(fd, MAX_ENTRY)
        finally:
            os.close(fd)
        try:
            fields = json.loads(raw)
            mac = fields.pop("mac", "")
            info = pb.ArtifactInfo(key=key, **fields)
        except (ValueError, TypeError, AttributeError):
            self.forget(ns, key)
            return None
        if not hmac.compare_digest(str(mac), self._mac(ns, info)):
            self.forget(ns, key)
            log.warning("refused the host-cache entry of %s: it is not signed by this worker "
                        "(tampered with, or written by another); removed", key,
                        extra={"key": key})
            if self._on_refused is not None:
                self._on_refused()
            return None
        return info if self.store.has(info.digest) else None

    def _mac(self, ns: str, info: pb.ArtifactInfo) -> str:
        signed = "\0".join([ns, info.key, info.digest, str(info.size),
                             repr(info.compile_time_seconds), str(info.created_unix)])
        return hmac.new(self._secret, signed.encode(), hashlib.sha256).hexdigest()

    def record(self, ns: str, info: pb.ArtifactInfo) -> None:
        body = json.dumps({"digest": info.digest, "size": info.size,
                           "compile_time_seconds": info.compile_time_seconds,
                           "created_unix": info.created_unix,
                           "mac": self._mac(ns, info)}).encode()
        entry = self._entry(ns, info.key)
        entry.parent.mkdir(parents=True, exist_ok=True)  # (keys/ too, if it was removed)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, entry)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def naming(self, digests: set[str]) -> dict[str, list[tuple[str, str]]]:
        """The entries that name one of `digests`: namespace -> [(key, digest)]."""
        found: dict[str, list[tuple[str, str]]] = {}
        for path in self.keys.glob("*/*.json"):
            try:
                digest = json.loads(path.read_bytes()[:MAX_ENTRY]).get("digest")
            except (OSError, ValueError, AttributeError):
                continue
            if digest in digests:
                found.setdefault(path.parent.name, []).append((path.stem, digest))
        return found

    def revoke(self, digests: set[str], named: dict[str, list[tuple[str, str]]],
               mine: set[str], others: set[str]) -> list[str]:
        """A tenant's revocation of `digests` (`named`: what `naming` found):
        the entries of its namespaces (`mine`) are forgotten, and a blob is
        deleted unless a namespace known to be another tenant's (`others`)
        names it: another tenant's copy of the same bytes is not theirs to
        purge. A namespace of no known tenant keeps nothing. The digests
        deleted."""
        kept: set[str] = set()
        for ns, entries in named.items():
            if ns in mine:
                for key, _ in entries:
                    self.forget(ns, key)
            elif ns in others:
                kept.update(digest for _, digest in entries)
        return [d for d in sorted(digests - kept) if self.store.delete(d)]

    def forget(self, ns: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._entry(ns, key).unlink()

    def count(self) -> int:
        return sum(1 for p in self.keys.glob("*/*.json")
                   if self.lookup(p.parent.name, p.stem) is not None)


class HostCopies:
    """What the worker writes into its host cache: the copies of downloads
    and of publishes through it, with room made for each first, and the
    publishes under way (a fetch of one of them reads the copy)."""

    def __init__(self, cache: HostCache, metrics: WorkerMetrics) -> None:
        self.cache = cache
        self.metrics = metrics
        self.publishing: dict[tuple[str, str], Fill] = {}  # (namespace, key) -> our copy
        self.uncached = 0  # artifacts passed on without a copy (no room on the disk)

    async def make_room(self, writer, size: int) -> None:
        """Evict from the host cache until an artifact of `size` fits on its
        disk above cache_min_free_bytes; else pass it on without a copy."""
        if not await amake_room(self.cache.store, size):
            writer.stop_keeping(f"no room for {size} bytes above the free space kept on the "
                                "host cache's disk")

    async def record(self, ns: str, info: pb.ArtifactInfo, writer) -> None:
        """Index a committed download or publish in the host cache; one the
        disk had no room for was passed on without a copy (a warning says so)."""
        if not writer.discarded:
            try:
                await asyncio.to_thread(self.cache.record, ns, info)
                return
            except OSError as exc:  # the blob is in place; without its entry it reads as a miss
                if exc.errno not in OUT_OF_SPACE:
                    raise
        self.metrics.uncached.inc()
        self.uncached += 1
        log.warning("kept no copy of %s in the host cache: %s", info.key,
                    writer.discarded or "no space left for its entry", extra={"key": info.key})


class HostCacheSource:
    """An Acquire's first source: a HIT from the host cache (no round trip)."""

    def __init__(self, cache: HostCache, hits: HostHits) -> None:
        self.cache = cache
        self.hits = hits

    async def answer(self, ns, md, requests, answers) -> None:
        keys = [r.key for r in requests]  # one trip to a thread for the batch's lookups
        found = await asyncio.to_thread(lambda: [self.cache.lookup(ns, k) for k in keys])
        for i, info in enumerate(found):
            if answers[i] is None and info is not None:
                answers[i] = self.hits.answered_here(info)
