"""The host cache: a size-bounded blob store plus a key index on local disk.

    ROOT/blobs/...             DiskBlobStore (LRU-evicted above max_bytes)
    ROOT/keys/NS/KEY.json      ArtifactInfo of KEY (written atomically)

NS is the namespace of the credential the entry was fetched or published
with (see WorkerService), so a host-cache hit is only served to a caller
presenting the same credential: tenants never read each other's entries here.
Blobs are content-addressed and shared. A key entry whose blob was evicted
reads as a miss. Both the worker and a
restarted worker see the same entries; processes on the host never read this
directory themselves, they ask the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from compilecast.blobstore import DiskBlobStore
from compilecast.v1 import cache_pb2 as pb

MAX_ENTRY = 1 << 16  # an index entry is ~150 bytes; a bigger file is not one of ours


class HostCache:
    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int, min_free: int = 0,
                 reverify_s: float = 600.0, readable: bool = False) -> None:
        self.root = Path(root)
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
            info = pb.ArtifactInfo(key=key, **json.loads(raw))
        except (ValueError, TypeError):
            self.forget(ns, key)
            return None
        return info if self.store.has(info.digest) else None

    def record(self, ns: str, info: pb.ArtifactInfo) -> None:
        body = json.dumps({"digest": info.digest, "size": info.size,
                           "compile_time_seconds": info.compile_time_seconds,
                           "created_unix": info.created_unix}).encode()
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

    def forget(self, ns: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._entry(ns, key).unlink()

    def count(self) -> int:
        return sum(1 for p in self.keys.glob("*/*.json")
                   if self.lookup(p.parent.name, p.stem) is not None)
