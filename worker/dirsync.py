"""Directories a framework caches into, kept in sync across the fleet.

XLA's GPU autotune results and PyTorch/XLA's persistent cache are
directories of write-once files, each named by what it is for. The host's
worker keeps one directory per kind and namespace (what an entry is valid
for: framework versions, device kind, flags) and shares it:

- publish: a file that has settled (its size and time unchanged since the
  last pass, and older than `settle_s`) is published under the key
  ``dir.<kind>.<namespace id>.<file name>``. The key's lease makes it
  write-once across the fleet: the first host's bytes are the entry's, a
  later host with the same name finds a HIT and publishes nothing.
- install: every entry listed under the directory's key prefix that the
  directory lacks is fetched (every byte verified against its digest), written
  to a hidden temporary file and linked to its name: a reader never sees a
  half-written file, and an existing file is never replaced.

The entries go through the coordinator as artifacts do, so its store (disk
or bucket), authorization (publish permission), purge and sweep apply to
them. The worker talks to the coordinator with a plain client, as a process
would, with the credential of the process that opened the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from compilecast.errors import InvalidRequest, NotFound
from compilecast.v1 import cache_pb2 as pb

log = logging.getLogger(__name__)

KIND_RE = re.compile(r"[a-z0-9-]{1,32}\Z")
# An entry file's name goes into its key: [A-Za-z0-9._-], not hidden.
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}\Z")
MAX_PAIRS, MAX_CHARS = 32, 512
TEMP_MARK = ".compilecast-"  # our temporary files: hidden, and this in their name


class Client(Protocol):
    """What the sync needs of a compilecast client (worker/client.py)."""

    def acquire(self, key: str) -> pb.AcquireResponse: ...
    def publish(self, key: str, lease: pb.Lease, data: bytes,
                compile_time_s: float) -> pb.ArtifactInfo: ...
    def release(self, key: str, lease: pb.Lease, reason: int, detail: str = "") -> None: ...
    def list_artifacts(self, *, prefix: str = "") -> Iterator[pb.ListedArtifact]: ...
    def fetch(self, key: str, digest: str = "") -> tuple[pb.ArtifactInfo, bytes]: ...


def check_request(kind: str, namespace: dict[str, str]) -> None:
    if not KIND_RE.match(kind):
        raise InvalidRequest(f"directory kind {kind[:40]!r} is invalid: use 1-32 characters "
                             "of [a-z0-9-]")
    if len(namespace) > MAX_PAIRS:
        raise InvalidRequest(f"a directory's namespace has at most {MAX_PAIRS} pairs, "
                             f"got {len(namespace)}")
    for name, value in namespace.items():
        if not name or len(name) > MAX_CHARS or len(value) > MAX_CHARS:
            raise InvalidRequest(f"namespace pair {name[:40]!r}: names are 1-{MAX_CHARS} "
                                 f"characters, values at most {MAX_CHARS}")


def namespace_id(kind: str, namespace: dict[str, str]) -> str:
    text = json.dumps({"kind": kind, "namespace": namespace}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def key_prefix(kind: str, nsid: str) -> str:
    return f"dir.{kind}.{nsid}."


def is_entry(name: str) -> bool:
    """A file the sync publishes: a plain name, not hidden, not a temporary
    file (ours, or a writer's `*.tmp*`)."""
    return bool(NAME_RE.match(name)) and ".tmp" not in name and TEMP_MARK not in name


@dataclass
class Directory:
    kind: str
    namespace: dict[str, str]
    nsid: str
    path: Path
    token: str  # the opener's credential ("" : the worker's own)
    publish_off: str = ""
    install_off: str = ""
    published: int = 0
    installed: int = 0
    refused: int = 0
    known: set[str] = field(default_factory=set)  # in the fleet's listing, or sent there
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, mtime_ns)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one pass at a time

    @property
    def prefix(self) -> str:
        return key_prefix(self.kind, self.nsid)

    def files(self) -> list[os.DirEntry]:
        with os.scandir(self.path) as it:
            return [e for e in it if e.is_file(follow_symlinks=False) and is_entry(e.name)]

    def describe(self) -> pb.SyncedDirectory:
        files = list(self.files())
        return pb.SyncedDirectory(
            kind=self.kind, namespace_id=self.nsid,
            namespace=",".join(f"{k}={v}" for k, v in sorted(self.namespace.items())),
            path=str(self.path), entries=len(files),
            bytes=sum(e.stat(follow_symlinks=False).st_size for e in files),
            published=self.published, installed=self.installed, refused=self.refused,
            publish_off=self.publish_off, install_off=self.install_off)


