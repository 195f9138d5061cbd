"""The command line: readable errors, status exit codes."""

from __future__ import annotations

import subprocess
import sys


def cc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compilecast.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_status_is_nonzero_when_nothing_runs(tmp_path):
    r = cc("status", "--worker", f"unix://{tmp_path}/none.sock", "--timeout", "1")
    assert r.returncode != 0
    assert "unreachable" in r.stdout


def test_status_is_zero_against_a_healthy_worker(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    r = cc("status", "--worker", worker.target)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "healthy" in r.stdout and "artifacts" in r.stdout


def test_status_is_nonzero_when_the_coordinator_is_down(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    coordinator.stop()
    r = cc("status", "--worker", worker.target, "--timeout", "2")
    assert r.returncode == 1
    assert "UNREACHABLE" in r.stdout


def test_bad_configuration_is_a_readable_error():
    r = cc("config", "coordinator", "--lease-ttl-s", "never")
    assert r.returncode == 2
    assert "configuration error" in r.stderr and "lease_ttl_s" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_prints_values_and_sources():
    r = cc("config", "worker", "--rpc-timeout-s", "9")
    assert r.returncode == 0
    assert "rpc_timeout_s = 9.0    # flag --rpc-timeout-s" in r.stdout
