"""Who compiles, in every shape of a real multi-host job: real jax.distributed
CPU jobs (gloo) against `compilecast up`, each process running
tests/job_shapes_proc.py. A program whose devices span several processes is
compiled once, by the owner of its lowest device id, and only its members
wait; any other program waits for nobody. Counted from JAX's own compile
calls (backend_compile_and_load) and compilecast's stats."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compilecast.launch import collect, free_port

from .e2e import TEST_ENV

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "job_shapes_proc.py"
MIXED = ["global", "local", "stage", "small", "callback"]


def _job(target: str, n: int, shapes: list[str], *flags: str, env: dict | None = None,
         only: dict[int, list[str]] | None = None) -> list[dict]:
    """Run the job; each process's report, by process id. `only`: flags for
    some processes alone."""
    base = dict(os.environ, COMPILECAST_WORKER=target, JAX_PLATFORMS="cpu", **TEST_ENV,
                **(env or {}))
    if "COMPILECAST_ENABLE" not in (env or {}):
        base.pop("COMPILECAST_ENABLE", None)
    dist = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), dist, str(n), str(i), ",".join(shapes),
                               *flags, *(only or {}).get(i, [])],
                              env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    return collect(procs, timeout_s=int(os.environ.get("SHAPES_TIMEOUT", 240)))


def _shape(reports: list[dict], shape: str) -> list[dict]:
    return [r["shapes"][shape] for r in reports]


def _total(reports: list[dict], shape: str, what: str) -> int:
    return sum(s["xla_compiles"] if what == "xla" else s["stats"].get(what, 0)
               for s in _shape(reports, shape))


def _results(reports: list[dict]) -> list[dict]:
    return [{k: s["result"] for k, s in r["shapes"].items()} for r in reports]


def test_a_mixed_job_compiles_each_shared_program_once_and_its_second_run_nothing(up):
    n = 3
    baseline = _job(up.target, n, MIXED, "--baseline")
    first = _job(up.target, n, MIXED)
    assert _results(first) == _results(baseline)
    assert not any(r["stats"].get("fallbacks") for s in MIXED for r in _shape(first, s)), first

    # A global program: compiled once, by process 0; the others load it, having
    # waited for it when they asked before its publish (a fast compile may be
    # published before another process asks: a hit without a wait).
    glob = _shape(first, "global")
    assert _total(first, "global", "xla") == 1 and glob[0]["stats"]["published"] == 1, glob
    assert all(s["stats"]["waits"] <= 1 and s["stats"]["hits"] == 1
               and s["stats"]["compiles"] == 0 for s in glob[1:]), glob

    # Per-process programs (a jit and eager ops on the process's own device):
    # each process compiles and publishes its own, waiting for nobody.
    for s in _shape(first, "local"):
        assert s["xla_compiles"] > 0 and s["stats"]["published"] == s["xla_compiles"], s
        assert s["stats"]["waits"] == 0 and s["stats"]["promotions"] == 0, s

    # A stage on processes 1 and 2: process 1 compiles, process 0 is untouched.
    stage = _shape(first, "stage")
    assert stage[0]["xla_compiles"] == 0 and not any(stage[0]["stats"].values()), stage
    assert _total(first, "stage", "xla") == 1 and stage[1]["stats"]["published"] == 1, stage
    assert stage[2]["stats"]["hits"] == 1 and stage[2]["stats"]["promotions"] == 0, stage

    # Under JAX's min compile time: nothing kept, nobody promoted; the others'
    # wait ends with the designated process's release, not a grace period.
    small = _shape(first, "small")
    assert all(s["xla_compiles"] == 1 and s["stats"]["published"] == 0
               and s["stats"]["promotions"] == 0 for s in small), small
    assert all(any("below the caching thresholds" in why for why in r["reasons"])
               for r in first[1:]), first
    # With host callbacks: never shared, never asked for, never waited for.
    for s in _shape(first, "callback"):
        assert s["xla_compiles"] == 1 and s["stats"]["local_compiles"] == 1, s
        assert s["stats"]["waits"] == 0 and s["stats"]["compiles"] == 0, s

    again = _job(up.target, n, MIXED)
    assert _results(again) == _results(baseline)
    for shape in ("global", "local", "stage"):
        assert _total(again, shape, "xla") == 0, _shape(again, shape)
        assert _total(again, shape, "waits") == 0, _shape(again, shape)


def test_two_stages_on_disjoint_processes_at_once_compile_once_each(up):
    reports = _job(up.target, 4, ["stages"])
    stages = _shape(reports, "stages")
    # Processes 0-1 run one stage, 2-3 the other: the lowest of each compiles.
    assert [s["xla_compiles"] for s in stages] == [1, 0, 1, 0], stages
    assert [s["stats"]["published"] for s in stages] == [1, 0, 1, 0], stages
    assert [s["stats"]["hits"] for s in stages] == [0, 1, 0, 1], stages
    assert _total(reports, "stages", "promotions") == 0, stages
    assert _results(reports) == _results(_job(up.target, 4, ["stages"], "--baseline"))


def test_the_plugin_path_turns_compilecast_on_without_a_call(up):
    kept = _job(up.target, 2, ["global", "local"], "--plugin", env={"COMPILECAST_ENABLE": "1"})
    assert _total(kept, "global", "xla") == 1 and _total(kept, "global", "published") == 1, kept
    assert all(s["stats"]["published"] == s["xla_compiles"] > 0
               for s in _shape(kept, "local")), kept


def test_entries_under_jax_min_entry_size_are_kept_out(up):
    huge = {"COMPILECAST_ENABLE": "1", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": str(1 << 40)}
    kept_out = _job(up.target, 2, ["global", "local"], "--plugin", env=huge)
    assert _total(kept_out, "global", "published") + _total(kept_out, "local", "published") == 0
    assert _total(kept_out, "global", "released") == 1, kept_out  # process 0's lease
    assert _total(kept_out, "global", "promotions") == 0, kept_out
    assert all(s["xla_compiles"] == 1 for s in _shape(kept_out, "global")), kept_out
    assert all(s["stats"]["waits"] == 0 for s in _shape(kept_out, "local")), kept_out


@pytest.mark.parametrize("failure, warned, profile_of_1", [
    ("publish", "the publish failed: RuntimeError", "profile-of-0"),
    # Without a key there is nothing to exchange under: the process compiles
    # with its own profile, as JAX does when its own key fails.
    ("key", "the cache key failed: TypeError", "profile-of-1"),
    ("profile", "the profile exchange failed: KeyError", "profile-of-0"),
])
def test_a_failure_of_compilecast_own_work_warns_and_the_job_completes(up, failure, warned,
                                                                        profile_of_1):
    """Process 1's own work breaks (an exception of a kind gRPC never
    raises): its programs compile locally, it warns, and every process
    computes what it would without compilecast; a broken profile exchange
    falls back to JAX's, which finds process 0's profile."""
    shapes = ["local", "global", "profile"]
    reports = _job(up.target, 2, shapes, only={1: ["--inject", failure]})
    assert any(warned in why for why in reports[1]["reasons"]), reports[1]["reasons"]
    assert "compilecast: " in reports[1]["stderr"] and warned in reports[1]["stderr"]
    assert not reports[0]["reasons"], reports[0]["reasons"]
    assert [r["shapes"]["profile"]["result"] for r in reports] == ["profile-of-0", profile_of_1]
    baseline = _job(up.target, 2, ["local", "global"], "--baseline")
    assert [{k: r["shapes"][k]["result"] for k in ("local", "global")} for r in reports] == \
        _results(baseline)


def test_cache_errors_raise_where_the_user_asked(up):
    """jax_raise_persistent_cache_errors: a failure of compilecast's own work
    reaches the user's jit instead of a warning."""
    code = ("import jax, jax.numpy as jnp\n"
            "jax.config.update('jax_raise_persistent_cache_errors', True)\n"
            "from compilecast.worker.jaxdoor import jax_integration\n"
            "from compilecast.worker.keylib import keys\n"
            "assert jax_integration.enable() is not None\n"
            "def broken(*a, **k):\n"
            "    raise TypeError('injected: the key broke')\n"
            "keys.jax_key = broken\n"
            "try:\n"
            "    jax.jit(lambda x: x * 3)(jnp.ones(4))\n"
            "except TypeError as exc:\n"
            "    print('raised', exc)\n")
    env = dict(os.environ, COMPILECAST_WORKER=up.target, JAX_PLATFORMS="cpu", **TEST_ENV)
    env.pop("COMPILECAST_ENABLE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "raised injected: the key broke" in out.stdout, out.stderr[-2000:]
