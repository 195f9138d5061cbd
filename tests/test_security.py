"""Authentication, authorization, tenants and TLS, against real servers."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from compilecast.grpcutil import TlsFiles
from compilecast.negotiate import Route
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import CALL_ERRORS, status_code

DATA = b"executable" * 10_000
@pytest.fixture
def secured(start_coordinator, tokens_file):
    return start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(CALL_ERRORS) as info:
        fn()
    return status_code(info.value)


def test_calls_without_a_valid_token_are_unauthenticated(secured):
    target = secured.cfg.listen
    assert code_of(lambda: CacheClient(target).acquire("k")) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: CacheClient(target, token="nope").acquire("k")) == \
        grpc.StatusCode.UNAUTHENTICATED
    raw = grpc.insecure_channel(target)
    stub = __import__("compilecast.v1.cache_pb2_grpc", fromlist=["x"]).CompileCacheStub(raw)
    assert code_of(lambda: stub.Acquire(pb.AcquireRequest(key="k"), timeout=5,
                                        metadata=(("authorization", "Basic abc"),))) == \
        grpc.StatusCode.UNAUTHENTICATED


def test_a_reader_never_gets_a_lease_and_cannot_publish(secured):
    reader = CacheClient(secured.cfg.listen, token="a-read")
    resp = reader.acquire("k")
    assert resp.decision == pb.COMPILE_LOCALLY and "may not publish" in resp.reason
    forged = pb.Lease(id=1, ttl_seconds=10, revision=1)
    assert code_of(lambda: reader.publish("k", forged, DATA, 1.0)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert secured.store.count() == 0


def test_tenants_never_see_each_other(secured):
    a, b = CacheClient(secured.cfg.listen, token="a-pub"), CacheClient(secured.cfg.listen,
                                                                       token="b-pub")
    lease_a = a.acquire("k").lease
    # Tenant b has its own namespace: the same key is a fresh miss there.
    resp_b = b.acquire("k")
    assert resp_b.decision == pb.COMPILE
    # b cannot publish into a's namespace with a's lease.
    assert code_of(lambda: b.publish("k", lease_a, b"evil" * 100, 1.0)) == \
        grpc.StatusCode.FAILED_PRECONDITION
    a.publish("k", lease_a, DATA, 1.0)
    assert code_of(lambda: b.fetch("k")) == grpc.StatusCode.NOT_FOUND
    assert CacheClient(secured.cfg.listen, token="a-read").fetch("k")[1] == DATA
    assert b.status().artifacts == 0 and a.status().artifacts == 1
    assert [x.artifact.key for x in CacheClient(secured.cfg.listen, token="a-read")
            .list_artifacts()] == ["k"]
    assert list(b.list_artifacts()) == []


def test_a_publish_with_another_jobs_lease_is_refused(secured):
    job1 = CacheClient(secured.cfg.listen, token="a-pub",
                       identity=Identity(job="job-1", process_id=0, designated_process=0))
    job2 = CacheClient(secured.cfg.listen, token="a-pub",
                       identity=Identity(job="job-2", process_id=0, designated_process=0))
    lease = job1.acquire("k").lease
    assert code_of(lambda: job2.publish("k", lease, b"other" * 100, 1.0)) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert secured.store.count() == 0
    job1.publish("k", lease, DATA, 1.0)


def test_per_job_tokens_through_a_worker_keep_host_cache_namespaces(secured, start_worker):
    worker = start_worker(secured.cfg.listen)
    a = CacheClient(worker.target, token="a-pub")
    a.publish("k", a.acquire("k").lease, DATA, 1.0)
    assert a.acquire("k").decision == pb.HIT  # host hit for the same credential
    b = CacheClient(worker.target, token="b-pub")
    assert b.acquire("k").decision == pb.COMPILE  # not a's entry
    anon = CacheClient(worker.target)  # the worker has no token of its own here
    assert code_of(lambda: anon.fetch("k")) == grpc.StatusCode.UNAUTHENTICATED


# -- TLS -----------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=compilecast-test-ca", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf",
                 cwd=d)
    return d


def test_tls_coordinator_refuses_plaintext_and_serves_tls_clients(start_coordinator, pki,
                                                                  start_worker):
    c = start_coordinator(tls_cert_file=str(pki / "server.pem"),
                          tls_key_file=str(pki / "server.key"))
    plain = CacheClient(c.cfg.listen, timeout_s=3)
    assert code_of(lambda: plain.acquire("k")) == grpc.StatusCode.UNAVAILABLE
    tls = CacheClient(c.cfg.listen, tls=TlsFiles(str(pki / "ca.pem")))
    tls.publish("k", tls.acquire("k").lease, DATA, 1.0)
    worker = start_worker(c.cfg.listen, coordinator_ca_file=str(pki / "ca.pem"))
    assert CacheClient(worker.target).fetch("k")[1] == DATA
    # No plaintext data plane next to a TLS port (its tickets would travel in the clear).
    assert c.data_plane is None and not tls.routes.on(Route.DATA_PLANE)
    assert tls.fetch("k")[1] == DATA


def test_no_relay_data_plane_where_the_relay_serves_tls(start_coordinator, start_worker, pki):
    """A worker whose relay port serves TLS sends no relay over its plain
    TCP data plane: its tickets would travel in the clear."""
    from compilecast.launch import free_port

    coordinator = start_coordinator()
    port = free_port()
    worker = start_worker(coordinator.cfg.listen, tls_cert_file=str(pki / "server.pem"),
                          tls_key_file=str(pki / "server.key"),
                          relay_listen=f"127.0.0.1:{port}", relay_advertise=f"127.0.0.1:{port}",
                          relay_data_listen="auto")
    assert worker.relay_server is not None and worker.parts.fetches.relay_plane is None


def test_mtls_requires_a_client_certificate(start_coordinator, pki, start_worker):
    c = start_coordinator(tls_cert_file=str(pki / "server.pem"),
                          tls_key_file=str(pki / "server.key"),
                          tls_client_ca_file=str(pki / "ca.pem"))
    no_cert = CacheClient(c.cfg.listen, tls=TlsFiles(str(pki / "ca.pem")), timeout_s=3)
    assert code_of(lambda: no_cert.acquire("k")) == grpc.StatusCode.UNAVAILABLE
    worker = start_worker(c.cfg.listen, coordinator_ca_file=str(pki / "ca.pem"),
                          coordinator_cert_file=str(pki / "client.pem"),
                          coordinator_key_file=str(pki / "client.key"))
    assert CacheClient(worker.target).acquire("k").decision == pb.COMPILE


def test_a_reader_cannot_queue_or_take_farm_compiles(secured):
    reader = CacheClient(secured.cfg.listen, token="a-read")
    recipe = pb.Recipe(entry="m:f", target=pb.Target(platform="tpu", topology="v5e:2x2"))
    assert code_of(lambda: reader.submit([recipe])) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: reader.claim("w", 0)) == grpc.StatusCode.PERMISSION_DENIED
    publisher = CacheClient(secured.cfg.listen, token="a-pub")
    [task] = publisher.submit([recipe])
    # Another tenant's farm never sees the task.
    assert not CacheClient(secured.cfg.listen, token="b-pub").claim("w", 0).task_id
    assert publisher.claim("w", 0).task_id == task
