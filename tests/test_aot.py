"""Ahead-of-time compiles with real TPU programs (libtpu's compile-only
client), a real etcd, coordinator and farm workers: a pod's first step hits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compilecast.launch import collect, free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

pytestmark = pytest.mark.slow

ENTRY = "compilecast.demo.step:aot_programs"
ROOT = Path(__file__).resolve().parent.parent
# Compile-only TPU clients; JAX itself runs on the CPU.
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
       "TPU_WORKER_HOSTNAMES": "localhost"}


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                           *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def coordinator_of(up) -> str:
    return f"127.0.0.1:{up.ports['coordinator-port']}"


def published_keys(out: str) -> dict[str, str]:
    """`precompile` prints STATUS KEY NAME SECONDS SIZE per program."""
    rows = [line.split() for line in out.splitlines() if line.startswith(("published", "cached"))]
    return {r[2]: r[1] for r in rows}


def simulated_pod(coordinator: str, topology: str, n: int) -> list[dict]:
    """n processes of one jax.distributed job, each computing its keys as the
    target's processes do and fetching + verifying every artifact."""
    dist = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "pod_probe.py"), coordinator,
                               ENTRY, topology, str(i), str(n), dist], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    return collect(procs, timeout_s=240)


def test_precompiled_programs_are_all_hits_for_every_process_of_a_pod(up):
    coord = coordinator_of(up)
    missing = cli("precompile", "--entry", ENTRY, "--topology", "v5e:2x2", "--check",
                  "--coordinator", coord)
    assert missing.returncode == 1 and missing.stdout.count("MISSING") == 2, missing

    done = cli("precompile", "--entry", ENTRY, "--topology", "v5e:2x2", "--job", "train-a",
               "--coordinator", coord)
    assert done.returncode == 0, done.stderr[-3000:]
    published = published_keys(done.stdout)
    assert set(published) == {"train_step", "evaluate"}, done.stdout

    pod = simulated_pod(coord, "v5e:2x2", 4)
    assert sorted(r["process_index"] for r in pod) == [0, 1, 2, 3]
    for r in pod:  # every process: the farm's keys, every artifact present and verified
        assert r["keys"] == published, (r, published)
        assert all(r["present"].values()), r

    # Compiling again finds everything cached: nothing is compiled twice.
    again = cli("precompile", "--entry", ENTRY, "--topology", "v5e:2x2", "--coordinator", coord)
    assert again.returncode == 0 and again.stdout.count("cached") == 2, again.stdout
    st = CacheClient(coord).status()
    assert st.artifacts == 2


def test_keys_agree_across_the_processes_of_a_multi_host_topology(up):
    """v5e:4x4 is four hosts: four processes of one job, standing in for them."""
    coord = coordinator_of(up)
    done = cli("precompile", "--entry", ENTRY, "--topology", "v5e:4x4", "--coordinator", coord)
    assert done.returncode == 0, done.stderr[-3000:]
    pod = simulated_pod(coord, "v5e:4x4", 4)
    assert {json.dumps(r["keys"], sort_keys=True) for r in pod} == \
        {json.dumps(published_keys(done.stdout), sort_keys=True)}
    assert all(all(r["present"].values()) for r in pod)


