"""PyTorch/XLA's persistent cache shared across hosts by `compilecast run`
(worker/torchdoor/torchxla.py): real torch-xla 2.7 and 2.9 processes on the CPU
(`make install` puts them in .venv/torch-xla-*), a real coordinator, etcd and
one worker per "host"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually

ROOT = Path(__file__).resolve().parent.parent
TRAIN = Path(__file__).with_name("torchxla_train.py")
QUIET = {"dir_sync_s": 3600.0, "dir_settle_s": 0.0}

pytestmark = pytest.mark.slow


def python_of(release: str) -> str:
    python = ROOT / ".venv" / f"torch-xla-{release}" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: `make install` makes it (torch-xla {release})")
    return str(python)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """COMPILECAST_HOME of every run: the probe of each build runs once."""
    return tmp_path_factory.mktemp("home")


def run(worker, release: str, home: Path, *args: str, wait: bool = True,
        launcher: tuple[str, ...] = ()):
    """The training script through `compilecast run`: its venv's python, or
    `launcher` (a script of the venv, such as torchrun) in front of the script."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "COMPILECAST_HOME": str(home)}
    env.pop("XLA_PERSISTENT_CACHE_PATH", None)
    cmd = [sys.executable, "-m", "compilecast.cli", "run", "--worker", worker, "--",
           *(launcher or (python_of(release),)), str(TRAIN), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if not wait:
        return proc
    return finished(proc)


def finished(proc) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def synced(worker) -> CacheClient:
    client = CacheClient(worker.target)
    for d in client.status().directories:
        client.sync_directory(d.kind, d.namespace_id)
    return client


def test_a_second_host_hits_what_the_first_compiled(coordinator, start_worker, home):
    a = start_worker(coordinator.cfg.listen, "a", **QUIET)
    b = start_worker(coordinator.cfg.listen, "b", **QUIET)

    first, _ = run(a.target, "2.7", home)
    [da] = synced(a).status().directories
    second, err = run(b.target, "2.7", home)

    assert first["UncachedCompile"] >= 1 and first["PersistentCacheHit"] == 0
    assert da.kind == "torch-xla" and da.published >= 1 and not da.install_off
    assert second["PersistentCacheHit"] >= 1 and second["UncachedCompile"] == 0, err[-2000:]
    assert second["loss"] == first["loss"]
    [db] = CacheClient(b.target).status().directories
    assert db.namespace_id == da.namespace_id and db.installed == da.published
    assert "release.torch_xla=2.7.0" in db.namespace and "env.PJRT_DEVICE=CPU" in db.namespace


def test_a_second_host_started_through_torchrun_of_a_venv_not_on_path_compiles_nothing(
        coordinator, start_worker, home):
    """`compilecast run -- <venv>/bin/torchrun ... train.py`: the launcher's
    #! line names the venv's Python, which has torch_xla."""
    torchrun = str(Path(python_of("2.7")).with_name("torchrun"))
    assert os.path.dirname(torchrun) not in os.environ.get("PATH", "").split(os.pathsep)
    a = start_worker(coordinator.cfg.listen, "a", **QUIET)
    b = start_worker(coordinator.cfg.listen, "b", **QUIET)
    launcher = (torchrun, "--standalone", "--nproc-per-node=1")

    first, _ = run(a.target, "2.7", home, launcher=launcher)
    synced(a)
    second, err = run(b.target, "2.7", home, launcher=launcher)

    assert first["UncachedCompile"] >= 1
    assert second["PersistentCacheHit"] >= 1 and second["UncachedCompile"] == 0, err[-2000:]
    assert second["loss"] == first["loss"]


def test_the_interpreter_of_a_command_is_found_as_its_launcher_names_it(tmp_path):
    from compilecast.worker.torchdoor.torchxla import interpreter

    venv_python = tmp_path / "venv" / "bin" / "python3.11"
    launcher = tmp_path / "venv" / "bin" / "torchrun"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f"#!{venv_python}\nimport sys\n")
    launcher.chmod(0o755)
    by_env = tmp_path / "by-env"
    by_env.write_text("#!/usr/bin/env python3\n")
    by_env.chmod(0o755)
    not_python = tmp_path / "job.sh"
    not_python.write_text("#!/bin/sh\n")
    not_python.chmod(0o755)

    assert interpreter([str(launcher), "train.py"]) == str(venv_python)
    assert interpreter([str(by_env)]) == shutil.which("python3")
    assert interpreter([sys.executable, "-m", "torch.distributed.run"]) == sys.executable
    assert interpreter([str(not_python)]) == (shutil.which("python3") or sys.executable)


