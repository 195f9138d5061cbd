"""etcd out of space (a real etcd with a small quota): past it etcd raises its
NOSPACE alarm and refuses writes. Decisions say so and fall back to compiling
locally, `status` names the alarm, and after the documented recovery
(compact, defragment, disarm) the coordinator serves again by itself."""

from __future__ import annotations

import os
import subprocess

from compilecast.coordinator.server import Coordinator
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import EtcdProcess, coordinator_config, publish


def etcdctl(etcd: EtcdProcess, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run(["etcdctl", f"--endpoints={etcd.endpoint}", *args], input=stdin,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "ETCDCTL_API": "3"})


def test_etcd_out_of_space_is_named_and_recovered_from(tmp_path, prefix, started):
    etcd = EtcdProcess(tmp_path, "--quota-backend-bytes=4000000")
    try:
        coord = started(Coordinator(coordinator_config(etcd, tmp_path, prefix)))
        c = CacheClient(coord.cfg.listen)
        data = os.urandom(1 << 20)
        publish(c, "before", data)
        ballast = "x" * 200_000  # someone else's data fills etcd past its quota
        for i in range(100):
            if etcdctl(etcd, "put", f"/ballast/{i}", stdin=ballast).returncode:
                break
        assert "NOSPACE" in etcdctl(etcd, "alarm", "list").stdout

        resp = c.acquire("new")
        assert resp.decision == pb.COMPILE_LOCALLY
        assert "etcd is out of space" in resp.reason and "compacts" in resp.reason
        assert c.acquire("before").decision == pb.HIT  # reads still work
        assert c.fetch("before")[1] == data
        st = c.status()
        assert not st.upstream_healthy and "NOSPACE" in st.upstream_problem
        assert coord.registry.get_sample_value(
            "compilecast_coordinator_etcd_unavailable_total") >= 1

        # docs/operations.md, "etcd out of space": delete, compact, defragment, disarm.
        assert etcdctl(etcd, "del", "--prefix", "/ballast/").returncode == 0
        revision = etcdctl(etcd, "endpoint", "status", "-w", "json").stdout
        rev = int(revision.split('"revision":')[1].split(",")[0])
        assert etcdctl(etcd, "compact", str(rev)).returncode == 0
        assert etcdctl(etcd, "defrag").returncode == 0
        assert etcdctl(etcd, "alarm", "disarm").returncode == 0

        st = c.status()
        assert st.upstream_healthy and st.upstream_problem == ""
        again = c.acquire("new")
        assert again.decision == pb.COMPILE, again
        c.publish("new", again.lease, data, 1.0)
        assert c.acquire("new").decision == pb.HIT
    finally:
        etcd.stop()


def test_status_names_an_unreachable_etcd(tmp_path, prefix, started):
    etcd = EtcdProcess(tmp_path)
    coord = started(Coordinator(coordinator_config(etcd, tmp_path, prefix)))
    etcd.stop()
    st = CacheClient(coord.cfg.listen, timeout_s=10).status()
    assert not st.upstream_healthy and st.upstream_problem.startswith("etcd unreachable: ")
    # In a few words, not gRPC's chain of resolver errors.
    assert "failed to connect" not in st.upstream_problem, st.upstream_problem
