"""End-to-end helpers: compilecast.launch with the tests' defaults."""

from __future__ import annotations

import subprocess

from compilecast.launch import Up, collect, start_wave

__all__ = ["LAYERS", "WIDTH", "Up", "collect", "run_procs", "start_procs"]

LAYERS, WIDTH = 48, 256
# Tests cache every compile, however quick, unless a test says otherwise.
TEST_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def start_procs(n: int, target: str, *, extra_env: dict | None = None,
                no_compilecast: bool = False, per_process: list[dict] | None = None,
                distributed: bool = False, layers: int = LAYERS,
                width: int = WIDTH) -> list[subprocess.Popen]:
    return start_wave(n, target, layers, width, baseline=no_compilecast,
                      distributed=distributed, env={**TEST_ENV, **(extra_env or {})},
                      per_process=per_process, delay_s=5.0)


def run_procs(n: int, target: str, **kw) -> list[dict]:
    return collect(start_procs(n, target, **kw), timeout_s=240)