def test_a_host_that_started_first_hits_what_arrives_while_it_runs(
        coordinator, start_worker, home, tmp_path):
    a = start_worker(coordinator.cfg.listen, "a", **QUIET)
    b = start_worker(coordinator.cfg.listen, "b", dir_sync_s=0.2, dir_settle_s=1.0)
    pause = tmp_path / "pause"
    pause.mkdir()
    early = run(b.target, "2.7", home, "--pause", str(pause), wait=False)
    eventually(lambda: (pause / "ready").exists() or early.poll() is not None,
               "host b at its pause", seconds=300)
    assert early.poll() is None, early.communicate()[1][-2000:]

    run(a.target, "2.7", home)
    [da] = synced(a).status().directories
    db_path = Path(CacheClient(b.target).status().directories[0].path)
    eventually(lambda: {p.name for p in db_path.iterdir()} >= set(
        n for n in os.listdir(da.path) if not n.startswith(".")), "a's entries on b")
    (pause / "go").touch()
    late, err = finished(early)

    assert late["PersistentCacheHit"] >= 1, err[-2000:]
    assert late["UncachedCompile"] == 1  # its own warm-up graph only


def test_a_build_that_cannot_load_its_cache_publishes_only_and_says_why(
        coordinator, start_worker, home):
    a = start_worker(coordinator.cfg.listen, "a", **QUIET)

    got, err = run(a.target, "2.9", home)

    [d] = synced(a).status().directories
    assert got["UncachedCompile"] >= 1
    assert "torch_xla 2.9.0" in d.install_off and "deserializ" in d.install_off
    assert "none is installed here" in err
    assert "release.torch_xla=2.9.0" in d.namespace


def test_without_a_worker_the_job_runs_as_it_was(tmp_path, home):
    got, err = run(f"unix://{tmp_path}/no-worker.sock", "2.7", home)

    assert got["UncachedCompile"] >= 1 and got["PersistentCacheHit"] == 0
    assert "running without a shared cache" in err


def test_torch_xla_compiles_through_the_interposer(coordinator, start_worker):
    """torch-xla 2.9 on XLA's CPU plugin through the PJRT interposer: the
    compile goes through compilecast (published, then a hit loaded by a second
    process). Running the executable then fails in both, with or without the
    interposer: no CPU plugin on PyPI matches torch-xla 2.9's PJRT C API
    (docs/pjrt.md)."""
    import lammps_jax_pjrt_cpu

    from compilecast.cli.run import interposer_path

    w = start_worker(coordinator.cfg.listen, "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILECAST_", "XLA_"))}
    env.update(PJRT_PLUGIN_PATH=interposer_path(), COMPILECAST_WORKER=w.target,
               COMPILECAST_PJRT_LOG="1", COMPILECAST_PJRT_PLUGIN=str(Path(
                   lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so")))
    script = str(Path(__file__).with_name("torchxla_plugin_proc.py"))
    runs = [subprocess.run([python_of("2.9"), script], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]

    first, second = (r.stderr for r in runs)
    assert "worker: COMPILE" in first and "OK published" in first
    assert "worker: HIT" in second and "refused" not in second
    assert "real compile" not in second
    for r in runs:  # the framework's own mismatch with this plugin, after the compile
        assert r.returncode != 0 and "PJRT_ExecuteOptions size" in r.stderr


def test_compilecast_run_interposes_the_tpu_plugin_by_environment_alone(tmp_path):
    """`compilecast run --interpose-tpu` makes torch_xla load the interposer
    as its TPU plugin (TPU_LIBRARY_PATH), wrapping the one it would have
    loaded, with no change to the script. Here the "TPU plugin" is XLA's CPU
    plugin, which then refuses TPU's client options: the route is what this
    shows; a TPU run is scripts/torchxla_tpu_check.py's."""
    import lammps_jax_pjrt_cpu

    stand_in = str(Path(lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so"))
    env = {**os.environ, "PJRT_DEVICE": "TPU", "TPU_LIBRARY_PATH": stand_in,
           "COMPILECAST_PJRT_LOG": "1", "COMPILECAST_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "compilecast.cli", "run", "--interpose-tpu",
         "--worker", f"unix://{tmp_path}/none.sock", "--", python_of("2.9"),
         str(Path(__file__).with_name("torchxla_tpu_proc.py"))],
        env=env, capture_output=True, text=True, timeout=300)

    assert f"wrapping {stand_in}" in done.stderr, done.stderr[-2000:]
    # torch_xla's TPU client options reached the wrapped plugin, which refused them.
    assert "Unexpected option name passed to PJRT_Client_Create" in done.stderr
