"""The PJRT gate's keys and bounds (worker/pjrtdoor/pjrtkeys.py, worker/pjrtdoor/pjrtgate.py):
what changes an executable always changes the key; no caller can make the
gate hold more than its limits. A real worker, coordinator and etcd; the
gate's callers are raw sockets speaking its frames."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from compilecast.worker.pjrtdoor import pjrtkeys
from compilecast.worker.pjrtdoor.pjrtgate import GateLimits, PjrtGate, frame

from .conftest import eventually


def plugin_file() -> Path:
    import lammps_jax_pjrt_cpu

    return Path(lammps_jax_pjrt_cpu.__file__).with_name("pjrt_c_api_cpu_plugin.so")


def portable_program() -> bytes:
    """A small StableHLO portable artifact, as JAX hands it to a plugin."""
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jaxlib.mlir.dialects import stablehlo

    module = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones((4, 4))).compiler_ir()
    return bytes(_jax.mlir.serialize_portable_artifact(
        jmlir.module_to_bytecode(module), stablehlo.get_current_version()))


def options() -> bytes:
    from jax._src.lib import xla_client

    return xla_client.CompileOptions().SerializeAsString()


def compile_of(**kw) -> pjrtkeys.Compile:
    base = dict(header={"format": "mlir", "platform": "cpu", "platform_version": "cpu"},
                program=portable_program(), options=options(), devices="0 0 cpu\n",
                plugin=f"path={plugin_file()}\napi=0.115\nattribute xla_version=1\n",
                env={})
    base.update(kw)
    return pjrtkeys.Compile(**base)


def key(c: pjrtkeys.Compile) -> str:
    return pjrtkeys.compile_key(c).value


def test_a_portable_artifact_is_keyed_by_its_canonical_program():
    made = pjrtkeys.compile_key(compile_of())
    assert made.components["program_format"] == "stablehlo-portable" and not made.unparsed
    # Names and locations are debug metadata: the portable artifact of the same
    # program from another source line keys the same.
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import _jax
    from jaxlib.mlir.dialects import stablehlo

    def elsewhere(x):
        return jnp.tanh(x) * 2

    module = jax.jit(elsewhere).lower(jnp.ones((4, 4))).compiler_ir()
    other = bytes(_jax.mlir.serialize_portable_artifact(
        jmlir.module_to_bytecode(module), stablehlo.get_current_version()))
    assert other != compile_of().program
    assert key(compile_of(program=other)) == made.value


def test_what_changes_an_executable_changes_the_key(tmp_path, monkeypatch):
    base = key(compile_of())
    copy = tmp_path / "same.so"
    shutil.copyfile(plugin_file(), copy)
    rebuilt = tmp_path / "rebuilt.so"
    shutil.copyfile(plugin_file(), rebuilt)
    with open(rebuilt, "ab") as f:
        f.write(b"another build")
    plugin = compile_of().plugin
    # The plugin's build: its library's bytes and its reported attributes (not its path).
    assert key(compile_of(plugin=plugin.replace(str(plugin_file()), str(copy)))) == base
    assert key(compile_of(plugin=plugin.replace(str(plugin_file()), str(rebuilt)))) != base
    assert key(compile_of(plugin=plugin.replace("xla_version=1", "xla_version=2"))) != base
    assert key(compile_of(plugin=plugin.replace("api=0.115", "api=0.116"))) != base
    # The environment the plugin reads; dump flags never count.
    tpu_a = key(compile_of(env={"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective=true"}))
    tpu_b = key(compile_of(env={"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective=false"}))
    assert len({base, tpu_a, tpu_b}) == 3
    assert key(compile_of(env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"})) != base
    assert key(compile_of(env={"XLA_FLAGS": f"--xla_dump_to={tmp_path}"})) == base
    # Devices: their kinds and attributes.
    assert key(compile_of(devices="0 0 other-kind\n")) != base
    assert key(compile_of(devices="0 0 cpu\n  coords=0,0,1\n")) != base
    # ...but not the order a plugin lists them in (libtpu's changes from process
    # to process), nor the order of the devices.
    tpu = "0 0 TPU v5 lite\n  coords=0,0,0\n  core_on_chip=0\n  num_cores=1\n"
    shuffled = "0 0 TPU v5 lite\n  num_cores=1\n  coords=0,0,0\n  core_on_chip=0\n"
    assert key(compile_of(devices=tpu)) == key(compile_of(devices=shuffled)) != base
    assert key(compile_of(devices=tpu.replace("num_cores=1", "num_cores=2"))) != key(
        compile_of(devices=tpu))
    two = "0 0 chip\n  a=1\n1 0 chip\n  a=2\n"
    assert key(compile_of(devices=two)) == key(compile_of(devices="1 0 chip\n  a=2\n0 0 chip\n  a=1\n"))
    assert key(compile_of(devices=two)) != key(compile_of(devices="0 0 chip\n  a=2\n1 0 chip\n  a=1\n"))
    # The host CPU on a CPU platform.
    monkeypatch.setattr(pjrtkeys.keys, "host_cpu_digest", lambda: "another CPU")
    assert key(compile_of()) != base


def test_options_that_cannot_be_read_are_keyed_by_their_bytes():
    good = options()
    keys = {key(compile_of(options=o)) for o in
            (good, b"", os.urandom(300), good + b"\xff", good + b"\x98\x06\x01")}
    assert len(keys) == 5  # never another options' key
    made = pjrtkeys.compile_key(compile_of(options=os.urandom(300)))
    assert "compile_options_raw" in made.components


# -- the gate's bounds, against a real worker -----------------------------------------

class GateThread:
    """A PjrtGate with small limits on an event loop of its own."""

    def __init__(self, path: str, worker_target: str, limits: GateLimits, *,
                 tokens_required: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.gate = PjrtGate(path, worker_target, wait_timeout_s=5.0, limits=limits,
                             tokens_required=tokens_required)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.gate.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.gate.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def request(c: pjrtkeys.Compile, token: str = "") -> bytes:
    import json

    head = json.dumps({"op": "compile", **c.header}).encode()
    env = b"".join(f"{k}={v}".encode() + b"\0" for k, v in c.env.items())
    blobs = [c.program, c.options, c.devices.encode(), c.plugin.encode(), env, token.encode()]
    return (b"CCP2" + len(head).to_bytes(4, "little") + head + bytes([len(blobs)])
            + b"".join(len(b).to_bytes(8, "little") + b for b in blobs))


def read_reply(s: socket.socket) -> tuple[str, bytes]:
    """The first frame that is not a heartbeat: (header, payload)."""
    return reply_from(s.makefile("rb"))


def reply_from(f) -> tuple[str, bytes]:
    """`read_reply` from a socket's file already being read."""
    while True:
        assert f.read(4) == b"CCP2"
        n = int.from_bytes(f.read(4), "little")
        head = f.read(n).decode()
        count = f.read(1)[0]
        payload = b""
        if count:
            payload = f.read(int.from_bytes(f.read(8), "little"))
        if head != "WAITING":
            return head, payload


