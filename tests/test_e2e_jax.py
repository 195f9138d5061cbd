"""End to end: `compilecast up` and real JAX processes compiling a training step."""

from __future__ import annotations

import pytest

from .conftest import eventually
from .e2e import LAYERS, run_procs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_digest() -> str:
    (ref,) = run_procs(1, "unix:///nonexistent", no_compilecast=True)
    return ref["digest"]


def test_four_processes_compile_once_then_a_second_wave_hits(up, reference_digest):
    wave1 = run_procs(4, up.target)
    assert sum(r["xla_compiles"] for r in wave1) == 1, wave1
    assert all(r["digest"] == reference_digest for r in wave1)
    holders = [r for r in wave1 if r["compilecast"]["published"] == 1]
    loaders = [r for r in wave1 if r["compilecast"]["hits"] == 1]
    assert len(holders) == 1 and len(loaders) == 3
    # A loader asks while the holder compiles (one wait), unless it was still
    # importing JAX at the common start and came after the publish: a plain hit.
    assert all(r["compilecast"]["waits"] == 1 or r["late_s"] > 0 for r in loaders), \
        [(r["late_s"], r["compilecast"]) for r in loaders]

    wave2 = run_procs(4, up.target)
    assert sum(r["xla_compiles"] for r in wave2) == 0, wave2
    assert all(r["compilecast"]["hits"] == 1 for r in wave2)
    assert all(r["digest"] == reference_digest for r in wave2)

    metrics = __import__("urllib.request").request.urlopen(
        f"http://127.0.0.1:{up.ports['coordinator-metrics-port']}/metrics").read().decode()
    assert 'compilecast_coordinator_compiles_total{how="first"} 1.0' in metrics
    worker_metrics = __import__("urllib.request").request.urlopen(
        f"http://127.0.0.1:{up.ports['worker-metrics-port']}/metrics").read().decode()
    # Every process reported how long its canonical key took.
    assert "compilecast_worker_key_seconds_count 8.0" in worker_metrics


def test_processes_on_the_coordinators_address_wait_over_its_data_plane(up):
    """No worker: JAX processes that ask the coordinator itself wait on its
    data plane. A wait ends there with the executable after it (hit_sent), or
    with the WAIT of a publish that started (answered), after which the
    process fetches the bytes as they are uploaded."""
    import re
    import urllib.request

    def ended_on_the_data_plane() -> float:
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{up.ports['coordinator-metrics-port']}/metrics").read().decode()
        found = re.findall(r'^compilecast_coordinator_data_plane_waits_total'
                           r'\{result="(?:hit_sent|answered)"\} (\S+)$', metrics, re.M)
        return sum(float(n) for n in found)

    before = ended_on_the_data_plane()
    (ref,) = run_procs(1, "unix:///nonexistent", no_compilecast=True, layers=LAYERS - 1)
    reports = run_procs(3, f"127.0.0.1:{up.ports['coordinator-port']}", layers=LAYERS - 1)
    assert sum(r["xla_compiles"] for r in reports) == 1, reports
    assert all(r["digest"] == ref["digest"] for r in reports)
    loaders = [r for r in reports if r["compilecast"]["hits"] == 1]
    waited = sum(r["compilecast"]["waits"] for r in loaders)
    assert len(loaders) == 2 and waited >= 1, [r["compilecast"] for r in reports]
    # Counted once sent, maybe after the process read it.
    eventually(lambda: ended_on_the_data_plane() - before >= waited, "the waits counted")
    assert ended_on_the_data_plane() - before == waited


def test_restart_with_the_same_data_directory_loses_nothing(up, reference_digest):
    (first,) = run_procs(1, up.target)
    assert first["compilecast"]["published"] == 1
    assert up.stop() == 0
    assert up.leftover_processes() == []
    # A cold host cache too: only the coordinator's store and etcd remain.
    import shutil

    shutil.rmtree(up.home / "worker")
    up.start()
    (again,) = run_procs(1, up.target)
    assert again["xla_compiles"] == 0 and again["compilecast"]["hits"] == 1
    assert again["digest"] == reference_digest


