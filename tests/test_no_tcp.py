"""`compilecast up --no-tcp`: a TPU VM's single host, where nothing may
listen on the network. Every endpoint is a unix socket under the home; a
real JAX process goes through it, and no process of it holds a TCP or UDP
socket."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from compilecast.config import ConfigError, CoordinatorConfig, WorkerConfig, load
from compilecast.launch import sockets_held

from .e2e import run_procs

pytestmark = pytest.mark.slow


def test_up_without_tcp_serves_a_jax_job_over_unix_sockets_alone(start_up):
    up = start_up(no_tcp=True)
    assert stat.S_IMODE(os.stat(up.home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(up.home / "sock").st_mode) == 0o700
    assert {p.name for p in (up.home / "sock").iterdir()} >= {
        "coordinator.sock", "etcd-client.sock:0", "etcd-peer.sock:0"}

    first = run_procs(2, up.target)
    assert sum(r["xla_compiles"] for r in first) == 1, first
    assert sum(r["compilecast"]["published"] for r in first) == 1
    again = run_procs(1, up.target)
    assert again[0]["xla_compiles"] == 0 and again[0]["compilecast"]["hits"] == 1
    assert again[0]["digest"] == first[0]["digest"]

    held = sockets_held(up.proc.pid)
    assert len(held) >= 2, held  # up and its etcd
    assert all(h["inet"] == 0 for h in held.values()), held
    assert all(h["unix"] > 0 for h in held.values()), held  # each serves or dials one

    out = subprocess.run([sys.executable, "-m", "compilecast.cli", "status", "--worker",
                          up.target], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "unix://" in out.stdout and "healthy" in out.stdout.lower(), out.stdout


@pytest.mark.parametrize("setting, value, said", [
    ("listen", "unix://relative.sock", "unix:///absolute/path"),
    ("listen", "unix:///" + "d" * 120 + "/c.sock", "at most 107 bytes"),
    ("etcd_endpoints", "127.0.0.1:2379,not a host", "is not host:port"),
    ("etcd_endpoints", "unix://etcd.sock", "unix:///absolute/path"),
])
def test_a_coordinator_address_it_cannot_use_is_refused_in_one_line(setting, value, said):
    with pytest.raises(ConfigError) as err:
        load(CoordinatorConfig, env={}, flags={setting: value, "allow_unauthenticated": True})
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_worker_address_it_cannot_use_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(WorkerConfig, env={}, flags={"coordinator": "unix:coordinator.sock"})
    assert "unix:///absolute/path" in str(err.value)
    cfg, _ = load(WorkerConfig, env={}, flags={"coordinator": f"unix://{tmp_path}/c.sock"})
    assert cfg.coordinator == f"unix://{tmp_path}/c.sock"
    # A socket it cannot make: one line from the CLI, naming the setting.
    out = subprocess.run([sys.executable, "-m", "compilecast.cli", "worker", "--listen",
                          "unix:///proc/no-such-dir/w.sock", "--coordinator",
                          f"unix://{tmp_path}/c.sock", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1 and "listen" in out.stderr, out.stderr


def test_up_takes_an_otlp_endpoint_for_both_roles(tmp_path):
    from compilecast.up import UpConfig, configs

    ccfg, wcfg = configs(UpConfig(home=tmp_path, otlp_endpoint="http://collector:4318"), env={})
    assert ccfg.otlp_endpoint == wcfg.otlp_endpoint == "http://collector:4318"
    ccfg, wcfg = configs(UpConfig(home=tmp_path, no_tcp=True), env={})
    assert ccfg.listen.startswith("unix://") and ccfg.etcd_endpoints.startswith("unix://")
    assert (ccfg.metrics_port, wcfg.metrics_port, ccfg.data_listen, wcfg.data_plane) == (
        0, 0, "off", False)
    out = subprocess.run([sys.executable, "-m", "compilecast.cli", "up", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert "--otlp-endpoint" in out.stdout and "--no-tcp" in out.stdout