def ask(path: str, c: pjrtkeys.Compile, token: str = "") -> tuple[str, bytes]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(path)
        s.sendall(request(c, token))
        return read_reply(s)


@pytest.fixture
def gate(coordinator, start_worker, tmp_path):
    worker = start_worker(coordinator.cfg.listen, "w")
    path = str(tmp_path / "g.pjrt")
    g = GateThread(path, worker.target, GateLimits(
        connections=8, per_process=8, header_s=1.0, blob_s=1.0, min_rate=1 << 20,
        memory_bytes=8 << 20))
    yield path, g, worker
    g.stop()


def compile_and_publish(path: str, c: pjrtkeys.Compile, executable: bytes,
                        token: str = "") -> tuple[str, str]:
    """As the holder does: ask, get COMPILE, publish `executable` on the same
    connection. (the key, the gate's last answer)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(path)
        s.sendall(request(c, token))
        head, _ = read_reply(s)
        assert head.startswith("COMPILE ")
        s.sendall(frame("publish 1.5", executable))
        return head.split()[1], read_reply(s)[0]


def test_a_publish_is_taken_for_the_connection_s_key_only_and_read_back_verified(gate):
    path, _, _ = gate
    c = compile_of()
    executable = b"an executable" * 100
    the_key, ok = compile_and_publish(path, c, executable)
    assert ok == f"OK published {the_key}"
    head, payload = ask(path, c)
    word, got_key, digest = head.split()
    assert (word, got_key, payload) == ("HIT", the_key, executable)
    assert digest == hashlib.sha256(executable).hexdigest()


def test_idle_slow_and_huge_callers_are_bounded_and_the_gate_answers_on(gate):
    path, g, _ = gate
    idle = []
    for _ in range(20):  # past the connection limit: answered LOCAL and closed at once
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        idle.append(s)
    late = idle[-1]
    late.settimeout(10)
    head, _ = read_reply(late)
    assert head.startswith("LOCAL") and "connection limit" in head
    # The idle ones are dropped at their header deadline; the gate then answers.
    eventually(lambda: g.gate.open == 0, "idle connections dropped", seconds=30)
    for s in idle:
        s.close()
    # A huge announcement: answered LOCAL without the bytes ever being read.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        whole = request(compile_of())
        head_end = 8 + int.from_bytes(whole[4:8], "little") + 1  # magic, size, header, count
        s.sendall(whole[:head_end] + (8 << 30).to_bytes(8, "little"))
        head, _ = read_reply(s)
        assert head.startswith("LOCAL") and "budget" in head
    # Headers that are not flat objects: closed, and nothing held.
    for bad in (b"[1, 2]", b"{" * 5000, b'{"a": {"b": 1}}'):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b"CCP2" + len(bad).to_bytes(4, "little") + bad + b"\x06")
            assert s.recv(100) == b""
    assert g.gate.budget.used == 0
    head, _ = ask(path, compile_of())
    assert head.split()[0] in ("COMPILE", "HIT")


def test_a_process_of_another_user_is_refused_even_where_the_socket_lets_it_in(
        coordinator, start_worker):
    """Peer credentials, besides the socket's permissions: with the socket
    opened to everyone (a mistake), another user's process still gets nothing."""
    import pwd
    import subprocess
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and a Python another user can run (/usr/bin/python3)")
    worker = start_worker(coordinator.cfg.listen, "w")
    where = tempfile.mkdtemp(prefix="cc-gate-", dir="/tmp")
    os.chmod(where, 0o777)
    path = os.path.join(where, "g.pjrt")
    g = GateThread(path, worker.target, GateLimits())
    try:
        os.chmod(path, 0o666)
        nobody = pwd.getpwnam("nobody")
        probe = ("import socket\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 f"s.connect({path!r})\n"
                 "try:\n"
                 f"    s.sendall({request(compile_of())!r})\n"
                 "    print('answered', s.recv(100))\n"
                 "except OSError:\n"
                 "    print('answered', b'')\n")
        done = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}",
                               f"--regid={nobody.pw_gid}", "--clear-groups",
                               "/usr/bin/python3", "-I", "-c", probe],
                              capture_output=True, text=True, timeout=60, cwd="/")
        assert done.stdout.strip() == "answered b''", done.stdout + done.stderr
        assert g.gate.open == 0
        head, _ = ask(path, compile_of())  # this user's processes are served
        assert head.split()[0] in ("COMPILE", "HIT")
    finally:
        g.stop()
        shutil.rmtree(where, ignore_errors=True)