def test_below_threshold_everyone_compiles_locally_without_waiting(up):
    reports = run_procs(3, up.target,
                        extra_env={"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1000"})
    assert sum(r["xla_compiles"] for r in reports) == 3
    assert all(r["compilecast"]["published"] == 0 for r in reports)
    # The waiters were told why, and that nothing is wrong: no warning.
    told = [reason for r in reports for reason in r["compilecast"]["reasons"]]
    assert any("below the caching thresholds" in reason for reason in told), reports
    # Released at once: no waiter sat out the share-binary timeout (said by
    # what it was told, not by a wall-clock bound, which a loaded machine broke).
    assert not any("share-binary timeout" in reason for reason in told), told
    assert not any("locally" in r["stderr"] for r in reports), [r["stderr"] for r in reports]


def test_an_executable_the_coordinator_refuses_releases_every_waiter_at_once(start_up):
    """An executable over the coordinator's max_artifact_bytes: its holder
    says it is not shared, and the waiters compile at once, none promoted to
    compile and be refused in turn."""
    up = start_up(env={"COMPILECAST_MAX_ARTIFACT_BYTES": "10000"})
    reports = run_procs(3, up.target)
    assert sum(r["xla_compiles"] for r in reports) == 3
    stats = [r["compilecast"] for r in reports]
    assert [s["published"] for s in stats] == [0, 0, 0]
    assert sum(s["compiles"] for s in stats) == 1, stats  # one lease, never handed on
    assert sum(s["promotions"] for s in stats) == 0, stats
    holder = next(r for r in reports if r["compilecast"]["compiles"] == 1)
    assert "not sharing the executable of" in holder["stderr"], holder["stderr"]
    assert "exceeds the limit of 10000" in holder["stderr"]
    told = [reason for s in stats if not s["compiles"] for reason in s["reasons"]]
    assert len(told) == 2 and all("refused the holder's executable" in t for t in told), told


def test_unreachable_worker_compiles_locally_with_a_warning(tmp_path, reference_digest):
    (r,) = run_procs(1, f"unix://{tmp_path}/no-such.sock")
    assert r["xla_compiles"] == 1
    assert r["digest"] == reference_digest
    assert "unreachable" in r["stderr"] and "compiling" in r["stderr"]


def test_up_starts_its_etcd_again_when_it_dies(up):
    """SIGKILL of `up`'s etcd: meanwhile decisions say "compile locally"
    (never hang); then `up` starts etcd again on the same data, and what was
    published before is still a hit."""
    import os
    import signal
    import time

    from compilecast.v1 import cache_pb2 as pb
    from compilecast.worker.inprocess.client import CacheClient

    c = CacheClient(up.target)
    before = "cc1-" + "a" * 64
    c.publish(before, c.acquire(before).lease, b"executable", 1.0)
    (etcd,) = [int(line.split()[0]) for line in up.leftover_processes()]
    os.kill(etcd, signal.SIGKILL)

    deadline = time.monotonic() + 60
    answers, reasons = [], set()
    while time.monotonic() < deadline:
        answer = c.acquire("cc1-" + "b" * 64)
        answers.append(answer.decision)
        reasons.add(answer.reason)
        if answer.decision == pb.COMPILE:
            break
        assert answer.decision == pb.COMPILE_LOCALLY, answer
        time.sleep(0.2)
    assert answers[-1] == pb.COMPILE, answers
    assert pb.COMPILE_LOCALLY in answers  # etcd really was down for a while
    # Said in a few words, not gRPC's chain of resolver errors.
    assert "coordinator: etcd unreachable: connection refused" in reasons, reasons
    (again,) = [int(line.split()[0]) for line in up.leftover_processes()]
    assert again != etcd
    assert "etcd exited with -9" in up.log_path.read_text()
    assert c.fetch(before)[1] == b"executable"


def test_a_sigkill_of_up_leaves_no_etcd_behind(up):
    import signal
    import time

    assert len(up.leftover_processes()) == 1  # its etcd, found by its data directory
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait(10)
    up.proc = None
    deadline = time.monotonic() + 20
    while up.leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert up.leftover_processes() == []
