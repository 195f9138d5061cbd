"""Which walk writes a module's canonical stream (worker/keylib/mlirwalk.py holds
the grammar and the reference walk).

Two implementations write the same bytes: `_mlircanon` (C, over MLIR's C API
inside jaxlib, which jaxlib does not export: bound by symbol from its ELF
file) and `stream_py` (this module, through jaxlib's Python bindings; about
25x slower on op-heavy modules). The C path runs in a JAX process only after
a self-test in a child process (`python -m compilecast.worker.keylib.mlircanon
--selftest`) matched the two on a corpus for this exact jaxlib library and extension build (the
verdict is kept in ~/.cache/compilecast/mlircanon), or when the package ships
a verdict for that build (KNOWN_BUILDS). Until a verdict exists the first
key starts that test in the background and uses the reference; keys never
depend on which path ran.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

from .mlirwalk import (  # noqa: F401 (the reference walk, as the gate's callers name it)
    MAX_NESTING,
    NESTED_REFUSED,
    RESOURCE_REFUSED,
    STREAM_VERSION,
    BindingsRefused,
    NestingRefused,
    ResourceRefused,
    ir_bindings,
    private_renames,
    stream_py,
)

log = logging.getLogger("compilecast.mlircanon")


# -- the C path and its gate -------------------------------------------------------

_native: Any  # the C extension, or None
try:
    from . import _mlircanon as _native
except ImportError:  # not built (no compiler at install): the reference only
    # (Every use is behind a check of this, or of the gate that checks it.)
    _native = None

_state_lock = threading.Lock()
_state: dict[str, Any] = {"native": None, "testing": False, "next_try": 0.0}


def library_candidates() -> list[Path]:
    """The jaxlib files that may hold MLIR's C API, most likely first (found
    without importing jaxlib)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.origin:
        return []
    root = Path(spec.origin).parent
    return [root / "libjax_common.so", root / "mlir" / "_mlir_libs" / "libjaxlib_mlir_capi.so"]


def _build_id() -> str:
    """What a verdict is about: this extension and jaxlib's library files."""
    parts = [STREAM_VERSION]
    files = ([Path(_native.__file__)] if _native is not None else []) + library_candidates()
    for p in files:
        try:
            st = p.stat()
            parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{p}:-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _verdict_path() -> Path:
    """Verdicts are about the machine's installed files, not a data home: one
    place per user (XDG cache), whatever COMPILECAST_HOME a process has."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "compilecast" / "mlircanon" / f"{_build_id()}.json"


def find_api() -> tuple[str, list[int]] | None:
    """(library, symbol locations) of MLIR's C API in jaxlib's files, or
    None. Reads the library's symbol tables: done by the self-test, whose
    verdict records the locations. A process that binds them reads those
    entries alone and checks each names the function it stands for, so a
    verdict file can only ever point at the library's own functions."""
    if _native is None:
        return None
    for lib in library_candidates():
        if lib.exists():
            try:
                return str(lib), _native.symbols(str(lib))
            except (LookupError, OSError, ValueError) as e:
                log.debug("MLIR C API not in %s: %s", lib, e)
    return None


def _bind(lib: str, locations: list[int]) -> bool:
    """Bind the C path in this process to `lib` (which jaxlib loads)."""
    ir_bindings()  # loads jaxlib's libraries: bind() looks for them among the loaded ones
    try:
        _native.bind(lib, locations)
        return True
    except (LookupError, OSError, ValueError, TypeError) as e:
        log.info("MLIR keys use the Python walk: cannot bind %s: %s", lib, e)
        return False


def bind_here() -> str | None:
    """Find and bind the C API in this process; the library, or None."""
    api = find_api()
    return api[0] if api is not None and _bind(*api) else None


SELFTEST_TIMEOUT_S = 300
RECHECK_S = 5.0  # how soon a process without a verdict looks again


