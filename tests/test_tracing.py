"""Tracing (compilecast/tracing.py): one compile request followed from the
JAX process through the worker to the coordinator and etcd, as one trace.
First in one process with the SDK's in-memory exporter, then across three
processes (a JAX process, a worker, a coordinator) exporting over OTLP/HTTP
to a collector of the test's own."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import uuid

from compilecast import tracing
from compilecast.launch import free_port
from compilecast.worker.inprocess.client import wait_until_healthy

from .conftest import eventually

JAX_PROCESS = r"""
import json, os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
import jax, jax.numpy as jnp
import compilecast.jax
assert compilecast.jax.enable() is not None
print(json.dumps({"sum": float(jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(jnp.arange(7.0)).sum())}))
"""


def chain(spans: list[dict]) -> list[str]:
    """The span names from the root down to the coordinator's decision, by
    parent ids."""
    by_id = {s["span_id"]: s for s in spans}
    leaf = next(s for s in spans if s["name"] == "coordinator.decide")
    names = []
    while leaf is not None:
        names.append(f"{leaf['service']}:{leaf['name']}")
        leaf = by_id.get(leaf["parent"])
    return names[::-1]


def test_one_trace_in_one_process(start_coordinator, start_worker):
    import jax
    import jax.numpy as jnp
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import compilecast.jax

    exporter = InMemorySpanExporter()
    assert tracing.configure("", "compilecast-test", exporter=exporter)
    try:
        coordinator = start_coordinator()  # their servers trace from their start
        worker = start_worker(coordinator.cfg.listen, "w")
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        assert compilecast.jax.enable(worker.target) is not None
        try:
            jax.jit(lambda x: jnp.cos(x) * 7 - 3)(jnp.arange(9.0)).block_until_ready()
        finally:
            compilecast.jax.disable()
            os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
        tracing.shutdown()  # (exports what is left)
        spans = [{"name": s.name, "trace": s.context.trace_id, "span_id": s.context.span_id,
                  "parent": s.parent.span_id if s.parent else None, "service": "test"}
                 for s in exporter.get_finished_spans()]
    finally:
        tracing.shutdown()
    names = chain(spans)
    assert names[0] == "test:compilecast.decide", names
    assert names[1:] == ["test:WorkerService.Acquire", "test:worker.upstream.decide",
                         "test:coordinator.decide"], names
    decide = next(s for s in spans if s["name"] == "coordinator.decide")
    etcd = [s for s in spans if s["name"].startswith("etcd.") and s["parent"] == decide["span_id"]]
    assert etcd, [s["name"] for s in spans]  # its etcd transaction, in the same trace
    root = next(s for s in spans if s["parent"] is None and s["trace"] == decide["trace"])
    assert root["name"] == "compilecast.decide"  # one trace, from the JAX process's decision


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span it is sent, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes
                                    if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        collector.spans.extend(
                            {"name": s.name, "trace": s.trace_id.hex(),
                             "span_id": s.span_id.hex(), "service": service,
                             "parent": s.parent_span_id.hex() or None,
                             "start": s.start_time_unix_nano, "end": s.end_time_unix_nano}
                            for s in ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def test_one_trace_spans_a_jax_process_a_worker_and_a_coordinator(etcd, tmp_path):
    collector = Collector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILECAST_")}
    env["COMPILECAST_OTLP_ENDPOINT"] = collector.url
    coordinator = f"127.0.0.1:{free_port()}"
    sock = f"unix:///tmp/cc-{uuid.uuid4().hex[:8]}.sock"
    cli = [sys.executable, "-m", "compilecast.cli", "--log-level", "warning"]
    procs = [subprocess.Popen([*cli, "coordinator", "--listen", coordinator,
                               "--etcd-endpoints", etcd.endpoint, "--etcd-prefix",
                               f"/tracing-{uuid.uuid4().hex[:6]}",
                               "--store-dir", str(tmp_path / "store"), "--metrics-port", "0",
                               "--allow-unauthenticated", "true"], env=env)]
    try:
        wait_until_healthy(coordinator, 60)
        procs.append(subprocess.Popen([*cli, "worker", "--listen", sock, "--coordinator",
                                       coordinator, "--cache-dir", str(tmp_path / "cache"),
                                       "--metrics-port", "0"], env=env))
        wait_until_healthy(sock, 60)
        done = subprocess.run([sys.executable, "-c", JAX_PROCESS], capture_output=True,
                              text=True, timeout=300, env={**env, "COMPILECAST_WORKER": sock})
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["sum"]

        def joined():
            try:
                return chain(list(collector.spans))
            except StopIteration:  # the coordinator's decision not exported yet
                return None
        names = eventually(lambda: (n := joined()) and n[0].startswith("compilecast-jax:")
                           and n, "the coordinator's decision in the JAX process's trace",
                           seconds=60)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        collector.shutdown()
        collector.server_close()
    assert names == ["compilecast-jax:compilecast.decide",
                     "compilecast-worker:WorkerService.Acquire",
                     "compilecast-worker:worker.upstream.decide",
                     "compilecast-coordinator:coordinator.decide"], names
    trace = {s["trace"] for s in collector.spans if s["name"] == "coordinator.decide"}
    services = {s["service"] for s in collector.spans if s["trace"] in trace}
    assert services == {"compilecast-jax", "compilecast-worker", "compilecast-coordinator"}


EXITS_TRACED = r"""
import sys
from compilecast import tracing
assert tracing.configure(sys.argv[1], "compilecast-exit-test")
with tracing.span("one"):
    pass
