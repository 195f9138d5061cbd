"""The key of a compile that reaches the worker through the PJRT interposer.

The same composition as the JAX door's key (worker/keylib/keys.py), from what an
interposed framework process can see:

- the program's canonical digest: a StableHLO portable artifact (what JAX
  hands a PJRT plugin) deserialized, then the same walk as every MLIR
  program; an HLO proto through the same canonicalizer. Debug metadata,
  source paths and names never change it;
- the compile options as read (serialized maps in any order, JAX's
  debug-only fields left out). Options that cannot be read, or that hold
  fields the worker's jaxlib does not know, are keyed by their raw bytes:
  never another options' key;
- the plugin's build: a digest of its library file, its PJRT C API version
  and the attributes it reports (XLA and StableHLO versions);
- the devices: ids, processes, kinds and their attributes (coordinates,
  cores), from the client's device descriptions;
- the environment the plugin reads (XLA_FLAGS, LIBTPU_INIT_ARGS), as XLA
  parses it, minus the flags JAX knows cannot change an executable;
- on a CPU platform, the host CPU (another CPU's executable can die of an
  illegal instruction).

`compilecast explain` names each of these components.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from dataclasses import dataclass, field

from ..keylib import keys
from ..xla import jax_adapter, xlaflags

log = logging.getLogger(__name__)

PJRT_KEY_VERSION = "pjrt-3"
MAX_PLUGIN_BYTES = 2 << 30  # a plugin library larger than this is keyed by its path and size


@dataclass
class Compile:
    """One interposed compile as the interposer describes it."""

    header: dict
    program: bytes
    options: bytes
    devices: str = ""  # "id process kind" lines, each followed by "  name=value" attribute lines
    plugin: str = ""  # "path=...", "api=major.minor", "attribute name=value" lines
    env: dict[str, str] = field(default_factory=dict)
    token: str = ""
    uid: int = -1  # the caller's user (the kernel's word: SO_PEERCRED); -1: not known

    @property
    def platform(self) -> str:
        return str(self.header.get("platform", ""))[:64]

    def owners(self) -> dict[int, int]:
        """Device id -> the process it belongs to."""
        owners: dict[int, int] = {}
        for line in self.devices.splitlines():
            if line.startswith(" "):
                continue
            words = line.split(" ", 2)
            if len(words) >= 2 and words[0].lstrip("-").isdigit() and words[1].isdigit():
                owners[int(words[0])] = int(words[1])
        return owners


def canonical_devices(text: str) -> str:
    """The devices text with each device's attribute lines sorted and the
    devices in order of their lines: a plugin reports a device's attributes
    from a hash map (libtpu: in an order that changes from process to
    process), and the order means nothing."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(" ") and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return "".join(f"{head}\n" + "".join(f"{a}\n" for a in sorted(attrs))
                   for head, *attrs in sorted(blocks))


def parse_env(blob: bytes) -> dict[str, str]:
    """NUL-separated NAME=value entries; only the variables the key reads."""
    env: dict[str, str] = {}
    for entry in blob.split(b"\0"):
        name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if sep and name in xlaflags.ENV_VARS:
            env[name] = value
    return env


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# -- the program ----------------------------------------------------------------

def program_component(program: bytes, fmt: str) -> tuple[str, str, str]:
    """(digest, format, why it was keyed raw or "") of the program a plugin
    is given: MLIR (a portable artifact, plain bytecode or text) or an HLO
    proto, keyed as any program file is (keys.program_key)."""
    key = keys.program_key(program)
    return key.components["program"], key.components["program_format"], key.unparsed


# -- the compile options --------------------------------------------------------

def options_component(raw: bytes) -> tuple[str, str]:
    """(digest, how): the options as JAX's key reads them, or their raw bytes
    where the worker's jaxlib cannot read all of them."""
    try:
        whole = jax_adapter.compile_options_round_trip(raw)
        if len(whole) == len(raw):  # (maps may come back in another order: same size)
            return _digest(jax_adapter.canonical_compile_options(raw)), "read"
        why = "not as this jaxlib writes them (fields it does not know?)"
    except Exception as exc:  # jaxlib's parser: any error means unreadable
        why = f"unreadable ({type(exc).__name__})"
    return _digest(b"raw compile options\n" + raw), why


# -- the plugin's build -----------------------------------------------------------

_plugin_digests: dict[tuple, str] = {}
_plugin_lock = threading.Lock()


NOT_LIBRARIES = ("/proc/", "/sys/", "/dev/")  # never opened for a key, whatever a caller names
ELF_MAGIC = b"\x7fELF"