def _run_selftest() -> None:
    """The self-test in a child process on the CPU platform (it must never
    take the accelerator this process holds); the child writes the verdict,
    or this process does when the child died. One machine-wide at a time: a
    job's processes starting together run it once, and the others look for
    its verdict again a few seconds later."""
    path = _verdict_path()
    running = path.with_suffix(".running")
    ours = False
    retry_s = RECHECK_S
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(running, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            ours = True
        except FileExistsError:
            if time.time() - running.stat().st_mtime < SELFTEST_TIMEOUT_S:
                return  # another process tests this build now
            running.touch()  # a stale marker: its process died
            ours = True
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-m", "compilecast.worker.keylib.mlircanon", "--selftest"],
                              capture_output=True, text=True, timeout=SELFTEST_TIMEOUT_S, env=env)
        if proc.returncode != 0 and not path.exists():
            _write_verdict(False, f"self-test exited {proc.returncode}: {proc.stderr[-500:]}")
    except (OSError, subprocess.SubprocessError) as e:
        log.info("MLIR key self-test did not run: %s", e)
        retry_s = SELFTEST_TIMEOUT_S  # not every key of this process tries again
    finally:
        if ours:
            with contextlib.suppress(OSError):
                running.unlink()
        with _state_lock:
            _state["testing"] = False
            _state["native"] = None  # read the verdict again
            _state["next_try"] = time.monotonic() + retry_s


def _write_verdict(ok: bool, why: str, api: tuple[str, list[int]] | None = None) -> None:
    path = _verdict_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record: dict[str, Any] = {"ok": ok, "why": why}
    if api is not None:
        record.update(library=api[0], symbol_locations=api[1])
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


# Verdicts compilecast's own CI recorded (`python -m compilecast.worker.keylib.mlircanon
# --record` after the self-test passed), by the sha256 that jaxlib's wheel RECORD
# gives its library file: a process with that exact build binds at once, with
# no self-test of its own (containers start with an empty ~/.cache).
KNOWN_BUILDS = Path(__file__).with_name("mlircanon_known.json")


