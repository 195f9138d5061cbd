"""Directories a framework caches into, kept in sync across the fleet.

XLA's GPU autotune results and PyTorch/XLA's persistent cache are
directories of write-once files, each named by what it is for. The host's
worker keeps one directory per kind and namespace (what an entry is valid
for: framework versions, device kind, flags) and shares it:

- publish: a file that has settled (its size and time unchanged since the
  last pass, and older than `settle_s`) and is whole by its kind's format
  (worker/daemon/dirformats.py) is published under the key
  ``dir.<kind>.<namespace id>.<file name>.v<16 hex of its sha256>``: entries
  are write-once per content, so a good copy of a name can follow a bad one.
  It is read through one file descriptor, opened without following links
  under the directory's own descriptor and checked with fstat: nothing from
  outside the directory is ever published.
- install: for each name the directory lacks, the newest listed entry this
  host has not rejected is fetched (every byte verified against its digest),
  written to a hidden temporary file and linked to its name: a reader never
  sees a half-written file, and an existing file is never replaced.
- reject: an installed file the framework deleted (torch_xla deletes a cache
  file it cannot deserialize) is taken out of service: never installed here
  again, and purged from the fleet where the credential may purge.
- scope: a directory is made only for a credential the coordinator accepts,
  under its tenant, with a bound per tenant and in all.
- cost: a pass reads a directory only when it changed (its modification
  time) or holds files not settled yet, and lists the fleet's entries once per
  credential, not once per directory.

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
import secrets
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from compilecast.errors import InvalidRequest, NotFound, TooMany
from compilecast.v1 import cache_pb2 as pb

from .dirformats import why_not_whole

log = logging.getLogger(__name__)

KIND_RE = re.compile(r"[a-z0-9-]{1,32}\Z")
# An entry file's name goes into its key: [A-Za-z0-9._-], not hidden.
NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}\Z")
MAX_PAIRS, MAX_CHARS = 32, 512
TEMP_MARK = ".compilecast-"  # our temporary files: hidden, and this in their name
TAG_RE = re.compile(r"v[0-9a-f]{16}\Z")  # an entry key's content tag
MAX_DIRS_PER_TENANT = 64
MAX_DIRS = 1024
# A directory nobody opened or asked to sync for this long gives its place to
# a new one when the bounds above are reached (its files stay; opening it
# again takes it back).
DIR_IDLE_S = 3600.0
MAX_ENTRIES = 100_000  # files a directory installs; past them it installs no more
MAX_VERSIONS = 16  # contents of one name in the fleet; past them a host publishes no more
TRANSFERS = 8  # publishes or fetches one pass has in flight
_T = TypeVar("_T")


class Client(Protocol):
    """What the sync needs of a compilecast client (worker/inprocess/client.py)."""

    def acquire(self, key: str) -> pb.AcquireResponse: ...
    def publish(self, key: str, lease: pb.Lease, data: bytes,
                compile_time_s: float) -> pb.ArtifactInfo: ...
    def release(self, key: str, lease: pb.Lease, reason: pb.ReleaseReason.ValueType,
                detail: str = "") -> None: ...
    def list_artifacts(self, *, prefix: str = "") -> Iterator[pb.ListedArtifact]: ...
    def fetch(self, key: str, digest: str = "") -> tuple[pb.ArtifactInfo, bytes]: ...
    def purge(self, keys: list[str], digests: Sequence[str] = (), reason: str = "") -> object: ...


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


def entry_key(prefix: str, name: str, digest: str) -> str:
    """The key of one content of entry `name`."""
    return f"{prefix}{name}.v{digest[:16]}"


def split_entry(rest: str) -> tuple[str, str]:
    """(name, content tag) of a key's part after its directory's prefix; the
    tag is "" for a key without one."""
    name, _, tag = rest.rpartition(".")
    return (name, tag) if name and TAG_RE.match(tag) else (rest, "")


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
    rejected_count: int = 0
    known: set[str] = field(default_factory=set)  # keys in the fleet's listing, or sent there
    # name -> (size, mtime_ns, inode) when last seen, of files not published yet
    seen: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # files not settled yet: looked at each pass
    installed_here: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (key, digest)
    rejected: set[str] = field(default_factory=set)  # digests this host's framework refused
    mtime: int = -1  # the directory's, at the last full read
    used: float = field(default_factory=time.monotonic)  # last opened or asked to sync
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
            published=self.published, installed=self.installed,
            refused=self.refused + self.rejected_count,
            publish_off=self.publish_off, install_off=self.install_off)


class DirSync:
    """The directories of one host (under `root`), and their sync."""

    def __init__(self, root: str | os.PathLike[str], client_for: Callable[[str], Client], *,
                 settle_s: float, max_entry_bytes: int,
                 authenticate: Callable[[str], str] = lambda token: "",
                 count: Callable[[str, str, int], None] = lambda kind, event, size: None) -> None:
        self.root = Path(root)
        self.client_for = client_for  # a credential ("" : the worker's) -> a client
        # A credential -> its tenant, as the coordinator says (raises when it
        # refuses it, or cannot be asked): nothing is made for a refused one.
        self.authenticate = authenticate
        self.settle_s = settle_s
        self.max_entry_bytes = max_entry_bytes
        self.count = count  # (kind, event, bytes), for the metrics
        self.dirs: dict[tuple[str, str], Directory] = {}
        self.idle_s = DIR_IDLE_S
        self._lock = threading.Lock()

    @staticmethod
    def scope_of(tenant: str) -> str:
        """The folder of a tenant's directories (a tenant's name never is one)."""
        return "t-" + hashlib.sha256(f"tenant:{tenant}".encode()).hexdigest()[:16]

    def open(self, kind: str, namespace: dict[str, str], *, token: str,
             publish_off: str = "", install_off: str = "") -> Directory:
        """The directory of `kind` and `namespace` for the tenant of `token`
        (tenants never share a directory), made only once the coordinator
        accepted the credential, within MAX_DIRS_PER_TENANT and MAX_DIRS."""
        check_request(kind, namespace)
        nsid = namespace_id(kind, namespace)
        scope = self.scope_of(self.authenticate(token))
        with self._lock:
            d = self.dirs.get((scope, nsid))
            if d is None:
                if sum(s == scope for s, _ in self.dirs) >= MAX_DIRS_PER_TENANT \
                        and not self._close_idle(scope):
                    raise TooMany(f"this worker keeps at most {MAX_DIRS_PER_TENANT} synced "
                                  f"directories per tenant, each used within "
                                  f"{DIR_IDLE_S:.0f} s")
                if len(self.dirs) >= MAX_DIRS and not self._close_idle(None):
                    raise TooMany(f"this worker keeps at most {MAX_DIRS} synced directories, "
                                  f"each used within {DIR_IDLE_S:.0f} s")
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
            d.used = time.monotonic()
            return d

    def _close_idle(self, scope: str | None) -> bool:
        """Stop syncing the directory (of `scope`, or any) used longest ago,
        if it is idle (DIR_IDLE_S); whether one was closed. Its files stay."""
        now = time.monotonic()
        idle = [(d.used, at) for at, d in self.dirs.items()
                if (scope is None or at[0] == scope) and now - d.used >= self.idle_s]
        if not idle:
            return False
        _, at = min(idle)
        d = self.dirs.pop(at)
        log.info("no longer keeping %s directory %s in sync (unused for %.0f s)", d.kind,
                 d.path, now - d.used)
        return True

    def find(self, token: str, nsid: str) -> Directory:
        d = self.dirs.get((self.scope_of(self.authenticate(token)), nsid))
        if d is None:
            raise NotFound(f"no directory {nsid!r} is open on this worker")
        d.used = time.monotonic()
        return d

    def sync(self, d: Directory, listed: dict[str, pb.ArtifactInfo] | None = None
             ) -> tuple[int, int]:
        """One pass over `d`: (published, installed). `listed`: the fleet's
        entries under its prefix, when the caller listed them already."""
        with d.lock:
            client = self.client_for(d.token)
            if listed is None:
                listed = self._listed(d, client, client.list_artifacts(prefix=d.prefix))
            d.known.update(listed)
            self._notice_rejections(d, client)
            published = 0 if d.publish_off else self._publish_new(d, client)
            installed = 0 if d.install_off else self._install_missing(d, client, listed)
            return published, installed

    def _listed(self, d: Directory, client: Client,
                items) -> dict[str, pb.ArtifactInfo]:
        """Key -> artifact of the listed entries under `d`'s prefix."""
        got = {}
        for item in items:
            key = item.artifact.key
            name, _ = split_entry(key[len(d.prefix):])
            if not key.startswith(d.prefix) or not is_entry(name):
                self._refuse(d, name, "listed under another namespace or a malformed name", 0)
                continue
            got[key] = item.artifact
        return got

    def _open_dir(self, d: Directory) -> int:
        return os.open(d.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _candidates(self, d: Directory) -> list[str]:
        """The names a pass looks at: every entry when the directory changed
        since the last full read, else the files not settled yet."""
        mtime = os.stat(d.path, follow_symlinks=False).st_mtime_ns
        if mtime != d.mtime or self.settle_s <= 0:
            d.mtime = mtime
            return [e.name for e in d.files()]
        return sorted(d.pending)

    def _read_entry(self, d: Directory, dir_fd: int, name: str
                    ) -> tuple[bytes, tuple[int, int, int]] | None:
        """The bytes of entry `name` and its (size, mtime_ns, inode), read
        through one descriptor opened without following a link; None when it
        is not a regular file of this directory."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
        except OSError:  # gone, or a link (ELOOP): nothing to publish
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            mark = (st.st_size, st.st_mtime_ns, st.st_ino)
            if st.st_size > self.max_entry_bytes:
                return b"", mark
            chunks, left = [], st.st_size
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks), mark
        finally:
            os.close(fd)

    def _publish_new(self, d: Directory, client: Client) -> int:
        now = time.time()
        todo: list[tuple[str, tuple[int, int, int]]] = []
        dir_fd = self._open_dir(d)
        try:
            for name in self._candidates(d):
                if name in d.installed_here:
                    continue  # another host's entry, installed here
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    d.pending.discard(name)
                    d.seen.pop(name, None)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                mark = (st.st_size, st.st_mtime_ns, st.st_ino)
                before, d.seen[name] = d.seen.get(name), mark
                if before == mark and name not in d.pending:
                    continue  # handled at this version already (published, or refused)
                settled = st.st_size > 0 and (self.settle_s <= 0 or (
                    before == mark and now - st.st_mtime >= self.settle_s))
                if not settled:
                    d.pending.add(name)
                    continue
                d.pending.discard(name)
                todo.append((name, mark))
            contents = Counter(split_entry(k[len(d.prefix):])[0] for k in d.known)
            published = sum(transfers(
                lambda item: self._publish_one(d, client, dir_fd, *item, contents), todo))
        finally:
            os.close(dir_fd)
        d.published += published
        return published

    def _publish_one(self, d: Directory, client: Client, dir_fd: int, name: str,
                     mark: tuple[int, int, int], contents: Counter[str]) -> bool:
        """Publish entry `name` (`contents`: how many contents of each name
        the fleet holds, as listed at the pass's start)."""
        got_file = self._read_entry(d, dir_fd, name)
        if got_file is None:
            return False
        data, read_mark = got_file
        if read_mark != mark:  # changed between the stat and the read: next pass
            d.pending.add(name)
            return False
        if mark[0] > self.max_entry_bytes:
            self._refuse(d, name, f"{mark[0]} bytes, over {self.max_entry_bytes}", mark[0])
            return False
        why = why_not_whole(d.kind, data)
        if why:
            self._refuse(d, name, f"not whole ({why}): not published", len(data))
            return False
        digest = hashlib.sha256(data).hexdigest()
        key = entry_key(d.prefix, name, digest)
        if key in d.known or digest in d.rejected:
            return False
        versions = contents.get(name, 0)
        if versions >= MAX_VERSIONS:
            self._refuse(d, name, f"the fleet holds {versions} contents of this name already "
                                  f"(at most {MAX_VERSIONS}): not published", len(data))
            return False
        got = client.acquire(key)
        if got.decision == pb.HIT:
            d.known.add(key)  # the same bytes are the fleet's already
            return False
        if got.decision != pb.COMPILE:
            d.pending.add(name)  # another host publishes it now, or the service is degraded
            return False
        try:
            client.publish(key, got.lease, data, 0.0)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # else the lease lapses
                client.release(key, got.lease, pb.ABANDONED, f"not published: {exc}")
            if isinstance(exc, Exception):
                log.warning("%s entry %s not published: %s", d.kind, name, exc)
                d.pending.add(name)
                return False
            raise
        d.known.add(key)
        self.count(d.kind, "published", len(data))
        return True

    def _install_missing(self, d: Directory, client: Client,
                         listed: dict[str, pb.ArtifactInfo]) -> int:
        by_name: dict[str, list[pb.ArtifactInfo]] = {}
        for key, info in listed.items():
            name, _ = split_entry(key[len(d.prefix):])
            if info.digest not in d.rejected:
                by_name.setdefault(name, []).append(info)
        todo: list[tuple[str, pb.ArtifactInfo]] = []
        room = MAX_ENTRIES - len(d.files())
        for name, infos in sorted(by_name.items()):
            if os.path.lexists(d.path / name):
                continue
            if len(todo) >= room:
                self._refuse(d, name, f"the directory holds {MAX_ENTRIES} entries", 0)
                break
            # The newest content first (a good copy published after a bad one).
            info = max(infos, key=lambda i: (i.created_unix, i.digest))
            if info.size > self.max_entry_bytes:
                self._refuse(d, name, f"{info.size} bytes, over {self.max_entry_bytes}", 0)
                continue
            todo.append((name, info))
        installed = sum(transfers(lambda item: self._install_one(d, client, *item), todo))
        d.installed += installed
        return installed

    def _install_one(self, d: Directory, client: Client, name: str,
                     info: pb.ArtifactInfo) -> bool:
        try:
            _, data = client.fetch(info.key, info.digest)
        except Exception as exc:  # corrupt, revoked, unreachable: never installed
            self._refuse(d, name, f"fetch failed: {exc}", 0)
            return False
        if not install(d.path / name, data):
            return False
        d.installed_here[name] = (info.key, info.digest)
        self.count(d.kind, "installed", len(data))
        return True

    def _notice_rejections(self, d: Directory, client: Client) -> None:
        """Installed entries the framework deleted (it could not load them):
        never installed here again, and purged from the fleet where the
        credential may."""
        for name, (key, digest) in list(d.installed_here.items()):
            if os.path.lexists(d.path / name):
                continue
            del d.installed_here[name]
            d.rejected.add(digest)
            d.rejected_count += 1
            self.count(d.kind, "rejected", 0)
            try:
                client.purge([key], [digest], reason=f"{d.kind} entry {name} rejected by the "
                                                     "framework on a host")
                log.warning("%s entry %s was rejected by the framework here: taken out of "
                            "service for the fleet", d.kind, name)
            except Exception as exc:  # (no permission to purge: this host alone)
                log.warning("%s entry %s was rejected by the framework here: never installed "
                            "here again (not purged from the fleet: %s)", d.kind, name,
                            str(exc)[:200])

    def _refuse(self, d: Directory, name: str, why: str, size: int) -> None:
        d.refused += 1
        self.count(d.kind, "refused", size)
        log.warning("%s entry %r of %s not taken: %s", d.kind, name[:120], d.path, why)

    async def run(self, every_s: float) -> None:
        """Sync every open directory every `every_s` seconds."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.sync_all)
            except Exception as exc:  # the coordinator away: the next pass tries again
                log.warning("could not sync the synced directories: %s", exc)

    def sync_all(self) -> None:
        """One pass over every directory: the fleet's entries listed once per
        credential (prefix "dir."), each directory read only where it changed."""
        by_token: dict[str, list[Directory]] = {}
        for d in list(self.dirs.values()):
            by_token.setdefault(d.token, []).append(d)
        for token, dirs in by_token.items():
            client = self.client_for(token)
            try:
                items = list(client.list_artifacts(prefix="dir."))
            except Exception as exc:
                log.warning("could not list the fleet's directory entries: %s", exc)
                continue
            for d in dirs:
                try:
                    self.sync(d, self._listed(d, client, (
                        i for i in items if i.artifact.key.startswith(d.prefix))))
                except Exception as exc:
                    log.warning("could not sync %s: %s", d.path, exc)

    def status(self) -> list[pb.SyncedDirectory]:
        out = []
        for d in list(self.dirs.values()):
            try:
                out.append(d.describe())
            except OSError as exc:
                log.warning("cannot read %s: %s", d.path, exc)
        return out


def transfers(one: Callable[[_T], bool], items: list[_T]) -> list[bool]:
    """`one` of each item, TRANSFERS at a time (a pass over thousands of
    entries is bound by round trips, not by this host)."""
    if len(items) <= 1:
        return [one(item) for item in items]
    with ThreadPoolExecutor(min(TRANSFERS, len(items)),
                            thread_name_prefix="compilecast-dirsync") as pool:
        return list(pool.map(one, items))


def install(target: Path, data: bytes) -> bool:
    """Write `data` as `target` all at once: a hidden temporary file, then a
    link to the name. False when a file of that name appeared meanwhile (it
    stays). The temporary file is made new (O_EXCL) and never through a
    link (O_NOFOLLOW): a name planted in the directory is never written
    through."""
    tmp = target.with_name(f".{target.name}{TEMP_MARK}{secrets.token_hex(8)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except FileExistsError:  # planted: ours are never named twice
        return False
    try:
        with open(fd, "wb") as f:
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
