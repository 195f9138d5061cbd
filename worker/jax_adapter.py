"""The one place compilecast touches JAX's private code.

JAX's persistent compilation cache has no public plugin hook. We use:

- `jax._src.compilation_cache._cache` (a `CacheInterface` with get/put) and
  its initialization flags, to route JAX's cache reads and writes to us;
- `jax._src.compiler._cache_read`, wrapped to tell a *decision* read (the
  one before a compile: it may take a compile lease) from a mere presence
  check (`is_executable_in_cache`, used by the PGLE path);
- `jax._src.compiler._compile_and_write_cache`, wrapped so that a lease is
  always settled after the compile: published (even on processes other than
  0, where JAX never calls put), or released when the compile raised or the
  entry is under JAX's thresholds;
- `combine_executable_and_time` / `compress_executable`, to write entries in
  exactly JAX's own format.

`check()` verifies every one of these exists with the expected signature and
raises AdapterError naming what moved; tests/test_jax_adapter.py calls it so a
JAX release that changes them fails loudly in CI rather than silently
disabling the cache.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax._src import compilation_cache as _cc
from jax._src import compiler as _compiler
from jax._src import config as _config
from jax._src import distributed as _distributed
from jax._src.compilation_cache_interface import CacheInterface

TESTED_JAX = ("0.10",)


class AdapterError(RuntimeError):
    """JAX's private API moved; compilecast cannot hook this JAX release."""


_EXPECTED: list[tuple[Any, str, tuple[str, ...] | None]] = [
    (_cc, "_cache", None),
    (_cc, "_cache_initialized", None),
    (_cc, "_cache_checked", None),
    (_cc, "_cache_used", None),
    (_cc, "_cache_initialized_mutex", None),
    (_cc, "combine_executable_and_time", ("serialized_executable", "compile_time")),
    (_cc, "compress_executable", ("executable",)),
    (_compiler, "_cache_read",
     ("module_name", "cache_key", "compile_options", "backend", "executable_devices")),
    (_compiler, "_compile_and_write_cache",
     ("backend", "computation", "executable_devices", "compile_options", "host_callbacks",
      "module_name", "cache_key")),
]


def check() -> None:
    problems = []
    for mod, name, params in _EXPECTED:
        if not hasattr(mod, name):
            problems.append(f"{mod.__name__}.{name} is gone")
            continue
        if params is not None:
            got = tuple(inspect.signature(getattr(mod, name)).parameters)
            if got != params:
                problems.append(f"{mod.__name__}.{name}{got} != expected {params}")
    for name in ("share_binary_between_hosts_timeout_ms", "persistent_cache_min_compile_time_secs",
                 "persistent_cache_min_entry_size_bytes", "share_binary_between_hosts"):
        if not hasattr(_config, name):
            problems.append(f"jax._src.config.{name} is gone")
    if problems:
        raise AdapterError(
            f"compilecast cannot hook JAX {jax.__version__} (tested with "
            f"{', '.join(TESTED_JAX)}.x): " + "; ".join(problems)
        )


class Hooks(Protocol):
    def acquiring(self, key: str) -> contextlib.AbstractContextManager[None]: ...

    def compile(self, key: str, module_name: str, has_host_callbacks: bool,
                run: Callable[[], Any], serialize: Callable[[Any, float], bytes]) -> Any: ...


def serialize(executable: Any, compile_time_s: float) -> bytes:
    """An entry in JAX's own cache format (what put_executable_and_time writes)."""
    data = _cc.combine_executable_and_time(executable.serialize(), int(compile_time_s))
    return _cc.compress_executable(data)


def settings() -> dict[str, Any]:
    return {
        "share_binary_between_hosts_timeout_ms":
            int(_config.share_binary_between_hosts_timeout_ms.value),
        "min_compile_time_s": float(_config.persistent_cache_min_compile_time_secs.value),
        "min_entry_size_bytes": int(_config.persistent_cache_min_entry_size_bytes.value),
    }


def process_identity() -> tuple[int, int] | None:
    """(process_id, process_count) of a jax.distributed job, else None."""
    state = _distributed.global_state
    if state.client is None:
        return None
    return int(state.process_id), int(state.num_processes)


def coordinator_address() -> str:
    return str(_distributed.global_state.coordinator_address or "")


_lock = threading.Lock()
_originals: dict[str, Any] = {}


def install(cache: CacheInterface, hooks: Hooks) -> None:
    """Make `cache` JAX's persistent cache and wrap the compile path."""
    check()
    with _lock:
        if not _originals:
            _originals["_cache_read"] = _compiler._cache_read
            _originals["_compile_and_write_cache"] = _compiler._compile_and_write_cache
            _originals["share_binary"] = _config.share_binary_between_hosts.value
        orig_read = _originals["_cache_read"]
        orig_compile = _originals["_compile_and_write_cache"]

        def _cache_read(module_name, cache_key, compile_options, backend, executable_devices):
            with hooks.acquiring(cache_key):
                return orig_read(module_name, cache_key, compile_options, backend,
                                 executable_devices)

        def _compile_and_write_cache(backend, computation, executable_devices, compile_options,
                                     host_callbacks, module_name, cache_key):
            return hooks.compile(
                cache_key, module_name, bool(host_callbacks),
                lambda: orig_compile(backend, computation, executable_devices, compile_options,
                                     host_callbacks, module_name, cache_key),
                serialize,
            )

        _compiler._cache_read = _cache_read
        _compiler._compile_and_write_cache = _compile_and_write_cache
        # compilecast replaces JAX's own share-binary exchange.
        jax.config.update("jax_share_binary_between_hosts", False)
        with _cc._cache_initialized_mutex:
            _cc._cache = cache
            _cc._cache_initialized = True
            _cc._cache_checked = False
            _cc._cache_used = False


def uninstall() -> None:
    with _lock:
        if not _originals:
            return
        _compiler._cache_read = _originals.pop("_cache_read")
        _compiler._compile_and_write_cache = _originals.pop("_compile_and_write_cache")
        jax.config.update("jax_share_binary_between_hosts", _originals.pop("share_binary"))
        with _cc._cache_initialized_mutex:
            _cc._cache = None
            _cc._cache_initialized = False
            _cc._cache_checked = False
            _cc._cache_used = False


def installed_cache() -> CacheInterface | None:
    return _cc._cache