def _api_signature() -> str:
    """Which functions, in which order, this extension binds."""
    return hashlib.sha256("\n".join(_native.api_names()).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _jaxlib_record() -> tuple[Any, str] | None:
    """jaxlib's installed distribution and its RECORD, read once per process
    (each library candidate is looked up in it)."""
    from importlib import metadata
    try:
        dist = metadata.distribution("jaxlib")
        return dist, dist.read_text("RECORD") or ""
    except (metadata.PackageNotFoundError, OSError):
        return None


def installed_hash(lib: Path) -> str | None:
    """The sha256 jaxlib's RECORD gives `lib`, when the file still has the
    size pip installed it with. Only RECORD's lines that name the file are
    parsed: every JAX process asks this at its first compile, and building
    a path object for each of its 200-odd entries (importlib.metadata.files)
    took ~2 ms there, against ~0.7 ms now."""
    found = _jaxlib_record()
    if found is None:
        return None
    dist, record = found
    lines = [line for line in record.splitlines() if lib.name in line]
    for path, digest, size in (row for row in csv.reader(lines) if len(row) == 3):
        mode, _, value = digest.partition("=")
        if PurePosixPath(path).name != lib.name or mode != "sha256" or not value \
                or not size.isdigit():
            continue
        try:
            if Path(str(dist.locate_file(path))).resolve() == lib.resolve() and \
                    lib.stat().st_size == int(size):
                return value
        except OSError:
            return None
    return None


def known_build() -> dict[str, Any] | None:
    """The verdict shipped for this exact jaxlib build, or None."""
    try:
        known = json.loads(KNOWN_BUILDS.read_text())
    except (OSError, ValueError):
        return None
    for lib in library_candidates():
        if not lib.exists():
            continue
        entry = known.get(installed_hash(lib) or "")
        if entry and entry.get("api") == _api_signature() and \
                entry.get("stream_version") == STREAM_VERSION:
            return {"ok": True, "why": f"recorded for jaxlib {entry.get('jaxlib')}",
                    "library": str(lib), "symbol_locations": entry["symbol_locations"]}
    return None


def _load_verdict() -> dict[str, Any] | None:
    known = known_build()
    if known is not None:
        return known
    try:
        return json.loads(_verdict_path().read_text())
    except (OSError, ValueError):
        return None


def native_ready(*, wait: bool = False) -> bool:
    """Whether keys in this process use the C path. Without a verdict for this
    build, starts the self-test (in the background unless `wait`).
    COMPILECAST_KEY_NATIVE=0 keeps a process on the reference."""
    if _native is None or os.environ.get("COMPILECAST_KEY_NATIVE", "1") == "0":
        return False
    with _state_lock:
        if _state["native"] is not None:
            return bool(_state["native"])
    verdict = _load_verdict()
    if verdict is None:
        with _state_lock:
            if not wait and (_state["testing"] or time.monotonic() < _state["next_try"]):
                return False
            _state["testing"] = True
        if wait:
            _run_selftest()
            return _load_verdict() is not None and native_ready()
        log.info("MLIR keys use the Python walk until the C walk's self-test for this jaxlib "
                 "build has a verdict (started in the background)")
        threading.Thread(target=_run_selftest, name="compilecast-mlircanon-selftest",
                         daemon=True).start()
        return False
    ok = bool(verdict.get("ok")) and _bind(str(verdict.get("library")),
                                           list(verdict.get("symbol_locations") or []))
    if ok:
        log.debug("MLIR keys use the C walk (%s)", verdict.get("why"))
    if not verdict.get("ok"):
        log.info("MLIR keys use the Python walk: %s", verdict.get("why"))
    with _state_lock:
        _state["native"] = ok
    return ok


def warm_up() -> threading.Thread | None:
    """Give this machine a verdict for its jaxlib before JAX processes need
    one, without importing JAX here (the worker daemon calls this at start)."""
    if _native is None or not library_candidates() or _load_verdict() is not None:
        return None
    t = threading.Thread(target=_run_selftest, name="compilecast-mlircanon-selftest", daemon=True)
    t.start()
    return t


def stream(module: Any, hasher: Any, ignore: frozenset[str],
           renames: dict[str, str] | None, kernel: Any = None) -> None:
    """The canonical stream of `module` into `hasher`, by the fastest path
    this process may use; ResourceRefused for a module with dense_resource
    constants. renames None: the module's private_renames (found in C on
    the C path). kernel: as stream_py. NestingRefused for a module nested
    deeper than MAX_NESTING."""
    if native_ready():
        try:
            _native.canonical_stream(module._CAPIPtr, hasher, ignore, renames, kernel)
        except ValueError as e:
            if str(e) == RESOURCE_REFUSED:
                raise ResourceRefused(str(e)) from None
            if str(e) == NESTED_REFUSED:
                raise NestingRefused(str(e)) from None
            raise
    else:
        stream_py(module, hasher, ignore, renames, kernel)


# -- the self-test ---------------------------------------------------------------

def selftest_corpus() -> list[Any]:
    """Modules that exercise every rule of the stream: control flow with
    regions and blocks, private functions and calls, dense constants of each
    raw element type and printed ones, arg/res attributes, shardings."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    @jax.jit
    def helper(x):
        return jnp.tanh(x) * 3

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + helper(c), x)

    def branches(x, p):
        return jax.lax.cond(p, lambda y: y * 2, lambda y: helper(y) - 1, x)

    def consts(x):
        out = x
        for dt in (np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64):
            out = out + jnp.asarray(np.arange(7, dtype=dt)).astype(x.dtype).sum()
        out = out + jnp.asarray(np.full((5,), 2.5, np.float32)).sum()  # a splat
        out = out + jnp.asarray(np.array([True, False, True])).astype(x.dtype).sum()  # i1
        out = out + jnp.asarray(np.arange(4).astype(jnp.bfloat16)).astype(x.dtype).sum()
        return out

    def donate(x, y):
        return x + y, jnp.dot(x, y)

    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)  # abstract: nothing is placed on a device
    with jax.enable_x64(True):  # 64-bit constants stay 64-bit
        wide = jax.jit(consts).lower(x).compiler_ir("stablehlo")
    return [
        jax.jit(loop).lower(x).compiler_ir("stablehlo"),
        jax.jit(branches).lower(x, jax.ShapeDtypeStruct((), jnp.bool_)).compiler_ir("stablehlo"),
        jax.jit(consts).lower(x).compiler_ir("stablehlo"),
        wide,
        jax.jit(donate, donate_argnums=(0,)).lower(x, x).compiler_ir("stablehlo"),
        jax.jit(lambda t: {"a": t["a"].sum(), "b": t["b"] * 2}).lower(
            {"a": x, "b": x}).compiler_ir("stablehlo"),
    ]


def selftest() -> tuple[bool, str, tuple[str, list[int]] | None]:
    """The C path against the reference on the corpus, in this process:
    (passed, why, the API it bound)."""
    if _native is None:
        return False, "the _mlircanon extension is not built", None
    api = find_api()
    if api is None:
        return False, "no jaxlib library file holds MLIR's C API", None
    if not _bind(*api):
        return False, f"{api[0]} is not loaded by jaxlib's MLIR", None
    lib = api[0]
    ignore_lists: tuple[frozenset[str], ...] = (
        frozenset(), frozenset({"jax.arg_info", "jax.result_info"}))
    for i, module in enumerate(selftest_corpus()):
        found_or_none: tuple[dict[str, str] | None, ...] = (None, {})
        for ignore, renames in itertools.product(ignore_lists, found_or_none):
            a, b = hashlib.sha256(), hashlib.sha256()
            _native.canonical_stream(module._CAPIPtr, a, ignore, renames)  # None: found in C
            stream_py(module, b, ignore, renames)  # None: found by private_renames
            if a.digest() != b.digest():
                return False, (f"corpus module {i} streams differ (ignore={sorted(ignore)}, "
                               f"renames={'found' if renames is None else 'none'})"), None
    return True, f"C path matches the reference ({lib})", api


def record(api: tuple[str, list[int]]) -> str:
    """Add this jaxlib build's passing verdict to KNOWN_BUILDS."""
    import jaxlib.version
    lib = Path(api[0])
    digest = installed_hash(lib)
    if digest is None:
        raise ValueError(f"{lib} is not as jaxlib's RECORD describes it: nothing recorded")
    try:
        known = json.loads(KNOWN_BUILDS.read_text())
    except (OSError, ValueError):
        known = {}
    known[digest] = {"jaxlib": jaxlib.version.__version__, "library": lib.name,
                     "machine": os.uname().machine, "api": _api_signature(),
                     "stream_version": STREAM_VERSION, "symbol_locations": api[1]}
    KNOWN_BUILDS.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    return digest


def main(argv: list[str]) -> int:
    if argv not in (["--selftest"], ["--record"]):
        print("usage: python -m compilecast.worker.keylib.mlircanon --selftest | --record",
              file=sys.stderr)
        return 2
    try:
        ok, why, api = selftest()
    except Exception as e:  # the reference failing is a failed self-test too
        ok, why, api = False, f"self-test raised {type(e).__name__}: {e}", None
    if argv == ["--record"]:
        if not ok or api is None:
            print(f"failed: {why}: nothing recorded", file=sys.stderr)
            return 1
        print(f"recorded {record(api)} in {KNOWN_BUILDS}")
        return 0
    _write_verdict(ok, why, api)
    print(("ok: " if ok else "failed: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
