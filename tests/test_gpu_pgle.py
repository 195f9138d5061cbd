"""PGLE end to end on a GPU: a 2-process jax.distributed job with JAX's
automatic PGLE compiles with one profile on both processes (identical
executables), and a restarted job starts from what was stored.

Skipped where JAX has no GPU: there PGLE collects an empty profile and JAX
exchanges none (tests/test_e2e_jobs.py covers the exchange with given bytes).
The two processes may share one GPU: the program needs no collective.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compilecast.launch import collect, free_port


def _jax_has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:  # no JAX import where there is plainly no GPU
        return False
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "gpu"


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _jax_has_gpu(), reason="needs JAX with a GPU")]

ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _job(target: str, n: int = 2) -> list[dict]:
    import os

    dist = f"127.0.0.1:{free_port()}"
    script = Path(__file__).resolve().parent / "pgle_proc.py"
    env = dict(os.environ, **ENV)
    procs = [subprocess.Popen([sys.executable, str(script), target, str(i), str(n), dist,
                               "pgle-job"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(n)]
    return collect(procs, timeout_s=300)


def test_pgle_job_compiles_with_one_profile_and_a_restart_starts_from_the_store(up):
    first = _job(up.target)
    for r in first:
        print({k: v for k, v in r.items() if k != "stderr"})
        assert r["platform"] == "gpu" and r["max_error"] < 1e-3, r
        assert not r["stats"]["fallbacks"], r["stats"]["reasons"]
    # Each process collected its own profile; both compiled with process 0's.
    assert [len(r["exchanges"]) for r in first] == [1, 1], first
    (p0,), (p1,) = (r["exchanges"] for r in first)
    assert p0["own_bytes"] > 0 and p1["own_bytes"] > 0
    assert p0["got"] == p1["got"] == p0["own"], (p0, p1)
    assert [r["stats"]["profiles_published"] for r in first] == [1, 0]
    assert [r["stats"]["profiles_received"] for r in first] == [0, 1]
    # Two programs each (before and after PGLE): process 0 compiled both under
    # the lease, process 1 loaded them: identical executables.
    assert [r["stats"]["compiles"] for r in first] == [2, 0], first
    assert [r["stats"]["hits"] for r in first] == [0, 2], first
    assert len(first[0]["executables"]) == 2
    assert first[0]["executables"] == first[1]["executables"], first
    optimized = first[0]["executables"][-1]

    # A restarted job finds the PGLE-optimized executable stored under JAX's
    # PGLE key: no profiling runs, no exchange, no compile, the same executable.
    again = _job(up.target)
    for r in again:
        print({k: v for k, v in r.items() if k != "stderr"})
        assert r["max_error"] < 1e-3, r
        assert r["exchanges"] == [] and r["stats"]["compiles"] == 0, r
        assert r["executables"] == [optimized], (r["executables"], optimized)
