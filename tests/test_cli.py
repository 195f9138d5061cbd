"""The command line: readable errors, status exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import CALL_ERRORS, cc, eventually, key_recorded, status_code


def test_status_is_nonzero_when_nothing_runs(tmp_path):
    r = cc("status", "--worker", f"unix://{tmp_path}/none.sock", "--timeout", "1")
    assert r.returncode != 0
    assert "unreachable: no socket at that path; is `compilecast up`" in r.stdout
    assert "FAILED_PRECONDITION" not in r.stdout  # gRPC's own chain of context


def test_a_server_that_cannot_be_reached_is_said_in_a_few_words(tmp_path):
    """Client commands say why a server could not be asked and where to
    look, not gRPC's resolver and subchannel chain."""
    from compilecast.launch import free_port

    for target, why in ((f"127.0.0.1:{free_port()}", "connection refused"),
                        (f"unix://{tmp_path}/none.sock", "no socket at that path")):
        r = cc("ls", "--coordinator", target)
        assert r.returncode == 2, r.stderr
        assert r.stderr == (f"compilecast: {target}: unreachable: {why}; is a coordinator or "
                            "worker listening there? (--coordinator or COMPILECAST_COORDINATOR "
                            "names another)\n"), r.stderr
    key = "cc1-" + "0" * 64
    r = cc("explain", key, key, "--worker", f"unix://{tmp_path}/none.sock")
    assert r.returncode == 2 and "unreachable: no socket at that path; is `compilecast up`" \
        in r.stderr, r.stderr