def two_process_compile(process_index: int, platform: str = "cpu") -> pjrtkeys.Compile:
    """A program over devices 0 (process 0) and 1 (process 1), as each of the
    job's two interposed processes describes it."""
    import numpy as np
    from jax._src.lib import xla_client

    opts = xla_client.CompileOptions()
    opts.device_assignment = xla_client.DeviceAssignment.create(np.array([[0, 1]]))
    return compile_of(header={"format": "mlir", "platform": platform, "platform_version": "x",
                              "process_index": process_index},
                      options=opts.SerializeAsString(), devices="0 0 cpu\n1 1 cpu\n")


def test_a_program_over_two_processes_is_compiled_by_its_designated_process(gate):
    """The per-program rule through the gate: the other process asks first,
    and waits (heartbeats) until the designated one has published."""
    path, _, _ = gate
    with socket.socket(socket.AF_UNIX) as waiter, socket.socket(socket.AF_UNIX) as holder:
        waiter.settimeout(60)
        waiter.connect(path)
        waiter.sendall(request(two_process_compile(1)))
        f = waiter.makefile("rb")
        assert f.read(4) == b"CCP2"  # a heartbeat: it waits, it does not compile
        assert f.read(4 + len("WAITING") + 1)[4:] == b"WAITING\x01"
        within = f.read(int.from_bytes(f.read(8), "little"))  # the seconds the answer can take
        assert within.isdigit() and 0 < int(within) <= 20 * 60 + 120
        holder.settimeout(60)
        holder.connect(path)
        holder.sendall(request(two_process_compile(0)))
        head, _ = read_reply(holder)
        assert head.startswith("COMPILE ")
        holder.sendall(frame("publish 2.0", b"the job's executable"))
        assert read_reply(holder)[0].startswith("OK published")
        head, payload = reply_from(f)
        f.close()
    assert head.split()[:2] == ["HIT", head.split()[1]] and payload == b"the job's executable"


