"""The PJRT interposer (worker/pjrtdoor/_pjrt_interposer.c, worker/pjrtdoor/pjrtgate.py): JAX
on XLA's CPU PJRT C-API plugin (lammps-jax-pjrt-cpu), wrapped by the
interposer, with compilecast.jax never imported. Real JAX processes, a real
worker, coordinator and etcd."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compilecast.cli.run import interposer_path

from .conftest import eventually, flip_middle_byte, sample

PROC = Path(__file__).with_name("pjrt_proc.py")


def real_plugin() -> str:
    import lammps_jax_pjrt_cpu

    return str(Path(lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so"))


def env_for(worker_target: str | None, *, interposed: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILECAST_", "JAX_"))}
    env.update(PJRT_PLUGIN_PATH=interposer_path() if interposed else real_plugin(),
               COMPILECAST_PJRT_PLUGIN=real_plugin(), COMPILECAST_PJRT_LOG="1")
    if worker_target:
        env["COMPILECAST_WORKER"] = worker_target
    return env


def wave(env: dict, n: int, tmp: Path, timeout_s: float = 300) -> list[tuple[dict, str]]:
    """`n` processes that start their training step together (killed, and
    the test failed, past `timeout_s`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    go = tmp / "go"
    procs = [subprocess.Popen([sys.executable, str(PROC), "--ready", str(tmp / f"ready{i}"),
                               "--go", str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    eventually(lambda: all((tmp / f"ready{i}").exists() or p.poll() is not None
                           for i, p in enumerate(procs)), "the processes ready", seconds=120)
    go.touch()
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            raise
        assert p.returncode == 0, stderr[-3000:]
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def decisions(stderr: str) -> list[tuple[str, str]]:
    """(HIT or COMPILE, key) of each compile the interposer asked about."""
    return re.findall(r"compilecast-pjrt\[\d+\]: worker: (HIT|COMPILE) (\S+)", stderr)


def real_compiles(stderr: str) -> int:
    return len(re.findall(r"compilecast-pjrt\[\d+\]: real compile", stderr))


@pytest.fixture
def worker(coordinator, start_worker):
    return start_worker(coordinator.cfg.listen, "w")


def test_four_processes_compile_each_program_once_and_a_second_wave_none(
        worker, tmp_path):
    baseline = wave(env_for(None, interposed=False), 1, tmp_path / "plain")[0][0]

    first = wave(env_for(worker.target), 4, tmp_path / "first")

    asked = [d for _, err in first for d in decisions(err)]
    programs = {key for _, key in asked}
    compiled = [key for decision, key in asked if decision == "COMPILE"]
    assert programs and sorted(compiled) == sorted(programs)  # each program once
    assert sum(real_compiles(err) for _, err in first) == len(programs)
    assert [r["loss"] for r, _ in first] == [baseline["loss"]] * 4
    # The wrapped plugin's platform, as without the interposer; compilecast.jax never loaded.
    platform = baseline["platform"]
    assert all(r["platform"] == platform and r["compilecast_jax"] == [] for r, _ in first)
    assert sample(worker, "compilecast_worker_pjrt_compiles_total", platform=platform,
                  outcome="compile") == len(programs)
    from compilecast.worker.inprocess.client import CacheClient

    [counts] = CacheClient(worker.target).status().pjrt_compiles
    assert (counts.platform, counts.compiles, counts.hits, counts.local) == (
        platform, len(programs), len(asked) - len(programs), 0)

    second = wave(env_for(worker.target), 2, tmp_path / "second")

    assert sum(real_compiles(err) for _, err in second) == 0
    assert {key for _, err in second for _, key in decisions(err)} == programs
    assert [r["loss"] for r, _ in second] == [baseline["loss"]] * 2


def test_without_a_worker_the_program_compiles_and_says_why(tmp_path):
    [(got, err)] = wave(env_for(f"unix://{tmp_path}/none.sock"), 1, tmp_path / "w")

    assert "compiling without compilecast" in err
    assert got["loss"] == wave(env_for(None, interposed=False), 1, tmp_path / "p")[0][0]["loss"]


def test_a_corrupt_shared_executable_is_compiled_again(coordinator, start_worker, tmp_path):
    first = start_worker(coordinator.cfg.listen, "first")
    [(good, _)] = wave(env_for(first.target), 1, tmp_path / "a")
    for blob in Path(coordinator.cfg.store_dir, "blobs").rglob("*"):
        if blob.is_file():
            flip_middle_byte(blob)
    fresh = start_worker(coordinator.cfg.listen, "fresh")  # its host cache is empty

    [(got, err)] = wave(env_for(fresh.target), 1, tmp_path / "b")

    # The copy that proves corrupt is dropped and asked for again: the
    # process that found it compiles the program in its place (the policy's
    # re-ask), and any HIT after that is the new, verified copy.
    assert got["loss"] == good["loss"]
    assert real_compiles(err) >= 1 and any(d == "COMPILE" for d, _ in decisions(err))


def test_a_plugin_of_another_major_version_is_passed_through(tmp_path):
    fake = tmp_path / "fake.c"
    fake.write_text(
        "#include <stddef.h>\n"
        "struct v { size_t s; void *e; int major, minor; };\n"
        "struct api { size_t s; void *e; struct v version; void *fns[100]; };\n"
        "static struct api table = {sizeof table, 0, {sizeof(struct v), 0, 1, 7}, {0}};\n"
        "const void *GetPjrtApi(void) { return &table; }\n")
    so = tmp_path / "fake.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(fake)], check=True)
    probe = (f"import ctypes; lib = ctypes.CDLL({interposer_path()!r}); "
             f"fake = ctypes.CDLL({str(so)!r}); "
             "lib.GetPjrtApi.restype = fake.GetPjrtApi.restype = ctypes.c_void_p; "
             "print(lib.GetPjrtApi() == fake.GetPjrtApi())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "COMPILECAST_PJRT_PLUGIN": str(so)}, check=True)

    assert done.stdout.strip() == "True"  # the wrapped plugin's own table, untouched
    assert "speaks PJRT C API 1.7" in done.stderr and "passed through untouched" in done.stderr


def test_who_compiles_follows_the_program_devices():
    import numpy as np
    from jax._src.lib import xla_client

    from compilecast.worker.pjrtdoor.pjrtgate import identity, program_devices
    from compilecast.worker.pjrtdoor.pjrtkeys import Compile

    opts = xla_client.CompileOptions()
    opts.device_assignment = xla_client.DeviceAssignment.create(np.array([[3, 5], [7, 1]]))
    serialized = opts.SerializeAsString()
    assert sorted(program_devices(serialized)) == [1, 3, 5, 7]
    # Devices 0-3 on process 0, 4-7 on process 1 (as the interposer describes
    # them): a program over both processes is the job's; the owner of its lowest
    # device (1: process 0) compiles.
    described = "".join(f"{d} {d // 4} cpu\n  coords={d}\n" for d in range(8))
    owners = Compile(header={}, program=b"", options=b"", devices=described).owners()
    assert owners == {d: d // 4 for d in range(8)}
    shared = identity(owners, 1, 7, serialized)
    assert shared.job.startswith("pjrt-") and shared.designated_process == 0
    assert shared.process_id == 1
    # A program on one process's devices waits for nobody.
    one = xla_client.CompileOptions()
    one.device_assignment = xla_client.DeviceAssignment.create(np.array([[5], [6]]))
    alone = identity(owners, 1, 7, one.SerializeAsString())
    assert alone.job == "" and alone.client.endswith(":7")
    assert program_devices(b"") == [] and identity({}, 0, 7, b"\xff").job == ""


def test_malformed_frames_are_refused_and_the_gate_goes_on(worker, tmp_path):
    import socket as sk

    path = worker.target.removeprefix("unix://") + ".pjrt"
    for junk in (b"NOPE" + b"\0" * 20, b"CCP1" + (1 << 30).to_bytes(4, "little"), b"CCP1\x02"):
        with sk.socket(sk.AF_UNIX) as s:
            s.connect(path)
            s.sendall(junk)
            s.shutdown(sk.SHUT_WR)
            assert s.recv(100) == b""  # closed, nothing answered
    [(got, err)] = wave(env_for(worker.target), 1, tmp_path / "after")
    plain = wave(env_for(None, interposed=False), 1, tmp_path / "plain")[0][0]
    assert decisions(err) and got["platform"] == plain["platform"]


class _ScriptedGate:
    """A worker socket that answers every compile with `answer` (a reply
    frame, or None: close at once), to see the interposer through what a
    real worker can do at its worst: die while a process holds the lease, or
    hand over bytes the plugin refuses."""

    def __init__(self, path: str, answer: bytes | None) -> None:
        import socket as sk
        import threading

        self.sock = sk.socket(sk.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(16)
        self.answer = answer
        self.asked = 0
        self.held: list = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._one(conn)

    def _one(self, conn) -> None:
        conn.recv(1 << 20)
        self.asked += 1
        if self.answer is not None:
            conn.sendall(self.answer)
        if self.answer is not None and self.answer.endswith(b"WAITING\0"):
            self.held.append(conn)  # and then nothing more: silence
        else:
            conn.close()


@pytest.mark.parametrize("answer", ["COMPILE then gone", "HIT of bytes the plugin refuses",
                                    "HIT of bytes that do not hash to their digest",
                                    "heartbeats and then silence",
                                    "COMPILE with options the plugin cannot use"])
def test_the_job_completes_whatever_the_worker_does(tmp_path, answer):
    import hashlib

    from compilecast.worker.pjrtdoor.pjrtgate import frame

    junk = b"not an executable"
    reply = {"COMPILE then gone": frame("COMPILE cc1-x"),
             "HIT of bytes the plugin refuses":
                 frame(f"HIT cc1-x {hashlib.sha256(junk).hexdigest()}", junk),
             "HIT of bytes that do not hash to their digest":
                 frame(f"HIT cc1-x {hashlib.sha256(b'other').hexdigest()}", junk),
             "heartbeats and then silence": frame("WAITING") * 3,
             "COMPILE with options the plugin cannot use":
                 frame("COMPILE cc1-x", b"\xff\xfe not compile options")}[answer]

    gate = _ScriptedGate(str(tmp_path / "w.sock.pjrt"), reply)
    baseline = wave(env_for(None, interposed=False), 1, tmp_path / "plain")[0][0]

    env = env_for(f"unix://{tmp_path}/w.sock")
    env["COMPILECAST_PJRT_SILENCE_S"] = "1"
    [(got, err)] = wave(env, 1, tmp_path / "run")

    assert got["loss"] == baseline["loss"] and gate.asked >= 1
    assert real_compiles(err) == gate.asked  # each compile fell back to the real plugin
    if answer == "HIT of bytes the plugin refuses":
        assert "the plugin refused a shared executable" in err
    if answer == "HIT of bytes that do not hash to their digest":
        assert "did not hash to its digest" in err
        assert "the plugin refused" not in err  # the plugin never saw them
    if answer == "COMPILE with options the plugin cannot use":
        assert "compiling with the framework's own" in err


class _DrippingGate(_ScriptedGate):
    """A worker socket that keeps the interposer waiting however it can:
    silence, heartbeats forever, a HIT whose payload comes one byte at a
    time, or a COMPILE whose publish it never acknowledges (heartbeats
    instead)."""

    def __init__(self, path: str, how: str) -> None:
        self.how = how
        super().__init__(path, None)

    def _one(self, conn) -> None:
        import threading

        self.held.append(conn)
        threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn) -> None:
        import time

        from compilecast.worker.pjrtdoor.pjrtgate import frame

        try:
            conn.recv(1 << 20)
            self.asked += 1
            if self.how == "heartbeats that say the answer comes within a second":
                while True:
                    conn.sendall(frame("WAITING", b"1"))
                    time.sleep(0.5)
            if self.how == "a payload that drips after its header":
                reply = frame("HIT cc1-x " + "0" * 64, b"x" * 1000)
                conn.sendall(reply[:-1000])  # the header and the payload's size at once
                for i in range(len(reply) - 1000, len(reply)):
                    conn.sendall(reply[i:i + 1])
                    time.sleep(0.5)
                return
            if self.how == "a payload one byte at a time":
                reply = frame("HIT cc1-x " + "0" * 64, b"x" * 1000)
                for i in range(len(reply)):
                    conn.sendall(reply[i:i + 1])
                    time.sleep(0.5)
                return
            if self.how == "nothing at all":
                while conn.recv(1 << 16):  # held open, silent, until the caller goes
                    pass
                return
            if self.how == "a publish never acknowledged":
                conn.sendall(frame("COMPILE cc1-x"))
            while True:  # heartbeats, well within the silence bound
                conn.sendall(frame("WAITING"))
                time.sleep(0.5)
        except OSError:
            return


@pytest.mark.parametrize("how, bound", [
    ("nothing at all", {"COMPILECAST_PJRT_TIMEOUT_S": "3"}),
    ("heartbeats forever", {"COMPILECAST_PJRT_TIMEOUT_S": "3"}),
    ("heartbeats forever", {"COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS": "1000",
                            "COMPILECAST_PJRT_SILENCE_S": "2"}),
    ("a payload one byte at a time", {"COMPILECAST_PJRT_TIMEOUT_S": "3"}),
    ("a publish never acknowledged", {"COMPILECAST_PJRT_PUBLISH_S": "2"}),
])
def test_each_exchange_ends_by_its_one_deadline_whatever_the_worker_sends(tmp_path, how, bound):
    """A worker that heartbeats, drips or never acknowledges holds the
    framework until the exchange's deadline, not the silence bound's (an
    hour here) nor the 25-minute default: the process finishes while the
    gate is still sending."""
    gate = _DrippingGate(str(tmp_path / "w.sock.pjrt"), how)
    baseline = wave(env_for(None, interposed=False), 1, tmp_path / "plain")[0][0]
    env = env_for(f"unix://{tmp_path}/w.sock")
    env.update({"COMPILECAST_PJRT_SILENCE_S": "3600", **bound})
    [(got, err)] = wave(env, 1, tmp_path / "run")
    assert got["loss"] == baseline["loss"] and gate.asked >= 1
    assert real_compiles(err) == gate.asked


@pytest.mark.parametrize("how, bound", [
    ("heartbeats that say the answer comes within a second", {}),
    ("a payload that drips after its header", {"COMPILECAST_PJRT_PUBLISH_S": "2"}),
])
def test_heartbeats_never_hold_an_exchange_past_what_it_can_need(tmp_path, how, bound):
    """With the exchange's own bound at its 25-minute default: a worker
    whose heartbeats say the answer comes within a second is waited for
    that long (and the silence bound) only; a HIT's payload, once its size
    is known, only as long as its bytes can need (before: each held the
    framework until the 25 minutes had passed)."""
    gate = _DrippingGate(str(tmp_path / "w.sock.pjrt"), how)
    baseline = wave(env_for(None, interposed=False), 1, tmp_path / "plain")[0][0]
    env = env_for(f"unix://{tmp_path}/w.sock")
    env.update({"COMPILECAST_PJRT_SILENCE_S": "1", **bound})
    env.pop("COMPILECAST_PJRT_TIMEOUT_S", None)
    env.pop("COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", None)
    [(got, err)] = wave(env, 1, tmp_path / "run", timeout_s=240)
    assert got["loss"] == baseline["loss"] and gate.asked >= 1
    assert real_compiles(err) == gate.asked


def test_a_stopped_gate_leaves_no_socket_behind(tmp_path):
    import asyncio

    from compilecast.worker.pjrtdoor.pjrtgate import PjrtGate

    path = tmp_path / "w.sock.pjrt"
    gate = PjrtGate(str(path), f"unix://{tmp_path}/w.sock", wait_timeout_s=1.0)

    async def run() -> bool:
        await gate.start()
        listening = path.exists()
        await gate.stop()
        return listening

    assert asyncio.run(run()) and not path.exists()


def test_the_script_saved_elsewhere_with_lines_added_compiles_nothing(worker, tmp_path):
    """Source paths and line numbers are debug metadata: the edited copy of a
    script hits every program, and XLA's own dump shows no compile."""
    wave(env_for(worker.target), 1, tmp_path / "first")
    edited = tmp_path / "elsewhere" / "my_training_step.py"
    edited.parent.mkdir()
    edited.write_text("# a copy of the user's script\n" * 7 + "import math  # noqa\n"
                      + PROC.read_text())
    dump = tmp_path / "dump"
    env = env_for(worker.target)
    env["XLA_FLAGS"] = f"--xla_dump_to={dump}"  # (dump flags never change a key)
    go = tmp_path / "go"
    done = subprocess.run([sys.executable, str(edited)], env=env, capture_output=True,
                          text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    assert decisions(done.stderr) and all(d == "HIT" for d, _ in decisions(done.stderr))
    assert real_compiles(done.stderr) == 0
    assert not list(dump.glob("*after_optimizations*"))  # XLA compiled nothing
    assert not go.exists()


def published_programs(target: str) -> dict[str, str]:
    """{key: its program component} of every artifact published so far."""
    from compilecast.worker.inprocess.client import CacheClient

    client = CacheClient(target)
    try:
        keys = [a.artifact.key for a in client.list_artifacts()]
        return {k: dict(client.describe(k).key_components).get("program", "") for k in keys}
    finally:
        client.close()


def test_one_program_has_one_canonical_digest_through_either_door(worker, tmp_path):
    """The same script through the interposer and through compilecast.jax on
    the same plugin: each program's canonical digest is the same through both
    doors (the JAX door keys the module JAX lowered; the plugin is handed it
    after XLA's C-API client rewrote it)."""
    wave(env_for(worker.target), 1, tmp_path / "interposed")
    interposed = published_programs(worker.target)
    env = env_for(worker.target, interposed=False)
    env.update(COMPILECAST_ENABLE="1", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    (result, stderr), = wave(env, 1, tmp_path / "jax")
    assert "compilecast.worker.jaxdoor.jax_integration" in result["compilecast_jax"], stderr[-3000:]
    through_jax = {k: p for k, p in published_programs(worker.target).items()
                   if k not in interposed}
    assert through_jax and all(through_jax.values()) and all(interposed.values()), stderr[-3000:]
    assert sorted(through_jax.values()) == sorted(interposed.values())
