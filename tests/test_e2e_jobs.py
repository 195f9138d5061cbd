"""Multi-process jobs with real JAX processes: the designated process compiles,
the others wait, nobody hangs when the holder dies."""

from __future__ import annotations

import signal
import time

import pytest

from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually
from .e2e import collect, run_procs, start_procs

pytestmark = pytest.mark.slow


def test_distributed_job_compiles_once_and_a_rerun_compiles_nothing(up):
    n = 2
    reference = run_procs(n, "unix:///nonexistent", no_compilecast=True,
                          distributed=True)
    first = run_procs(n, up.target, distributed=True)
    assert sum(r["xla_compiles"] for r in first) == 1, first
    assert first[0]["compilecast"]["published"] == 1  # process 0 is the designated one
    assert first[1]["compilecast"]["waits"] == 1 and first[1]["compilecast"]["hits"] == 1
    assert {r["digest"] for r in first} == {reference[0]["digest"]}

    again = run_procs(n, up.target, distributed=True)
    assert sum(r["xla_compiles"] for r in again) == 0, again
    assert {r["digest"] for r in again} == {reference[0]["digest"]}


def test_holder_killed_mid_compile_a_waiter_is_promoted(start_up):
    ttl = 3
    up = start_up({"COMPILECAST_LEASE_TTL_S": str(ttl)})
    status = CacheClient(up.target)
    job = {"COMPILECAST_JOB": "killtest", "COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS":
           "300000"}
    # Three processes outside jax.distributed, each on its own device: the
    # first to ask compiles, the others wait for that compile.
    procs = start_procs(3, up.target, extra_env=job, layers=400, width=384)
    # One holds the lease while the other two wait: kill it then. The worker
    # sends their waits upstream as one (one host, one key).
    eventually(lambda: (s := status.status()).compiles_in_flight == 1 and s.waiters == 1
               and _sample(up, "compilecast_worker_waiting") == 2,
               "one compile in flight and two processes waiting on one upstream wait", 60.0)
    holder = CacheClient(f"127.0.0.1:{up.ports['coordinator-port']}").status().in_flight[0].holder
    killed = next(p for p in procs if holder.endswith(f":{p.pid}"))
    killed.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    killed.communicate(timeout=10)
    status.close()
    survivors = collect([p for p in procs if p is not killed])
    waited = time.monotonic() - killed_at
    assert sum(r["xla_compiles"] for r in survivors) == 1, survivors
    promoted, loader = sorted(survivors, key=lambda r: -r["compilecast"]["promotions"])
    assert promoted["compilecast"]["promotions"] == 1  # the lowest-id waiter
    assert promoted["compilecast"]["published"] == 1
    assert loader["compilecast"]["hits"] == 1
    assert loader["digest"] == promoted["digest"]
    # Nobody sat out the 300 s share-binary timeout.
    assert waited < 120, waited

    # The promoted process published with the recipe of what it compiled:
    # the recorded program hashes to the key's program component.
    from compilecast.worker.keylib import keys

    coordinator = CacheClient(f"127.0.0.1:{up.ports['coordinator-port']}")
    recipes = coordinator.list_recipes("killtest")
    assert len(recipes) == 1 and recipes[0].job == "killtest", recipes
    recorded = coordinator.describe(recipes[0].key)
    assert recorded.artifact.recipe_digest
    assert keys.program_key(recipes[0].program).components["program"] == \
        recorded.key_components["program"]
    assert recipes[0].compile_options and list(recipes[0].device_ids) == [0]
    coordinator.close()


def _sample(up, name: str) -> float | None:
    """One unlabelled sample from the worker's metrics endpoint."""
    import urllib.request

    text = urllib.request.urlopen(
        f"http://127.0.0.1:{up.ports['worker-metrics-port']}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _fdo_job(target: str, profiles: list[str]) -> list[dict]:
    import subprocess
    import sys
    from pathlib import Path

    from compilecast.launch import free_port

    dist = f"127.0.0.1:{free_port()}"
    script = Path(__file__).resolve().parent / "fdo_proc.py"
    procs = [subprocess.Popen([sys.executable, str(script), target, str(i), str(len(profiles)),
                               dist, p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, p in enumerate(profiles)]
    return collect(procs, timeout_s=180)


def test_the_fdo_profile_is_shared_once_and_a_restarted_job_reuses_it(up):
    """PGLE's profile exchange: the lowest process's profile reaches every
    process through compilecast, and is stored for the next run."""
    first = _fdo_job(up.target, ["profile-of-0-run-1", "profile-of-1-run-1"])
    assert [r["profile"] for r in first] == ["profile-of-0-run-1"] * 2, first
    assert first[0]["stats"]["profiles_published"] == 1
    assert first[1]["stats"]["profiles_received"] == 1
    assert not any(r["stats"]["fallbacks"] for r in first), first

    # A restarted job: new profiles measured, but both start from the stored one.
    again = _fdo_job(up.target, ["profile-of-0-run-2", "profile-of-1-run-2"])
    assert [r["profile"] for r in again] == ["profile-of-0-run-1"] * 2, again
    assert [r["stats"]["profiles_received"] for r in again] == [1, 1]
