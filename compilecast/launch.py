"""Launching the pieces as real processes: `compilecast up` on free ports and
waves of JAX processes that start the same step at the same moment. Shared by
`make demo`, the benchmarks and the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from compilecast.errors import CompilecastError
from compilecast.worker.inprocess.client import wait_until_healthy

UP_PORTS = ("etcd-port", "etcd-peer-port", "coordinator-port", "coordinator-metrics-port",
            "worker-metrics-port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """`compilecast up --home HOME` as a subprocess on free ports."""

    def __init__(self, home: Path, env: dict | None = None, *, no_tcp: bool = False) -> None:
        self.home = home
        self.env = dict(os.environ, **(env or {}))
        self.no_tcp = no_tcp  # `up --no-tcp`: unix sockets only, no ports
        self.ports = {} if no_tcp else {name: free_port() for name in UP_PORTS}
        self.target = f"unix://{home / 'worker.sock'}"
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.home.parent / f"{self.home.name}-up.log"

    def start(self, timeout_s: float = 60, attempts: int = 3) -> None:
        """Start it and wait until its worker answers. The ports were free
        when they were picked, but another process can take one before `up`
        binds it: then `up` exits saying so, and it starts again on fresh
        ports (at most `attempts` times). Raises RuntimeError with the end of
        its log when it exits otherwise or is not healthy within timeout_s."""
        for attempt in range(attempts):
            args = [sys.executable, "-m", "compilecast.cli", "up", "--home", str(self.home),
                    *(["--no-tcp"] if self.no_tcp else [])]
            for name, port in self.ports.items():
                args += [f"--{name}", str(port)]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None:
                try:
                    wait_until_healthy(self.target, timeout_s=1.0)
                    return
                except CompilecastError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"compilecast up was not healthy within "
                                           f"{timeout_s:.0f} s:\n{self._log_tail()}") from None
            rc, self.proc = self.proc.returncode, None
            tail = self._log_tail()
            if attempt + 1 < attempts and not self.no_tcp and (
                    "already in use" in tail or "is taken" in tail):
                self.ports = {name: free_port() for name in UP_PORTS}
                continue
            raise RuntimeError(f"compilecast up exited with status {rc}:\n{tail}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        return rc

    def leftover_processes(self) -> list[str]:
        """Processes still running on this home's etcd data (none after stop)."""
        # (`--` first: the pattern itself starts with dashes.)
        r = subprocess.run(["pgrep", "-af", "--", f"--data-dir {self.home / 'etcd'}"],
                           capture_output=True, text=True)
        if r.returncode not in (0, 1):  # 1: none matched
            raise RuntimeError(f"pgrep failed ({r.returncode}): {r.stderr.strip()}")
        return [line for line in r.stdout.splitlines() if "pgrep" not in line]


def time_calls(obj, phases: dict[str, float], t0: float,
               names: tuple[str, ...] = ("publish", "fetch", "wait_and_fetch")) -> None:
    """Record in `phases` when each of `obj`'s calls `names` (a client's
    methods, a module's functions) began and ended, in seconds from the wall
    clock time T0 (the last call of each kind), and the process's CPU seconds
    meanwhile: where a benchmarked process's time went
    (bench/time_to_executable.py prints it as a timeline)."""
    for name in names:
        call = getattr(obj, name)

        def timed(*args, _call=call, _name=name, **kwargs):
            phases[f"{_name} began"] = time.time() - t0
            cpu = time.process_time()
            try:
                return _call(*args, **kwargs)
            finally:
                phases[f"{_name} ended"] = time.time() - t0
                phases[f"{_name} cpu"] = time.process_time() - cpu  # the process's, all threads

        setattr(obj, name, timed)


# The demo's and the benches' steps compile in about a second on a quiet CPU,
# which is JAX's default min compile time: below it JAX (and compilecast, which
# honours it) keeps nothing. Their processes share whatever the machine's speed.
SHARE_ANY_COMPILE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def start_wave(n: int, target: str, layers: int, width: int, *, baseline: bool = False,
               distributed: bool = False, env: dict | None = None,
               per_process: list[dict] | None = None, delay_s: float = 6.0,
               phases: bool = False) -> list[subprocess.Popen]:
    """Start n JAX processes (compilecast.demo.proc) that all begin the
    training step at the same moment, `delay_s` from now (with `phases`, each
    reports when its compilecast calls began and ended)."""
    # CPU unless the caller's environment names JAX's platforms (a GPU host's benches).
    base_env = dict(os.environ, COMPILECAST_WORKER=target,
                    JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS") or "cpu", **(env or {}))
    base_env.pop("COMPILECAST_ENABLE", None)
    cmd = [sys.executable, "-m", "compilecast.demo.proc", str(layers), str(width),
           "--start-at", str(time.time() + delay_s)]
    if baseline:
        cmd.append("--no-compilecast")
    elif phases:
        cmd.append("--phases")
    addr = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(n):
        extra = ["--distributed", f"{addr},{n},{i}"] if distributed else []
        penv = dict(base_env, **(per_process[i] if per_process else {}))
        procs.append(subprocess.Popen(cmd + extra, env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen], timeout_s: float = 900) -> list[dict]:
    """Each process's JSON report (its last stdout line) plus its stderr."""
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"a JAX process failed (rc {p.returncode}):\n{err[-3000:]}")
        report = json.loads(out.strip().splitlines()[-1])
        report["stderr"] = err
        reports.append(report)
    return reports


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def sockets_held(pid: int) -> dict[int, dict[str, int]]:
    """For `pid` and each of its descendants: how many sockets it holds, and
    how many of them are TCP or UDP (IPv4 or IPv6) in this network namespace,
    and how many unix sockets. What `compilecast up --no-tcp` is checked by."""
    def table(*names: str) -> set[str]:
        found: set[str] = set()
        for name in names:
            try:
                with open(f"/proc/net/{name}") as f:
                    next(f)
                    column = 6 if name == "unix" else 9
                    found |= {line.split()[column] for line in f if len(line.split()) > column}
            except OSError:
                pass
        return found

    inet, unix = table("tcp", "tcp6", "udp", "udp6"), table("unix")
    held = {}
    for p in process_tree(pid):
        inodes = set()
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
        held[p] = {"sockets": len(inodes), "inet": len(inodes & inet), "unix": len(inodes & unix)}
    return held