def test_the_farm_compiles_the_queue_and_replays_a_job_onto_another_topology(up):
    coord = coordinator_of(up)
    farm = subprocess.Popen([sys.executable, "-m", "compilecast.cli", "farm", "--coordinator",
                             coord, "--concurrency", "2", "--name", "farm-1"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        queued = cli("precompile", "--entry", ENTRY, "--topology", "v5e:2x2", "--job", "train-b",
                     "--farm", "--wait", "--timeout", "200", "--coordinator", coord)
        assert queued.returncode == 0, queued.stdout + queued.stderr[-3000:]
        assert queued.stdout.count("DONE") == 2 and "published" in queued.stdout, queued.stdout

        # Replay everything recorded for the job onto a bigger slice.
        replay = cli("precompile", "--replay", "train-b", "--topology", "v5e:2x4", "--farm",
                     "--wait", "--timeout", "200", "--coordinator", coord)
        assert replay.returncode == 0, replay.stdout + replay.stderr[-3000:]
        pod = simulated_pod(coord, "v5e:2x4", 2)
        assert all(all(r["present"].values()) for r in pod), pod

        tasks = CacheClient(coord).tasks()
        assert len(tasks) == 4 and {t.state for t in tasks} == {pb.DONE}
        assert {t.worker for t in tasks} == {"farm-1"}
        st = CacheClient(coord).status()
        assert (st.tasks_done, st.tasks_failed, st.tasks_queued, st.artifacts) == (4, 0, 0, 4)
    finally:
        farm.send_signal(signal.SIGTERM)
        out, _ = farm.communicate(timeout=60)
    assert farm.returncode == 0, out[-3000:]


def test_a_recorded_program_replays_to_the_same_key_and_refuses_another_slice(start_up):
    """Recipes without an entry point: the lowered program and its compile
    inputs, recompiled on a fresh coordinator, give the key the job computed."""
    first, second = start_up(name="first"), start_up(name="second")
    done = cli("precompile", "--entry", ENTRY, "--topology", "v5e:2x2", "--job", "train-c",
               "--coordinator", coordinator_of(first))
    assert done.returncode == 0, done.stderr[-3000:]
    recipes = CacheClient(coordinator_of(first)).list_recipes("train-c")
    assert sorted(r.key for r in recipes) == sorted(published_keys(done.stdout).values())
    for r in recipes:
        r.ClearField("entry")
        assert r.program and r.compile_options and r.target.libtpu_version
    other = []
    for r in recipes:
        o = pb.Recipe()
        o.CopyFrom(r)
        o.target.topology = "v5e:2x4"
        other.append(o)
    target = CacheClient(coordinator_of(second))
    ids = target.submit(recipes + other)
    farm = cli("farm", "--coordinator", coordinator_of(second), "--max-tasks", "4",
               "--concurrency", "1")
    assert farm.returncode == 0, farm.stderr[-3000:]
    by_id = {t.task_id: t for t in target.tasks(ids)}
    same = [by_id[i] for i in ids[:2]]
    moved = [by_id[i] for i in ids[2:]]
    assert [t.state for t in same] == [pb.DONE, pb.DONE], same
    assert sorted(t.key for t in same) == sorted(r.key for r in recipes)
    assert [t.state for t in moved] == [pb.FAILED, pb.FAILED], moved
    assert all("cannot be retargeted" in t.detail for t in moved), moved


def test_pod_key_check_script_agrees_with_itself_and_names_what_differs():
    script = [sys.executable, str(ROOT / "scripts" / "pod_key_check.py"), "--entry", ENTRY,
              "--topology", "v5e:2x2", "--json"]
    same = subprocess.run([*script, "--against", "v5e:2x2"], env=ENV, capture_output=True,
                          text=True, timeout=240)
    assert same.returncode == 0, same.stderr[-3000:]
    assert all(p["agree"] for p in json.loads(same.stdout)["programs"])
    differ = subprocess.run([*script, "--against", "v5e:2x4"], env=ENV, capture_output=True,
                            text=True, timeout=240)
    assert differ.returncode == 1, differ.stderr[-3000:]
    programs = json.loads(differ.stdout)["programs"]
    assert not any(p["agree"] for p in programs)
    assert all(any("topology" in d for d in p["differences"]) for p in programs)


def test_precompile_explains_a_bad_entry_point(up):
    bad = cli("precompile", "--entry", "no_such_module:f", "--topology", "v5e:2x2",
              "--coordinator", coordinator_of(up))
    assert bad.returncode == 2 and "cannot load entry point" in bad.stderr, bad.stderr
    topo = cli("precompile", "--entry", ENTRY, "--topology", "v99:1x1",
               "--coordinator", coordinator_of(up))
    assert topo.returncode == 2 and "no TPU family v99" in topo.stderr, topo.stderr




def test_a_farm_worker_killed_mid_compile_loses_nothing(start_up):
    """The claim lapses, another farm worker takes the task, and its publish
    is the one: the dead worker's compile lease lapsed too."""
    up = start_up({"COMPILECAST_LEASE_TTL_S": "3"})
    coord = coordinator_of(up)
    slow = {**ENV, "COMPILECAST_EXAMPLE_LAYERS": "48", "COMPILECAST_EXAMPLE_WIDTH": "1024"}

    def farm(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "compilecast.cli", "farm",
                                 "--coordinator", coord, "--concurrency", "1", "--name", name],
                                env=slow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    client = CacheClient(coord)
    recipe = pb.Recipe(entry=ENTRY, entry_index=0, target=pb.Target(platform="tpu",
                                                                    topology="v5e:2x2"))
    [task] = client.submit([recipe])
    doomed = farm("doomed")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # running, and holding the compile lease
        st = client.status()
        if st.tasks_running == 1 and st.compiles_in_flight == 1:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the farm never started compiling")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    rescuer = farm("rescuer")
    try:
        while time.monotonic() < deadline + 120:
            [t] = client.tasks([task])
            if t.state in (pb.DONE, pb.FAILED):
                break
            time.sleep(0.5)
        assert (t.state, t.worker) == (pb.DONE, "rescuer"), t
        assert t.detail.startswith("published"), t
        assert client.describe(t.key).artifact.digest
        st = client.status()
        assert (st.tasks_done, st.tasks_running, st.tasks_queued, st.artifacts) == (1, 0, 0, 1)
    finally:
        rescuer.terminate()
        rescuer.wait(60)


def test_a_moved_pallas_kernel_is_a_hit_and_a_changed_one_compiles(up):
    # Real Pallas TPU kernels, compiled by libtpu's compile-only client: the
    # kernel's bytecode names its file and line, which must not change the key.
    coord = coordinator_of(up)
    entry = ["precompile", "--entry", "tests.pallas_entry:programs", "--topology", "v5e:2x2",
             "--coordinator", coord]

    def precompile(**env):
        r = subprocess.run([sys.executable, "-m", "compilecast.cli", "--log-level", "warning",
                            *entry], env={**ENV, **env}, capture_output=True, text=True,
                           timeout=240, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    first = precompile(PALLAS_KERNEL_LINE="0")
    assert first.count("published") == 1, first
    moved = precompile(PALLAS_KERNEL_LINE="40")
    assert moved.count("cached") == 1, moved
    assert published_keys(first)["scaled"] == published_keys(moved)["scaled"]
    changed = precompile(PALLAS_KERNEL_LINE="40", PALLAS_KERNEL_SCALE="3.0")
    assert changed.count("published") == 1, changed
    assert CacheClient(coord).status().artifacts == 2


@pytest.mark.parametrize("min_compile_time, serialized", [(0.0, 0), (1e9, 1)])
def test_an_ahead_of_time_entry_is_serialized_once(min_compile_time, serialized):
    """The entry JAX writes while compiling is the one published; only when
    JAX writes none (a compile under its time threshold) does compilecast
    serialize the executable itself (a 187 MB TPU executable: ~0.8 s)."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_entry_proc.py"),
                          str(min_compile_time)], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["key"].startswith("cc")
    assert got["serialized_by_compilecast"] == serialized
    assert got["executable_bytes"] > 1000  # a real executable in JAX's entry format


@pytest.mark.parametrize("other", [False, True])
def test_a_holder_whose_lease_lapsed_while_compiling_asks_again(start_up, other):
    """A holder that missed its renewals (a host starved of CPU) finds its
    lease gone at publish: it takes the key again and publishes, or finds
    that another process published it meanwhile. It never throws its
    executable away or fails the program."""
    u = start_up({"COMPILECAST_LEASE_TTL_S": "2"})
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_lapse_proc.py"),
                          coordinator_of(u), "2", *(["other"] if other else [])],
                         env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "asking for" in out.stderr  # the lapse was seen, not missed
    if other:
        assert got["status"] == "published-by-another"
        assert got["published"] != got["compiled"]  # the rival's bytes stand
    else:
        assert got["status"] == "published"
        assert got["published"] == got["compiled"]