def test_status_is_zero_against_a_healthy_worker(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    r = cc("status", "--worker", worker.target)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "healthy" in r.stdout and "artifacts" in r.stdout
    assert "stored, unbounded; 0 revoked" in r.stdout
    assert "host cache   0 B of 20.0 GiB (disk: " in r.stdout
    assert "2.0 GiB kept free for jobs)" in r.stdout
    # The coordinator's own load, passed on by the worker (sampled every 250 ms).
    deadline = time.monotonic() + 10
    while (st := json.loads(cc("status", "--worker", worker.target, "--json").stdout)) \
            .get("coordinatorLoopBusy", 0) <= 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert 0 < st["coordinatorLoopBusy"] < 1 and st["decideGapMs"] == 0, st
    assert "load         the coordinator's event loop used " in \
        cc("status", "--worker", worker.target).stdout


def test_status_shows_how_long_the_coordinators_etcd_writes_take(coordinator, start_worker):
    from compilecast.v1 import cache_pb2 as pb
    from compilecast.worker.inprocess.client import CacheClient, Identity

    worker = start_worker(coordinator.cfg.listen)
    before = json.loads(cc("status", "--worker", worker.target, "--json").stdout)
    client = CacheClient(worker.target, identity=Identity(client="p0"))
    try:
        for i in range(3):  # each miss claims its key in an etcd write txn
            assert client.acquire(f"etcd-latency-{i}").decision == pb.COMPILE
    finally:
        client.close()
    st = json.loads(cc("status", "--worker", worker.target, "--json").stdout)
    assert st["etcdWritesSampled"] >= before.get("etcdWritesSampled", 0) + 3, st
    assert 0 < st["etcdWriteP50Ms"] <= st["etcdWriteP99Ms"], st
    out = cc("status", "--worker", worker.target).stdout
    assert f"etcd         the coordinator's latest {st['etcdWritesSampled']} write " \
           "transactions took p50 " in out, out


def test_status_is_nonzero_when_the_coordinator_is_down(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    coordinator.stop()
    r = cc("status", "--worker", worker.target, "--timeout", "2")
    assert r.returncode == 1
    # "unreachable: connection refused", or, when the worker's channel was
    # still connecting at the deadline (a loaded machine), "unreachable (DEADLINE_EXCEEDED...)"
    assert "UNHEALTHY (coordinator unreachable" in r.stdout, r.stdout
    assert "failed to connect" not in r.stdout, r.stdout  # a few words, not gRPC's chain


def test_bad_configuration_is_a_readable_error():
    r = cc("config", "coordinator", "--lease-ttl-s", "never", "--listen", "nowhere")
    assert r.returncode == 1
    assert "lease_ttl_s = 10    # default (flag --lease-ttl-s refused)" in r.stdout, r.stdout
    problems = [line for line in r.stderr.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 3, r.stderr  # each, not the first alone
    assert "lease_ttl_s" in problems[0] and "listen 'nowhere'" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_on_defaults_shows_the_settings_then_the_problem():
    r = cc("config", "coordinator")
    assert r.returncode == 1
    assert "etcd_endpoints = '127.0.0.1:2379'    # default" in r.stdout, r.stdout
    assert r.stderr.strip() == ("problem: set auth_tokens_file, or allow_unauthenticated "
                                "explicitly (only for loopback and tests)")


def test_config_prints_values_and_sources():
    r = cc("config", "worker", "--rpc-timeout-s", "9")
    assert r.returncode == 0
    assert "rpc_timeout_s = 9.0    # flag --rpc-timeout-s" in r.stdout


def test_status_shows_jobs_and_explained_misses(coordinator, start_worker):
    from compilecast.worker.inprocess.client import CacheClient, Identity

    # (key by key: with the job's stream, the coordinator waits once for each
    # key the job compiles, whoever waits: tests/test_job_streams.py)
    worker = start_worker(coordinator.cfg.listen, job_streams=False)
    holder = CacheClient(worker.target, identity=Identity(job="train-7", process_id=0))
    holder.acquire("k1", components={"program": "a", "platform": "cpu"},
                   program_name="jit_step")
    holder.acquire("k2", components={"program": "a", "platform": "tpu"},
                   program_name="jit_step")
    waiter = CacheClient(worker.target, identity=Identity(job="train-7", process_id=1))
    import threading

    t = threading.Thread(target=lambda: waiter.wait("k1", 3))
    t.start()

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = holder.status()
        if st.recent_misses and st.waiters:
            break
        time.sleep(0.1)
    r = cc("status", "--worker", worker.target)
    t.join()
    assert r.returncode == 0, r.stdout
    assert "job          train-7: 2 compiling, 1 waiting" in r.stdout
    assert "(platform changed)" in r.stdout


def test_explain_two_keys_the_coordinator_has_seen(coordinator, start_worker):
    """Keys are told apart by what they are, not by what was recorded of
    them: two keys whose clients sent no components are not "the same"."""
    from compilecast.worker.inprocess.client import CacheClient

    worker = start_worker(coordinator.cfg.listen)
    c = CacheClient(worker.target)
    k1, k2, k3, k4 = (f"cc1-{d * 64}" for d in "1234")
    c.acquire(k1, components={"program": "a" * 64, "platform": "cpu"}, program_name="jit_step")
    c.acquire(k2, components={"program": "a" * 64, "platform": "tpu"}, program_name="jit_step")
    for k in (k3, k4):  # published by a client that sent no components
        c.publish(k, c.acquire(k, program_name="jit_other").lease, k.encode(), 1.0)
    eventually(lambda: key_recorded(c, k2), "k2 recorded")

    r = cc("explain", k1, k2, "--worker", worker.target)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{k1}  jit_step, first seen ") and "UTC" in lines[0], lines
    assert lines[1].startswith(f"{k2}  jit_step, first seen "), lines
    assert lines[2:] == ["component platform differs: cpu vs tpu"], lines

    r = cc("explain", k3, k4, "--worker", worker.target)
    assert r.returncode == 1, r.stdout
    assert "same key" not in r.stdout
    assert f"no components were recorded for {k3}" in r.stdout, r.stdout
    assert r.stdout.startswith(f"{k3}  (no program name), published "), r.stdout
    assert "UTC (68 B)" in r.stdout

    r = cc("explain", k1, k1, "--worker", worker.target)
    assert (r.returncode, r.stdout) == (0, f"same key {k1}\n")

    r = cc("explain", k1, "cc1-" + "9" * 64, "--worker", worker.target)
    assert r.returncode == 2 and "cc1-9999" in r.stderr and "Traceback" not in r.stderr


def test_a_data_directory_that_cannot_be_made_is_a_readable_error(tmp_path):
    from compilecast.launch import free_port

    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "cache"
    for role, flags in (("worker", ("--cache-dir", "--coordinator")),
                        ("coordinator", ("--store-dir", "--etcd-endpoints",
                                         "--allow-unauthenticated", "true"))):
        r = cc(role, flags[0], str(bad), flags[1], f"127.0.0.1:{free_port()}", *flags[2:],
               "--metrics-port", "0", "--listen", f"127.0.0.1:{free_port()}")
        assert r.returncode == 1, r.stderr
        assert f"compilecast {role}: cannot use {bad}" in r.stderr, r.stderr
        assert "Not a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_json_logs_carry_key_and_job(tmp_path):
    import json
    import logging

    from compilecast.cli import JsonFormatter

    rec = logging.LogRecord("compilecast.x", logging.INFO, __file__, 1, "published %s", ("k",),
                            None)
    rec.key, rec.job, rec.process_id = "default/k", "train-7", 3
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "published k"
    assert (out["key"], out["job"], out["process_id"]) == ("default/k", "train-7", 3)


def test_ls_lists_the_tenants_artifacts_a_page_at_a_time(coordinator):
    import os

    from compilecast.worker.inprocess.client import CacheClient

    c = CacheClient(coordinator.cfg.listen)
    for i, name in enumerate(["jit_step", "jit_eval", "jit_step"]):
        resp = c.acquire(f"k{i}", components={"program": f"p{i}"}, program_name=name)
        c.publish(f"k{i}", resp.lease, os.urandom(1000 * (i + 1)), float(i))
    c.acquire("claimed")  # being compiled, not published: not listed

    def named() -> list | None:
        """Two pages, once the key records (program names) are written: in the background."""
        listed = list(c.list_artifacts(page=2))
        return listed if all(a.program_name for a in listed) else None

    listed = eventually(named, "the program names recorded")
    assert [a.artifact.key for a in listed] == ["k0", "k1", "k2"]
    assert [a.program_name for a in listed] == ["jit_step", "jit_eval", "jit_step"]
    assert [a.artifact.size for a in listed] == [1000, 2000, 3000]
    r = cc("ls", "--coordinator", coordinator.cfg.listen, "--sort", "size",
           "--program", "jit_st")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["k2", "k0"]
    assert lines[-1].startswith("2 artifacts, 3.9 KiB, 2.0 s of compiles")
    import grpc

    from compilecast.v1 import cache_pb2 as pb

    try:
        c.stub.ListArtifacts(pb.ListArtifactsRequest(limit=99_999), timeout=10)
        raise AssertionError("a limit past 5,000 was accepted")
    except CALL_ERRORS as exc:
        assert status_code(exc) == grpc.StatusCode.INVALID_ARGUMENT, exc
        bad = cc("ls", "--coordinator", "127.0.0.1:1")
    assert bad.returncode != 0 and "unreachable: connection refused" in bad.stderr
    assert "Traceback" not in bad.stderr


def taken_port() -> tuple:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_taken_port_is_a_readable_error_naming_the_setting(tmp_path):
    """Each role, told to listen where another process already does, exits 1
    with a line that says where and which setting, and no traceback."""
    held, port = taken_port()
    try:
        cases = {
            "metrics_port": ("worker", "--listen", f"unix://{tmp_path}/a.sock", "--coordinator",
                             "127.0.0.1:1", "--metrics-port", str(port), "--cache-dir",
                             str(tmp_path / "a")),
            "relay_listen": ("worker", "--listen", f"unix://{tmp_path}/b.sock", "--coordinator",
                             "127.0.0.1:1", "--relay-listen", f"127.0.0.1:{port}",
                             "--metrics-port", "0", "--cache-dir", str(tmp_path / "b")),
            "listen": ("coordinator", "--listen", f"127.0.0.1:{port}", "--etcd-endpoints",
                       "127.0.0.1:1", "--store-dir", str(tmp_path / "s"), "--metrics-port",
                       "0", "--allow-unauthenticated", "true"),
        }
        for setting, args in cases.items():
            r = cc(*args)
            assert r.returncode == 1, (setting, r.stderr[-2000:])
            assert f"compilecast {args[0]}: cannot " in r.stderr, r.stderr[-2000:]
            assert f"127.0.0.1:{port} ({setting})" in r.stderr, r.stderr[-2000:]
            assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    finally:
        held.close()


def test_up_says_which_port_is_taken_and_the_launcher_starts_it_again_elsewhere(tmp_path):
    """`compilecast up` on a taken port exits with a readable line and stops
    the etcd it started; compilecast.launch.Up (the demo's, the tests' and
    the benches' launcher) then picks fresh ports and starts it again."""
    from compilecast.launch import Up

    home = tmp_path / "up"
    home.mkdir()
    up = Up(home)
    held, port = taken_port()
    up.ports["worker-metrics-port"] = port
    try:
        up.start(timeout_s=60)
        assert up.ports["worker-metrics-port"] != port
        log = up.log_path.read_text()
        assert f"compilecast up: cannot serve metrics on 127.0.0.1:{port}" in log, log[-2000:]
        assert "Traceback" not in log, log[-3000:]
        assert cc("status", "--worker", up.target).returncode == 0
    finally:
        held.close()
        if up.proc is not None:
            assert up.stop() == 0
    assert up.leftover_processes() == []


def test_a_second_worker_on_a_hosts_socket_refuses_and_the_first_serves_on(
        coordinator, start_worker, tmp_path):
    """A worker started where one already serves exits 1 saying so; it used
    to unlink the live socket and take over, leaving the first running and
    unreachable."""
    worker = start_worker(coordinator.cfg.listen)
    r = cc("worker", "--listen", worker.target, "--coordinator", coordinator.cfg.listen,
           "--metrics-port", "0", "--cache-dir", str(tmp_path / "second"))
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"cannot listen on {worker.target} (listen): another process serves it" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    r = cc("status", "--worker", worker.target)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_etcd_of_up_compacts_its_history(tmp_path):
    """`compilecast up`'s etcd keeps history only as long as told (1 h by
    default, as the chart's does): claims and waits write revisions all
    day, and an etcd never compacted fills its quota and stops writing."""
    import os

    from compilecast.launch import free_port

    port, peer = free_port(), free_port()
    # In a process of its own: start_etcd forks with a preexec_fn, and a fork
    # from this process, where other tests' gRPC threads run, trips gRPC's
    # fork handler.
    helper = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from compilecast.up import UpConfig, start_etcd, "
        f"stop_process; p = start_etcd(UpConfig(home=Path({str(tmp_path)!r}), etcd_port={port}, "
        f"etcd_peer_port={peer}, etcd_compaction_retention='1s')); print('up', flush=True); "
        "sys.stdin.read(); stop_process(p)")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    assert helper.stdout.readline().strip() == "up"

    def etcdctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["etcdctl", f"--endpoints=127.0.0.1:{port}", *args],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, "ETCDCTL_API": "3"})

    try:
        first = etcdctl("put", "k", "1", "-w", "json")
        assert first.returncode == 0, first.stderr
        old = json.loads(first.stdout)["header"]["revision"]
        assert etcdctl("put", "k", "2").returncode == 0
        assert etcdctl("get", "k", f"--rev={old}", "--print-value-only").stdout.strip() == "1"
        deadline = time.monotonic() + 30
        while "compacted" not in (r := etcdctl("get", "k", f"--rev={old}")).stderr:
            assert time.monotonic() < deadline, f"never compacted: {r.stdout} {r.stderr}"
            time.sleep(0.5)
        assert etcdctl("get", "k", "--print-value-only").stdout.strip() == "2"
    finally:
        helper.stdin.close()
        helper.wait(30)
        helper.stdout.close()