def _mapped_by(pid: int, path: str) -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of each mapping of `path` in process `pid`'s
    address space; None when its mappings cannot be read."""
    found: set[tuple[int, int, int]] = set()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip(b"\n") == os.fsencode(path):
                    major, _, minor = parts[3].partition(b":")
                    found.add((int(major, 16), int(minor, 16), int(parts[4])))
    except (OSError, ValueError):
        return None
    return found


def library_digest(path: str, uid: int = -1, pid: int = 0, *, hash_new: bool = True
                   ) -> str | None:
    """sha256 of a plugin library, hashed once per file version (device,
    inode, size, modification time). Only a file the calling process `pid`
    has mapped (a library it loaded; 0: not checked, for callers inside the
    worker), a regular ELF file of at most MAX_PLUGIN_BYTES owned by root or
    by `uid` (the caller; -1: any) and writable by no one else, is hashed: a
    caller cannot make the worker read another user's files, a secret of
    root's, or /proc. Any other file is keyed by what can be seen of it,
    never its bytes (a miss at worst). With hash_new=False, None where the
    file would have to be hashed now (its digest is not known yet)."""
    real = os.path.realpath(path)
    if not os.path.isabs(path) or real.startswith(NOT_LIBRARIES):
        return f"{path}: not a library's path; not read"
    mapped = _mapped_by(pid, real) if pid > 0 else None
    if pid > 0 and not mapped:
        return f"{path}: not loaded by the calling process; not read"
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"unreadable {path}: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"not a regular file: {path}"
        seen = f"{path}: {st.st_size} bytes at {st.st_mtime_ns}"
        if mapped is not None and (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) \
                not in mapped:
            return f"{seen}, not the file the calling process loaded; not hashed"
        if uid >= 0 and st.st_uid not in (0, uid):
            return f"{path}: owned by uid {st.st_uid}, neither root nor the caller; not hashed"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and st.st_uid != uid:
            return f"{seen}, writable by others; not hashed"
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _plugin_lock:
            known = _plugin_digests.get(version)
        if known is not None:
            return known
        if st.st_size > MAX_PLUGIN_BYTES:
            return f"{path}: {st.st_size} bytes, not hashed"
        if not hash_new:
            return None
        h = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb") as f:
            if (first := f.read(8 << 20))[:4] != ELF_MAGIC:
                return f"{seen}, not a shared library; not hashed"
            while first:
                h.update(first)
                first = f.read(8 << 20)
        digest = h.hexdigest()
        with _plugin_lock:
            if len(_plugin_digests) >= 64:
                _plugin_digests.clear()
            _plugin_digests[version] = digest
        return digest
    finally:
        os.close(fd)


def library_version(plugin: str) -> str:
    """The plugin library's file version (device, inode, size, modification
    time), or "" when it cannot be seen: what fingerprint() adds of it."""
    path = next((line[5:] for line in plugin.splitlines() if line.startswith("path=")), "")
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return ""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def fingerprint(c: Compile) -> str:
    """A digest of everything compile_key reads: two compiles with the same
    fingerprint have the same key (a host's processes send the same program
    at once; it is keyed once)."""
    h = hashlib.sha256()
    for part in (c.program, c.options, canonical_devices(c.devices).encode(), c.plugin.encode(),
                 repr(sorted(c.env.items())).encode(), library_version(c.plugin).encode(),
                 str(c.uid).encode(),
                 repr(sorted((k, str(v)) for k, v in c.header.items() if k != "pid")).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def plugin_component(plugin: str, uid: int = -1, pid: int = 0, *, hash_new: bool = True
                     ) -> str | None:
    """The plugin's library digest (library_digest: a file the caller
    loaded, of root's or `uid`'s), API version and reported attributes; with
    hash_new=False, None where its library must be hashed first."""
    lines = plugin.splitlines()
    path = next((line[5:] for line in lines if line.startswith("path=")), "")
    rest = sorted(line for line in lines if not line.startswith("path="))
    library = library_digest(path, uid, pid, hash_new=hash_new) if path else "-"
    if library is None:
        return None
    return _digest("\n".join([f"library {library}", *rest]))


# -- the key ----------------------------------------------------------------------

def _plugin_of(c: Compile) -> str:
    made = plugin_component(c.plugin, c.uid, int(c.header.get("pid") or 0))
    assert made is not None  # (hashed when new)
    return made


def compile_key(c: Compile, plugin: str | None = None) -> keys.Key:
    """The key of an interposed compile (see the module's docstring);
    `plugin`: its plugin_component, when already made."""
    program, fmt, unparsed = program_component(c.program, str(c.header.get("format", "")))
    options, options_read = options_component(c.options)
    flags = xlaflags.describe(jax_adapter.excluded_xla_flags(), environ=c.env, argv=[])
    components = {
        "program": program,
        "program_format": fmt,
        "compile_options": options,
        "platform": _digest(f"{c.platform}\n{c.header.get('platform_version', '')}"),
        "plugin": plugin or _plugin_of(c),
        "topology": _digest(canonical_devices(c.devices)),
        "xla_flags": _digest("\n".join(flags)),
        "key_version": PJRT_KEY_VERSION,
    }
    if options_read != "read":
        components["compile_options_raw"] = options_read
    if c.platform == "cpu":
        components["host_cpu"] = keys.host_cpu_digest()
    key = keys.Key(components=components)
    key.unparsed = unparsed
    if log.isEnabledFor(logging.DEBUG):  # what `compilecast explain` names by digest
        log.debug("%s: topology %s from devices:\n%.4000s\nplugin %s from:\n%.2000s", key.value,
                  components["topology"], c.devices, components["plugin"], c.plugin)
    return key


def warm_up() -> None:
    """Load at a worker's start what the first key would load (jaxlib's MLIR
    and XLA bindings): not in the middle of a pod's first wave."""
    jax_adapter.compile_options_round_trip(b"")
    jax_adapter.excluded_xla_flags()
    jax_adapter.mlir_context()
    keys.host_cpu_digest()