def test_a_gpu_job_s_compile_under_the_lease_autotunes_alone(gate):
    from jax._src.lib import xla_client

    path, _, _ = gate
    head, payload = ask(path, two_process_compile(0, platform="cuda"))
    assert head.startswith("COMPILE ")
    told = xla_client.CompileOptions.ParseFromString(payload)
    assert ("xla_gpu_shard_autotuning", False) in list(told.env_option_overrides)


def test_hit_bytes_stay_in_the_budget_until_written_and_leave_it_after(gate):
    """A HIT's executable counts against the gate's memory budget while
    answers carry it, once however many carry it, and not after."""
    path, g, _ = gate
    c = compile_of()
    assert compile_and_publish(path, c, b"x" * (3 << 20))[1].startswith("OK published")
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(ask(path, c))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [h.split()[0] for h, _ in answers] == ["HIT"] * 4
    assert all(len(p) == 3 << 20 for _, p in answers)
    eventually(lambda: g.gate.budget.used == 0 and not g.gate.payloads, "the budget given back")


def test_a_caller_without_a_token_reads_but_never_publishes_where_the_worker_has_one(
        start_coordinator, start_worker, tokens_file, tmp_path):
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    token = tmp_path / "worker.token"
    token.write_text("a-worker")
    worker = start_worker(secured.cfg.listen, "w", token_file=str(token))
    path = str(tmp_path / "g.pjrt")
    g = GateThread(path, worker.target, GateLimits(), tokens_required=True)
    try:
        c = compile_of()
        head, _ = ask(path, c)  # no token: never a lease under the worker's credential
        assert head.startswith("LOCAL") and "no token" in head, head
        with socket.socket(socket.AF_UNIX) as s:  # ... nor a publish of other bytes
            s.settimeout(60)
            s.connect(path)
            s.sendall(request(c))
            assert read_reply(s)[0].startswith("LOCAL")
        executable = b"the holder's executable" * 50
        the_key, ok = compile_and_publish(path, c, executable, token="a-pub")
        assert ok == f"OK published {the_key}"
        head, payload = ask(path, c)  # without a token it still reads the fleet's executables
        assert head.split()[0] == "HIT" and payload == executable
    finally:
        g.stop()


