"""End to end: `compilecast up` and real JAX processes compiling a training step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compilecast.worker.client import wait_until_healthy

from .conftest import free_port

pytestmark = pytest.mark.slow

LAYERS, WIDTH = 48, 256


class Up:
    """`compilecast up` as a real subprocess on free ports."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.ports = {name: free_port() for name in
                      ("etcd-port", "etcd-peer-port", "coordinator-port",
                       "coordinator-metrics-port", "worker-metrics-port")}
        self.target = f"unix://{home / 'worker.sock'}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [sys.executable, "-m", "compilecast.cli", "up", "--home", str(self.home)]
        for name, port in self.ports.items():
            args += [f"--{name}", str(port)]
        self.log = open(self.home.parent / f"{self.home.name}-up.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_healthy(self.target, timeout_s=30)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        self.log.close()
        self.proc = None
        return rc

    def children_left(self) -> list[str]:
        out = subprocess.run(["pgrep", "-af", f"--data-dir {self.home / 'etcd'}"],
                             capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.fixture
def up(tmp_path):
    home = tmp_path / "cc"
    home.mkdir()
    u = Up(home)
    u.start()
    yield u
    if u.proc is not None:
        u.stop()


def run_procs(n: int, target: str, *, extra_env: dict | None = None,
              no_compilecast: bool = False) -> list[dict]:
    env = dict(os.environ, COMPILECAST_WORKER=target, JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(extra_env or {})
    env.pop("COMPILECAST_ENABLE", None)
    start_at = time.time() + 5.0  # all processes start compiling at this moment
    cmd = [sys.executable, "-m", "compilecast.demo_proc", str(LAYERS), str(WIDTH),
           "--start-at", str(start_at)]
    if no_compilecast:
        cmd.append("--no-compilecast")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(n)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        report["stderr"] = err
        reports.append(report)
    return reports


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
    assert all(r["compilecast"]["waits"] == 1 for r in loaders)

    wave2 = run_procs(4, up.target)
    assert sum(r["xla_compiles"] for r in wave2) == 0, wave2
    assert all(r["compilecast"]["hits"] == 1 for r in wave2)
    assert all(r["digest"] == reference_digest for r in wave2)

    metrics = __import__("urllib.request").request.urlopen(
        f"http://127.0.0.1:{up.ports['coordinator-metrics-port']}/metrics").read().decode()
    assert 'compilecast_coordinator_compiles_total{how="first"} 1.0' in metrics


def test_restart_with_the_same_data_directory_loses_nothing(up, reference_digest):
    (first,) = run_procs(1, up.target)
    assert first["compilecast"]["published"] == 1
    assert up.stop() == 0
    assert up.children_left() == []
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
    # Released at once: no waiter sat out the share-binary timeout.
    assert all(r["seconds"] < 60 for r in reports)


def test_unreachable_worker_compiles_locally_with_a_warning(tmp_path, reference_digest):
    (r,) = run_procs(1, f"unix://{tmp_path}/no-such.sock")
    assert r["xla_compiles"] == 1
    assert r["digest"] == reference_digest
    assert "unreachable" in r["stderr"] and "compiling" in r["stderr"]