def test_a_server_that_answered_an_error_is_not_called_unreachable():
    """Only a server that could not be asked gets "unreachable" and the hint
    to look for it; one that answered (a worker relaying the coordinator's
    error as UNAVAILABLE, an INTERNAL) is quoted."""
    from compilecast.cli.inspection import SERVER_HINT, rpc_failed
    from compilecast.errors import Status, received

    def Failed(code, details):  # what the client raises for a call that ended so
        return received(Status[code], details)

    relayed = Failed("UNAVAILABLE", "coordinator: ListArtifacts: internal error")
    assert str(rpc_failed("w", relayed)) == \
        "w: UNAVAILABLE: coordinator: ListArtifacts: internal error"
    refused = Failed("UNAVAILABLE", "failed to connect to all addresses; last "
                     "error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
                     "Connection refused")
    assert str(rpc_failed("w", refused)) == f"w: unreachable: connection refused; {SERVER_HINT}"
    late = Failed("DEADLINE_EXCEEDED", "Deadline Exceeded")
    assert str(rpc_failed("w", late)) == \
        f"w: unreachable (DEADLINE_EXCEEDED: Deadline Exceeded); {SERVER_HINT}"


# -- bad input: a one-line message, never a traceback ---------------------------

def _bad_files(tmp_path) -> dict[str, str]:
    files = {"int-keys": "1: 2\n", "not-yaml": "tokens: [\n", "a-list": "- a\n- b\n",
             "strings": "tokens: [just-a-string]\n",
             "perms-5": f"tokens: [{{sha256: '{'a' * 64}', tenant: a, permissions: 5}}]\n"}
    out = {}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        out[name] = str(tmp_path / name)
    (tmp_path / "binary").write_bytes(bytes(range(256)))
    out["binary"] = str(tmp_path / "binary")
    return out


