"""`compilecast up`: the embedded single-machine default.

Starts a local etcd (Debian's etcd-server binary; data under the user's cache
directory), a coordinator and a worker in this process, prints where each
listens, and stops all of them on Ctrl-C or SIGTERM. etcd runs as a child
with PR_SET_PDEATHSIG, so even a SIGKILL of `up` leaves no process behind,
and is started again whenever it exits (LocalEtcd).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compilecast.config import CoordinatorConfig, WorkerConfig, default_home, load

log = logging.getLogger(__name__)


class UpError(RuntimeError):
    """`up` cannot start; the message says what to do."""


# etcd's sockets under --no-tcp: etcd takes a unix URL's host:port as the
# socket's path, relative to its working directory (the home's sock/).
ETCD_CLIENT_SOCK, ETCD_PEER_SOCK = "etcd-client.sock:0", "etcd-peer.sock:0"


@dataclass
class UpConfig:
    home: Path
    etcd_port: int = 7679
    etcd_peer_port: int = 7680
    coordinator_port: int = 7640
    coordinator_metrics_port: int = 7641
    worker_metrics_port: int = 7642
    # etcd keeps every revision until compacted; claims and waits write many.
    # Periodic compaction keeps this much history (as the chart's etcd does).
    etcd_compaction_retention: str = "1h"
    # Every endpoint on a unix socket under home/sock (mode 0700): etcd's
    # client and peer URLs, the coordinator and the worker; the data plane
    # and metrics off. Nothing listens on the network (a TPU VM's default).
    no_tcp: bool = False
    otlp_endpoint: str = ""  # an OpenTelemetry collector both roles trace to ("": the env's)
    job: str = ""  # the host's job: its manifest is prefetched at start ("": the env's)

    @property
    def sockets(self) -> Path:
        return self.home / "sock"

    def etcd_client_url(self) -> str:
        """etcd's client URL: a socket named relative to etcd's working
        directory (etcd takes a unix URL's host as the socket's path)."""
        return f"unix://{ETCD_CLIENT_SOCK}" if self.no_tcp else f"http://127.0.0.1:{self.etcd_port}"

    def etcd_endpoint(self) -> str:
        """The same, as a gRPC client dials it."""
        return (f"unix://{self.sockets / ETCD_CLIENT_SOCK}" if self.no_tcp
                else f"127.0.0.1:{self.etcd_port}")


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise UpError("etcd is not installed: run `make install` "
                      "(or `apt-get install etcd-server`)")
    return path


def _pdeathsig() -> None:
    if _PRCTL is not None:  # (without prctl: no death signal)
        with contextlib.suppress(Exception):
            _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_PRCTL: Any = None
with contextlib.suppress(OSError, AttributeError):  # resolved here, not in the forked
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # child (no dlopen after a fork)


def _with_death_signal(cmd: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`cmd` run so that the child gets SIGTERM when `up` dies, even by
    SIGKILL: through util-linux's setpriv where there is one, so the child is
    spawned without a fork of this process (gRPC's threads run here once `up`
    serves), else with prctl between fork and exec."""
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *cmd], None
    return cmd, _pdeathsig


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _socket_open(path: Path) -> bool:
    """Whether a process accepts on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        return s.connect_ex(str(path)) == 0


def _etcd_serving(cfg: UpConfig) -> bool:
    return (_socket_open(cfg.sockets / ETCD_CLIENT_SOCK) if cfg.no_tcp
            else _port_open(cfg.etcd_port))


def _spawn_etcd(cfg: UpConfig) -> subprocess.Popen:
    binary = find_etcd()
    if cfg.no_tcp:
        for name in (ETCD_CLIENT_SOCK, ETCD_PEER_SOCK):
            if _socket_open(cfg.sockets / name):
                raise UpError(f"{cfg.sockets / name} is served (another `compilecast up "
                              "--no-tcp` with this home?)")
            with contextlib.suppress(FileNotFoundError):  # a previous run's
                (cfg.sockets / name).unlink()
    else:
        for port in (cfg.etcd_port, cfg.etcd_peer_port):
            if _port_open(port):
                raise UpError(f"port {port} is taken (another `compilecast up`?); "
                              "pass --etcd-port/--etcd-peer-port")
    data = cfg.home / "etcd"
    data.mkdir(parents=True, exist_ok=True)
    peer = f"unix://{ETCD_PEER_SOCK}" if cfg.no_tcp else f"http://127.0.0.1:{cfg.etcd_peer_port}"
    client = cfg.etcd_client_url()
    cmd, preexec = _with_death_signal([
        binary, "--name", "compilecast", "--data-dir", str(data),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"compilecast={peer}",
        "--auto-compaction-mode", "periodic",
        "--auto-compaction-retention", cfg.etcd_compaction_retention])
    with open(cfg.home / "etcd.log", "ab") as logf:
        # (with --no-tcp, etcd's sockets are named relative to its directory)
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=preexec,
                                cwd=cfg.sockets if cfg.no_tcp else None)


def _listening(proc: subprocess.Popen, cfg: UpConfig, deadline: float) -> bool:
    """Whether the etcd just spawned serves its clients yet; UpError when it
    exited or missed the deadline (then it is killed)."""
    if _etcd_serving(cfg):
        return True
    if proc.poll() is not None:
        raise UpError(f"etcd exited with {proc.returncode}; see {cfg.home / 'etcd.log'}")
    if time.monotonic() > deadline:
        proc.kill()
        proc.wait()
        raise UpError(f"etcd did not start in {ETCD_START_S:.0f}s; see {cfg.home / 'etcd.log'}")
    return False


ETCD_START_S = 20.0


def start_etcd(cfg: UpConfig) -> subprocess.Popen:
    proc, deadline = _spawn_etcd(cfg), time.monotonic() + ETCD_START_S
    while not _listening(proc, cfg, deadline):
        time.sleep(0.05)
    return proc


class LocalEtcd:
    """`up`'s etcd child, started again whenever it exits (killed, crashed,
    OOM): the coordinator meanwhile answers "compile locally" and its etcd
    client reconnects on its own, so nothing else has to restart. A child
    that keeps exiting soon after its start is started again less often
    (1 s, doubling up to 30 s)."""

    STEADY_S = 30.0  # a child that ran this long resets the backoff
    MAX_BACKOFF_S = 30.0

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0

    def start(self) -> None:
        self.proc, self.started = start_etcd(self.cfg), time.monotonic()

    async def supervise(self, poll_s: float = 0.5) -> None:
        backoff = 1.0
        while True:
            await asyncio.sleep(poll_s)
            if self.proc is None or self.proc.poll() is None:
                continue
            if time.monotonic() - self.started >= self.STEADY_S:
                backoff = 1.0
            log.warning("etcd exited with %s (see %s); starting it again in %.0fs",
                        self.proc.returncode, self.cfg.home / "etcd.log", backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.MAX_BACKOFF_S)
            try:
                # Spawned from the event loop's thread, which lives as long
                # as `up` (a death signal follows the child's parent thread).
                proc = _spawn_etcd(self.cfg)
                self.proc, self.started = proc, time.monotonic()
                deadline = self.started + ETCD_START_S
                while True:
                    if _listening(proc, self.cfg, deadline):
                        break
                    await asyncio.sleep(0.05)
            except UpError as exc:
                log.warning("etcd did not start again: %s", exc)
                continue
            self.restarts += 1
            log.warning("etcd started again (pid %d, restart %d)", proc.pid, self.restarts)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _serve(ccfg: CoordinatorConfig, wcfg: WorkerConfig, ready_msg: str,
                 etcd: LocalEtcd) -> None:
    from compilecast.coordinator.server import Coordinator
    from compilecast.serving import HeapWatch, serve_until_signal
    from compilecast.worker.daemon.server import Worker
    from compilecast.worker.keylib import mlircanon

    mlircanon.warm_up()  # JAX processes on this machine then key MLIR programs by the C path
    coordinator = Coordinator(ccfg)
    worker = Worker(wcfg)
    await coordinator.start()
    try:
        await worker.start()
    except BaseException:  # nothing of the worker listens yet: stop the coordinator
        await coordinator.stop(0.0)
        raise
    heap = HeapWatch({role.ROLE: role.registry for role in (coordinator, worker)})
    print(ready_msg, flush=True)
    supervisor = asyncio.create_task(etcd.supervise())

    async def stop_coordinator() -> None:
        supervisor.cancel()
        await worker._close()
        await coordinator.stop(10.0)  # finishes in-flight publishes

    try:
        await serve_until_signal(worker.server, on_stop=stop_coordinator)
    finally:
        heap.close()


# On one machine the store shares the user's disk: bounded like the host cache,
# and leaving as much free (a standalone coordinator's store is unbounded by
# default, on a volume of its own). COMPILECAST_STORE_MAX_BYTES=0 unbounds it.
UP_STORE_DEFAULTS = {"store_max_bytes": 20 << 30, "store_min_free_bytes": 2 << 30}


def configs(cfg: UpConfig, env: dict[str, str] | None = None
            ) -> tuple[CoordinatorConfig, WorkerConfig]:
    """The coordinator's and the worker's settings under `up`. `up` fixes where
    things listen; every other setting comes from the environment
    (COMPILECAST_LEASE_TTL_S, ...) as for the standalone roles."""
    no_tcp: dict[str, object] = {}
    if cfg.no_tcp:
        no_tcp = {"listen": f"unix://{cfg.sockets / 'coordinator.sock'}",
                  "metrics_port": 0, "data_listen": "off"}
    ccfg, _ = load(CoordinatorConfig, env=env, defaults=UP_STORE_DEFAULTS,
                   defaults_from="compilecast up", flags={
        "listen": f"127.0.0.1:{cfg.coordinator_port}",
        "etcd_endpoints": cfg.etcd_endpoint(),
        "store_dir": str(cfg.home / "coordinator"),
        "metrics_port": cfg.coordinator_metrics_port,
        "metrics_host": "127.0.0.1",
        "etcd_prefix": "/compilecast/v1",
        # Loopback and unix sockets only: no tokens (issue 5's rule for `up`).
        "allow_unauthenticated": True,
        **no_tcp,
        **({"otlp_endpoint": cfg.otlp_endpoint} if cfg.otlp_endpoint else {}),
    })
    sock = cfg.home / "worker.sock"
    wcfg, _ = load(WorkerConfig, env=env, flags={
        "listen": f"unix://{sock}", "coordinator": ccfg.listen,
        "cache_dir": str(cfg.home / "worker"), "metrics_port": cfg.worker_metrics_port,
        "metrics_host": "127.0.0.1",
        **({"metrics_port": 0, "data_plane": False} if cfg.no_tcp else {}),
        **({"otlp_endpoint": cfg.otlp_endpoint} if cfg.otlp_endpoint else {}),
        **({"job": cfg.job} if cfg.job else {}),
    })
    return ccfg, wcfg


def run(cfg: UpConfig) -> int:
    cfg.home.mkdir(parents=True, exist_ok=True)
    if cfg.no_tcp:
        os.chmod(cfg.home, 0o700)
        cfg.sockets.mkdir(mode=0o700, exist_ok=True)
        os.chmod(cfg.sockets, 0o700)
    ccfg, wcfg = configs(cfg)
    if cfg.no_tcp:
        if _socket_open(cfg.sockets / "coordinator.sock"):
            raise UpError(f"{cfg.sockets / 'coordinator.sock'} is served (another "
                          "`compilecast up --no-tcp` with this home? `compilecast status` says)")
    elif _port_open(cfg.coordinator_port):
        raise UpError(f"port {cfg.coordinator_port} is taken (another `compilecast up`? "
                      "`compilecast status` says); pass --coordinator-port for another")
    etcd = LocalEtcd(cfg)
    etcd.start()

    def metrics(port: int) -> str:
        return f"metrics http://127.0.0.1:{port}/metrics" if port else "metrics off"

    msg = "\n".join([
        "compilecast is up (Ctrl-C stops it)" +
        ("; nothing listens on TCP" if cfg.no_tcp else ""),
        f"  etcd         {cfg.etcd_endpoint()}   data {cfg.home / 'etcd'}",
        f"  coordinator  {ccfg.listen}   store {ccfg.store_dir}   {metrics(ccfg.metrics_port)}",
        f"  worker       {wcfg.listen}   cache {wcfg.cache_dir}   {metrics(wcfg.metrics_port)}",
        "  use it from JAX: COMPILECAST_ENABLE=1 python train.py",
    ])
    try:
        asyncio.run(_serve(ccfg, wcfg, msg, etcd))
    finally:
        etcd.stop()
        print("compilecast stopped", file=sys.stderr, flush=True)
    return 0


def default_up_config() -> UpConfig:
    return UpConfig(home=default_home())
