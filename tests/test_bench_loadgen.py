"""bench/loadgen, the Go load generator of bench/decisions.py, encodes and
decodes the Decide messages by hand (protowire, no generated code): run it
against a real coordinator and check every answer it counted against the
coordinator's own counters."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compilecast.worker.inprocess.client import CacheClient

from .conftest import publish

LOADGEN = Path(__file__).resolve().parent.parent / "bench" / "loadgen"


def test_the_go_load_generator_speaks_decide(coordinator, tmp_path):
    if shutil.which("go") is None:
        pytest.fail("Go is not installed (.ci/run builds helm with it)")
    binary = tmp_path / "loadgen"
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=LOADGEN, check=True, timeout=600)
    c = CacheClient(coordinator.cfg.listen)
    try:
        keys = [f"hit-{i}" for i in range(3)]
        for k in keys:
            publish(c, k, k.encode() * 100)
    finally:
        c.close()
    reg = coordinator.registry

    def count(result: str) -> float:
        return reg.get_sample_value("compilecast_coordinator_lookups_total",
                                    {"result": result}) or 0.0

    hits_before, misses_before = count("hit"), count("miss")
    done = subprocess.run(
        [str(binary), "-target", coordinator.cfg.listen, "-streams", "2", "-channels", "1",
         "-rate", "400", "-seconds", "1", "-hit-ratio", "0.5", "-hit-keys", ",".join(keys)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    by = row["by_decision"]
    assert row["errors"] == 0 and set(by) == {"HIT", "COMPILE"}
    assert row["requests"] == by["HIT"] + by["COMPILE"] > 100
    assert row["stream_messages"] <= row["requests"]
    # Each stream's warm-up request is a hit the row does not count.
    assert count("hit") - hits_before == by["HIT"] + 2
    assert count("miss") - misses_before == by["COMPILE"]

    # With key components, as the JAX integration sends them: valid, and recorded.
    done = subprocess.run(
        [str(binary), "-target", coordinator.cfg.listen, "-streams", "2", "-channels", "1",
         "-rate", "200", "-seconds", "0.5", "-hit-ratio", "0", "-hit-keys", keys[0],
         "-components", "11"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["errors"] == 0 and row["by_decision"]["COMPILE"] > 20

    def explained() -> float:
        return sum(s.value for m in reg.collect()
                   if m.name == "compilecast_coordinator_misses_by_component"
                   for s in m.samples if s.name.endswith("_total"))

    deadline = time.monotonic() + 10
    while explained() < row["by_decision"]["COMPILE"] and time.monotonic() < deadline:
        time.sleep(0.05)  # recorded in the background
    # Every miss counted by at least one component (new_program, program, ...).
    assert explained() >= row["by_decision"]["COMPILE"]


def test_the_go_load_generator_settles_bundled_answers():
    """bench/loadgen's own unit test (go test): a bundle of whole, partial
    and nested answers settles every request of every message it answers."""
    if shutil.which("go") is None:
        pytest.fail("Go is not installed (.ci/run builds helm with it)")
    done = subprocess.run(["go", "test", "./..."], cwd=LOADGEN, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout


def test_the_go_leaves_hold_every_hit_under_the_worker_s_relays():
    """bench/pod_cold.py's hosts at the leaves of the tree (bench/loadgen/leaves,
    WatchJob by hand) under relays that are the worker's own JobStreams, with
    a real coordinator and etcd: every host holds every program's HIT (the
    bench fails a host that does not), the replica serves its fanout, and the
    Go decoder's own tests pass."""
    if shutil.which("go") is None:
        pytest.fail("Go is not installed (.ci/run builds helm with it)")
    bench = LOADGEN.parent / "pod_cold.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--hosts", "60", "--per-key-hosts", "3",
         "--per-key-programs", "2", "--programs", "12", "--compile-ms", "20", "--fanout", "4"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.splitlines()[-1])["stream"][0]
    assert row["hosts"] == 60 and row["relays"] == 20 and row["leaves"] == 40
    assert row["streams_per_job"] == 4  # the replica's fanout, the rest down the tree
    assert row["most_children"] <= 4
    assert row["refused_publishes"] == 0
    assert row["leaves_reopened"] == 0
    tested = subprocess.run(["go", "test", "./leaves"], cwd=LOADGEN, capture_output=True,
                            text=True, timeout=600)
    assert tested.returncode == 0, tested.stdout + tested.stderr