class DirSync:
    """The directories of one host (under `root`), and their sync."""

    def __init__(self, root: str | os.PathLike[str], client_for: Callable[[str], Client], *,
                 settle_s: float, max_entry_bytes: int,
                 count: Callable[[str, str, int], None] = lambda kind, event, size: None) -> None:
        self.root = Path(root)
        self.client_for = client_for  # a credential ("" : the worker's) -> a client
        self.settle_s = settle_s
        self.max_entry_bytes = max_entry_bytes
        self.count = count  # (kind, event, bytes), for the metrics
        self.dirs: dict[tuple[str, str], Directory] = {}
        self._lock = threading.Lock()

    def open(self, kind: str, namespace: dict[str, str], *, token: str, scope: str,
             publish_off: str = "", install_off: str = "") -> Directory:
        """The directory of `kind` and `namespace` for callers of `scope` (a
        credential's host-cache namespace: tenants never share a directory)."""
        check_request(kind, namespace)
        nsid = namespace_id(kind, namespace)
        with self._lock:
            d = self.dirs.get((scope, nsid))
            if d is None:
                path = self.root / scope / kind / nsid
                path.mkdir(parents=True, exist_ok=True)
                (path.parent / f"{nsid}.json").write_text(
                    json.dumps({"kind": kind, "namespace": namespace}, sort_keys=True))
                d = Directory(kind, dict(namespace), nsid, path, token, publish_off,
                              install_off)
                self.dirs[(scope, nsid)] = d
                log.info("keeping %s directory %s in sync (%s)", kind, path,
                         d.describe().namespace)
            else:  # a reason to stop, from any opener, stands
                d.publish_off = d.publish_off or publish_off
                d.install_off = d.install_off or install_off
            return d

    def find(self, scope: str, nsid: str) -> Directory:
        d = self.dirs.get((scope, nsid))
        if d is None:
            raise NotFound(f"no directory {nsid!r} is open on this worker")
        return d

    def sync(self, d: Directory) -> tuple[int, int]:
        """One pass over `d`: (published, installed)."""
        with d.lock:
            client = self.client_for(d.token)
            listed = self._listed(d, client)
            d.known.update(listed)
            published = 0 if d.publish_off else self._publish_new(d, client)
            installed = 0 if d.install_off else self._install_missing(d, client, listed)
            return published, installed

    def _listed(self, d: Directory, client: Client) -> dict[str, pb.ArtifactInfo]:
        got = {}
        for item in client.list_artifacts(prefix=d.prefix):
            key = item.artifact.key
            name = key[len(d.prefix):]
            if not key.startswith(d.prefix) or not is_entry(name):
                self._refuse(d, name, "listed under another namespace or a malformed name", 0)
                continue
            got[name] = item.artifact
        return got

    def _settled(self, d: Directory, entry: os.DirEntry, now: float) -> bool:
        st = entry.stat(follow_symlinks=False)
        mark = (st.st_size, st.st_mtime_ns)
        before, d.seen[entry.name] = d.seen.get(entry.name), mark
        if st.st_size == 0:
            return False
        if self.settle_s <= 0:
            return True
        return before == mark and now - st.st_mtime >= self.settle_s

    def _publish_new(self, d: Directory, client: Client) -> int:
        now, published = time.time(), 0
        for entry in d.files():
            if entry.name in d.known or not self._settled(d, entry, now):
                continue
            size = entry.stat(follow_symlinks=False).st_size
            if size > self.max_entry_bytes:
                d.known.add(entry.name)
                self._refuse(d, entry.name, f"{size} bytes, over {self.max_entry_bytes}", size)
                continue
            if self._publish_one(d, client, entry):
                published += 1
        return published

    def _publish_one(self, d: Directory, client: Client, entry: os.DirEntry) -> bool:
        key = d.prefix + entry.name
        got = client.acquire(key)
        if got.decision == pb.HIT:
            d.known.add(entry.name)  # another host's bytes are the entry's
            return False
        if got.decision != pb.COMPILE:
            return False  # another host publishes it now, or the service is degraded: later
        try:
            data = Path(entry.path).read_bytes()
            if not data:
                raise OSError("the file became empty")
            client.publish(key, got.lease, data, 0.0)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # else the lease lapses
                client.release(key, got.lease, pb.ABANDONED, f"not published: {exc}")
            if isinstance(exc, Exception):
                log.warning("%s entry %s not published: %s", d.kind, entry.name, exc)
                return False
            raise
        d.known.add(entry.name)
        d.published += 1
        self.count(d.kind, "published", len(data))
        return True

    def _install_missing(self, d: Directory, client: Client,
                         listed: dict[str, pb.ArtifactInfo]) -> int:
        installed = 0
        for name, info in listed.items():
            target = d.path / name
            if target.exists():
                continue
            if info.size > self.max_entry_bytes:
                self._refuse(d, name, f"{info.size} bytes, over {self.max_entry_bytes}", 0)
                continue
            try:
                _, data = client.fetch(info.key, info.digest)
            except Exception as exc:  # corrupt, revoked, unreachable: never installed
                self._refuse(d, name, f"fetch failed: {exc}", 0)
                continue
            if install(target, data):
                installed += 1
                d.installed += 1
                self.count(d.kind, "installed", len(data))
        return installed

    def _refuse(self, d: Directory, name: str, why: str, size: int) -> None:
        d.refused += 1
        self.count(d.kind, "refused", size)
        log.warning("%s entry %r of %s not taken: %s", d.kind, name[:120], d.path, why)

    async def run(self, every_s: float) -> None:
        """Sync every open directory every `every_s` seconds."""
        while True:
            await asyncio.sleep(every_s)
            for d in list(self.dirs.values()):
                try:
                    await asyncio.to_thread(self.sync, d)
                except Exception as exc:  # the coordinator away: the next pass tries again
                    log.warning("could not sync %s: %s", d.path, exc)

    def status(self) -> list[pb.SyncedDirectory]:
        out = []
        for d in list(self.dirs.values()):
            try:
                out.append(d.describe())
            except OSError as exc:
                log.warning("cannot read %s: %s", d.path, exc)
        return out


def install(target: Path, data: bytes) -> bool:
    """Write `data` as `target` all at once: a hidden temporary file, then a
    link to the name. False when a file of that name appeared meanwhile (it
    stays)."""
    tmp = target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