print("done", flush=True)
"""


def test_an_endpoint_that_never_answers_does_not_hold_a_process_at_exit():
    """The collector takes the connection and never answers: the process
    exits all the same (its last spans dropped), with the export still
    waiting for an answer that never comes."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # connections complete in the backlog; nobody answers
        port = server.getsockname()[1]
        proc = subprocess.run([sys.executable, "-c", EXITS_TRACED, f"http://127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr
        server.settimeout(10)
        conn, _ = server.accept()  # the export had begun: its request waits here, unanswered
        with conn:
            assert conn.recv(4096).startswith(b"POST /v1/traces")


JAX_BELOW_THRESHOLD = r"""
import json, os
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
import compilecast.jax
assert compilecast.jax.enable() is not None
print(json.dumps({"sum": float(jax.jit(lambda x: jnp.sin(x) * 5)(jnp.arange(3.0)).sum()),
                  "stats": compilecast.jax.stats()}))
"""


def test_up_traces_each_role_as_its_own_service_and_a_release_joins_its_decision(start_up):
    """`compilecast up` serves a coordinator and a worker in one process:
    each role's spans go out as its own service. A compile below JAX's
    threshold gives its lease back: the release is in the trace of the
    decision that granted it."""
    collector = Collector()
    try:
        up = start_up({"COMPILECAST_OTLP_ENDPOINT": collector.url})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILECAST_", "JAX_"))}
        done = subprocess.run([sys.executable, "-c", JAX_BELOW_THRESHOLD], capture_output=True,
                              text=True, timeout=300,
                              env={**env, "COMPILECAST_WORKER": up.target,
                                   "COMPILECAST_OTLP_ENDPOINT": collector.url})
        assert done.returncode == 0, done.stderr[-3000:]
        released = json.loads(done.stdout.strip().splitlines()[-1])["stats"]["released"]
        assert released >= 1  # (the step, and the eager ops' programs)

        def spans_of(name: str) -> list[dict]:
            return [s for s in list(collector.spans) if s["name"] == name]

        eventually(lambda: spans_of("coordinator.decide") and
                   len(spans_of("WorkerService.Release")) == released,
                   "the decisions and the releases exported", seconds=60)
    finally:
        collector.shutdown()
        collector.server_close()
    services = {s["name"]: s["service"] for s in collector.spans}
    assert services["WorkerService.Acquire"] == services["worker.upstream.decide"] == \
        services["WorkerService.Release"] == "compilecast-worker", services
    assert services["coordinator.decide"] == "compilecast-coordinator", services
    decisions = {s["trace"] for s in collector.spans if s["name"] == "compilecast.decide"}
    releases = spans_of("WorkerService.Release")
    assert all(r["trace"] in decisions and r["parent"] for r in releases), (releases, decisions)

