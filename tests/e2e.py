"""Helpers for end-to-end tests: `compilecast up` and real JAX processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from compilecast.worker.client import wait_until_healthy

from .conftest import free_port

LAYERS, WIDTH = 48, 256


class Up:
    """`compilecast up` as a real subprocess on free ports."""

    def __init__(self, home: Path, env: dict | None = None) -> None:
        self.home = home
        self.env = dict(os.environ, **(env or {}))
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
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
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




def start_procs(n: int, target: str, *, extra_env: dict | None = None,
                no_compilecast: bool = False, per_process: list[dict] | None = None,
                args: list[list[str]] | None = None, layers: int = LAYERS,
                width: int = WIDTH) -> list[subprocess.Popen]:
    """Start n JAX processes that all begin compiling at the same moment."""
    env = dict(os.environ, COMPILECAST_WORKER=target, JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(extra_env or {})
    env.pop("COMPILECAST_ENABLE", None)
    start_at = time.time() + 5.0  # all processes start compiling at this moment
    cmd = [sys.executable, "-m", "compilecast.demo_proc", str(layers), str(width),
           "--start-at", str(start_at)]
    if no_compilecast:
        cmd.append("--no-compilecast")
    procs = []
    for k in range(n):
        penv = dict(env, **((per_process or [{}] * n)[k]))
        extra = (args or [[]] * n)[k]
        procs.append(subprocess.Popen(cmd + extra, env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        report["stderr"] = err
        reports.append(report)
    return reports


def run_procs(n: int, target: str, **kw) -> list[dict]:
    return collect(start_procs(n, target, **kw))