BAD_INPUTS = [
    (["worker", "--metrics-port", "70000"], "metrics_port must be a port in 0-65535"),
    (["coordinator", "--allow-unauthenticated", "1", "--metrics-port", "70000"],
     "metrics_port must be a port in 0-65535"),
    (["coordinator", "--allow-unauthenticated", "1", "--listen", "127.0.0.1:99999"],
     "port 99999 is not in 0-65535"),
    (["up", "--etcd-port", "99999"], "99999 is not a port in 0-65535"),
    (["--log-level", "garbage", "status"], "invalid choice: 'garbage'"),
    (["coordinator", "--config", "{int-keys}"], "unknown settings in"),
    (["worker", "--config", "{binary}"], "is not UTF-8 text"),
    (["coordinator", "--config", "{binary}"], "is not UTF-8 text"),
    (["coordinator", "--etcd-endpoints", "127.0.0.1:9", "--auth-tokens-file", "{not-yaml}"],
     "is not valid YAML"),
    (["coordinator", "--etcd-endpoints", "127.0.0.1:9", "--auth-tokens-file", "{a-list}"],
     "must hold a mapping with a list 'tokens'"),
    (["coordinator", "--etcd-endpoints", "127.0.0.1:9", "--auth-tokens-file", "{strings}"],
     "tokens[0] must be a mapping"),
    (["coordinator", "--etcd-endpoints", "127.0.0.1:9", "--auth-tokens-file", "{perms-5}"],
     "permissions must be a list"),
    (["coordinator", "--etcd-endpoints", "127.0.0.1:9", "--auth-tokens-file", "{binary}"],
     "is not UTF-8 text"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_not_a_traceback(tmp_path, args, message):
    files = _bad_files(tmp_path)
    r = cc(*[a.format(**files) for a in args])
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and message in r.stderr.splitlines()[-1], r.stderr


def _in_process(argv: list[str]) -> tuple[int, str]:
    """compilecast's main in this process: its status and what it wrote."""
    import contextlib
    import io

    from compilecast import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


@pytest.mark.parametrize("argv", [["key", "a\x00b"], ["explain", "a\x00b", "c"],
                                  ["ls", "--ca-file", "a\x00b"],
                                  ["ls", "--token-file", "a\x00b"]])
def test_a_file_name_the_os_cannot_take_is_answered_in_one_line(argv):
    """A file name with a NUL byte (open() raises ValueError, not OSError)."""
    code, err = _in_process(argv)
    assert code in (1, 2), (argv, code, err)
    assert "embedded null byte" in err and "shows where" not in err, (argv, err)
    assert len(err.strip().splitlines()) == 1, err


config_values = st.one_of(st.text(max_size=30), st.integers(-2**70, 2**70).map(str),
                          st.floats(allow_nan=True, allow_infinity=True).map(str),
                          st.sampled_from(["nan", "-inf", "1e23", "99999", "0", "-1", "yes",
                                           "127.0.0.1:99999", "[1]", "{a: 1}", ""]))


@settings(max_examples=150, deadline=None)
@given(role=st.sampled_from(["coordinator", "worker"]), data=st.data())
def test_any_setting_value_is_taken_or_refused_in_one_line(role, data):
    """`compilecast config ROLE --SETTING VALUE` for any setting and any value:
    printed, or refused as a configuration error; never an error of ours."""
    import dataclasses

    from compilecast.config import CoordinatorConfig, WorkerConfig, flag_name

    cls = CoordinatorConfig if role == "coordinator" else WorkerConfig
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    value = data.draw(config_values)
    argv = ["config", role, flag_name(name), value]
    if role == "coordinator" and name != "allow_unauthenticated":
        argv += ["--allow-unauthenticated", "true"]
    code, err = _in_process(argv)
    assert code in (0, 1, 2), (argv, code, err)
    assert "shows where" not in err and "Traceback" not in err, (argv, err)


@settings(max_examples=150, deadline=None)
@given(argv=st.lists(st.one_of(st.sampled_from(
    ["key", "explain", "ls", "purge", "precompile", "status", "config", "--raw", "--json",
     "--digest", "--timeout", "--worker", "--coordinator", "--topology", "--entry", "--replay",
     "--sort", "--check", "-", "--log-level", "--log-format", "x:y", "0", "-1", "nan"]),
    st.text(max_size=12)), max_size=6))
def test_any_command_line_is_answered_without_a_traceback(argv):
    """Random command lines against no server (status, ls and the like find
    nothing listening): a status and a message, never an error of ours."""
    argv = [a for a in argv if a != "-"]  # (stdin: the test's own)
    argv = [*argv, "--timeout", "0.2"] if argv[:1] == ["status"] else argv
    code, err = _in_process(["--log-level", "critical", *argv] if argv[:1] == ["up"] else argv)
    assert isinstance(code, int), (argv, code)
    assert "shows where" not in err and "Traceback" not in err, (argv, err)


def test_a_relative_unix_address_is_one_line_at_every_command():
    for args in (("status", "--worker", "unix://rel"), ("ls", "--coordinator", "unix://rel"),
                 ("explain", "a", "b", "--worker", "unix://rel")):
        r = cc(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.strip().count("\n") == 0, (args, r.stderr)
        assert "unix:///absolute/path" in r.stderr


def test_a_worker_makes_its_socket_s_directory_but_never_a_tree_of_them(tmp_path):
    missing = tmp_path / "missing"
    r = cc("worker", "--listen", f"unix://{missing}/dir/w.sock", "--coordinator", "127.0.0.1:1",
           "--cache-dir", str(tmp_path / "cache"), "--metrics-port", "0")
    assert r.returncode != 0 and "make its parent first" in r.stderr, r.stderr
    assert not missing.exists()


def test_a_job_named_by_dots_alone_is_refused():
    from compilecast import validate
    from compilecast.errors import InvalidRequest

    for name in (".", "..", "..."):
        with pytest.raises(InvalidRequest, match="not dots alone"):
            validate.job(name)
    assert validate.job("train.v2..a") == "train.v2..a"
