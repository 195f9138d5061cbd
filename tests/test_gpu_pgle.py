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

from compilecast.launch import free_port


def _jax_has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:  # no JAX import where there is plainly no GPU
        return False
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() == "gpu"


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _jax_has_gpu(), reason="needs JAX with a GPU")]

ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
       # A wait that goes wrong ends (and says why) well inside the test's time.
       "COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS": "20000"}


def _job(target: str, name: str, logs: Path, n: int = 2, env: dict | None = None) -> list[dict]:
    """Each process's report; their stderr goes to logs/pgle-NAME-I.log
    (PGLE_LOG_DIR keeps them past the test)."""
    import json
    import os

    dist = f"127.0.0.1:{free_port()}"
    script = Path(__file__).resolve().parent / "pgle_proc.py"
    penv = dict(os.environ, **ENV, **(env or {}))
    procs = []
    for i in range(n):
        with open(logs / f"pgle-{name}-{i}.log", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), target, str(i), str(n), dist, "pgle-job"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=penv))
    reports = []
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            out = ""
        tail = (logs / f"pgle-{name}-{i}.log").read_text(errors="replace")[-4000:]
        assert p.returncode == 0, f"process {i} of {name} failed (rc {p.returncode}):\n{tail}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.fixture
def logs(tmp_path) -> Path:
    import os

    path = Path(os.environ.get("PGLE_LOG_DIR") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_two_processes_of_a_job_run_a_partitioned_program_on_the_gpu(logs):
    """The setting the PGLE test needs (a probe, without compilecast): a
    2-process jax.distributed job whose processes may share one GPU."""
    assert _job("unix:///nonexistent", "probe", logs, env={"PGLE_PROC_PLAIN": "1"}) == \
        [{"probe": "ok"}] * 2


@pytest.fixture
def up_kept(up, logs):
    """`compilecast up`, its log copied next to the processes' at the end."""
    yield up
    shutil.copy(up.log_path, logs / "up.log")


def test_pgle_job_compiles_with_one_profile_and_a_restart_starts_from_the_store(up_kept, logs):
    up = up_kept
    first = _job(up.target, "first", logs)
    for r in first:
        print(r)
        assert r["platform"] == "gpu" and r["max_error"] < 1e-3, r
        assert not r["stats"]["fallbacks"], r["stats"]["reasons"]
        # Nobody waited out the share-binary timeout: the compiling process does
        # not wait for the waiting one (XLA's sharded autotuning, docs/jax.md).
        assert not r["stats"]["local_compiles"], r["stats"]["reasons"]
    # Process 0 compiled with the profile it collected and stored it. Process 1
    # collected its own too and compiled with process 0's, or, when it came to
    # its recompile after process 0 had published the PGLE-optimized
    # executable, took that executable as it is (JAX checks for it first).
    (p0,) = first[0]["exchanges"]
    assert p0["own_bytes"] > 0 and p0["got"] == p0["own"], p0
    assert len(first[1]["exchanges"]) <= 1, first[1]
    for p1 in first[1]["exchanges"]:
        assert p1["own_bytes"] > 0 and p1["got"] == p0["own"], (p0, p1)
    assert [r["stats"]["profiles_published"] for r in first] == [1, 0]
    assert first[1]["stats"]["profiles_received"] == len(first[1]["exchanges"])
    # Two programs each (before and after PGLE): process 0 compiled both under
    # the lease, process 1 loaded them: identical executables.
    assert [r["stats"]["compiles"] for r in first] == [2, 0], first
    assert [r["stats"]["hits"] for r in first] == [0, 2], first
    assert len(first[0]["executables"]) == 2
    assert first[0]["executables"] == first[1]["executables"], first
    optimized = first[0]["executables"][-1]

    # A restarted job finds the PGLE-optimized executable stored under JAX's
    # PGLE key: no profiling runs, no exchange, no compile, the same executable.
    again = _job(up.target, "again", logs)
    for r in again:
        print(r)
        assert r["max_error"] < 1e-3, r
        assert r["exchanges"] == [] and r["stats"]["compiles"] == 0, r
        assert r["executables"] == [optimized], (r["executables"], optimized)