def test_the_plugin_library_hashed_is_root_s_or_the_caller_s_regular_file_alone(tmp_path):
    import pwd

    mine = tmp_path / "plugin.so"
    shutil.copyfile(plugin_file(), mine)
    expected = hashlib.sha256(mine.read_bytes()).hexdigest()
    me = os.geteuid()
    assert pjrtkeys.library_digest(str(mine), me) == expected
    other = pwd.getpwnam("nobody").pw_uid
    if me == 0:  # a file of another user is never read for a caller
        os.chown(mine, other, -1)
        pjrtkeys._plugin_digests.clear()
        assert "not hashed" in pjrtkeys.library_digest(str(mine), 12345)
        assert pjrtkeys.library_digest(str(mine), other) == expected
    assert "not a library's path" in pjrtkeys.library_digest("/dev/zero", me)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in pjrtkeys.library_digest(str(fifo), me)
    sparse = tmp_path / "sparse.so"
    with open(sparse, "wb") as f:
        f.truncate(pjrtkeys.MAX_PLUGIN_BYTES + 1)
    assert "not hashed" in pjrtkeys.library_digest(str(sparse), me)


def test_a_plugin_library_is_hashed_only_when_the_caller_loaded_it(tmp_path):
    import mmap

    lib = tmp_path / "plugin.so"
    shutil.copyfile(plugin_file(), lib)
    expected = hashlib.sha256(lib.read_bytes()).hexdigest()
    me, pid = os.geteuid(), os.getpid()
    pjrtkeys._plugin_digests.clear()
    # A file the calling process has not loaded is never opened, let alone read.
    assert "not loaded by the calling process" in pjrtkeys.library_digest(str(lib), me, pid)
    for secret in ("/etc/shadow", "/etc/passwd"):
        assert "not read" in pjrtkeys.library_digest(secret, me, pid)
    for name in ("/proc/self/mem", "/proc/self/environ", "/sys/kernel/notes", "/dev/zero"):
        assert "not a library's path" in pjrtkeys.library_digest(name, me, pid)
    link = tmp_path / "to-proc"
    link.symlink_to("/proc/self/mem")
    assert "not a library's path" in pjrtkeys.library_digest(str(link), me, pid)
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        # Loaded (mapped): hashed; known now, it needs no hashing thread.
        assert pjrtkeys.library_digest(str(lib), me, pid, hash_new=False) is None
        assert pjrtkeys.library_digest(str(lib), me, pid) == expected
        assert pjrtkeys.library_digest(str(lib), me, pid, hash_new=False) == expected
    # A mapped file that is no library (a caller can map any file it reads).
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not an ELF file" * 100)
    with open(text, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        assert "not a shared library" in pjrtkeys.library_digest(str(text), me, pid)
    # A library anyone may write is no build anyone can vouch for.
    lib.chmod(0o666)
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        assert "writable by others" in pjrtkeys.library_digest(str(lib), 12345 if me else -1, pid)


def test_an_announced_blob_holds_only_what_has_arrived(gate):
    """A caller that announces a large program and sends nothing holds one
    piece of the budget, until its deadline; others are answered meanwhile."""
    from compilecast.worker.pjrtdoor.pjrtgate import BLOB_PIECE

    path, g, _ = gate
    share = g.gate.budget.per_process
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        whole = request(compile_of())
        head_end = 8 + int.from_bytes(whole[4:8], "little") + 1
        s.sendall(whole[:head_end] + (share - 1).to_bytes(8, "little") + b"x" * 100)
        eventually(lambda: g.gate.budget.used > 0, "the first piece is charged")
        assert g.gate.budget.used <= BLOB_PIECE < share - 1
        head, _ = ask(path, compile_of())  # served meanwhile, within the budget
        assert head.split()[0] in ("COMPILE", "HIT")
        s.settimeout(None)  # (waits for the gate's own deadline, however long it takes here)
        assert s.recv(100) == b""  # dropped at its deadline: the rest never came
    eventually(lambda: g.gate.budget.used == 0, "nothing held after it")
