"""The hits workers report (ReportHits): only a worker identity reports,
each tenant counts and sees its own, and each reporter is bounded. Real
etcd, coordinator and workers on loopback."""

from __future__ import annotations

import grpc
import pytest

from compilecast.coordinator.operations import HitReports, reporter_host
from compilecast.errors import TooMany
from compilecast.grpcutil import bearer
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually, publish


def report(target: str, token: str, hits: int, seconds: float) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as ch:
        try:
            rpc.CompileCacheStub(ch).ReportHits(
                pb.ReportHitsRequest(hits=hits, compile_seconds_saved=seconds),
                metadata=bearer(token), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def secured(start_coordinator, tokens_file):
    return start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)


def test_only_a_worker_identity_reports_and_each_tenant_sees_its_own(secured):
    target = secured.cfg.listen
    a, b = CacheClient(target, token="a-pub"), CacheClient(target, token="b-pub")
    before_a, before_b = a.status(), b.status()
    # Another tenant's read-only token, a publisher without the worker permission: refused.
    for token in ("b-pub", "a-read", "a-pub", "b-admin"):
        assert report(target, token, 10**6, 1e6) == grpc.StatusCode.PERMISSION_DENIED
    assert report(target, "a-worker", 7, 70.0) == grpc.StatusCode.OK
    after_a, after_b = a.status(), b.status()
    assert after_a.hits == before_a.hits + 7
    assert after_a.compile_seconds_saved == pytest.approx(before_a.compile_seconds_saved + 70)
    assert (after_b.hits, after_b.compile_seconds_saved) == (before_b.hits,
                                                             before_b.compile_seconds_saved)
    # Decisions count for the tenant that asked, too.
    publish(b, "k", b"bytes")
    assert b.acquire("k").decision == pb.HIT
    assert b.status().hits == after_b.hits + 1 and b.status().misses == after_b.misses + 1
    assert a.status().hits == after_a.hits and a.status().misses == after_a.misses


def test_a_reporter_is_bounded_in_rate_and_in_seconds_a_hit(secured):
    target = secured.cfg.listen
    a = CacheClient(target, token="a-pub")
    # The reporters' clock stands still: no hit a worker answers can refill its bucket.
    secured.state.operations.reports.clock = lambda: 0.0
    start = a.status().hits
    assert report(target, "a-worker", 9_999_999, 0.0) == grpc.StatusCode.OK  # the burst
    # Right after it: far more than a host can have answered since.
    assert report(target, "a-worker", 10_000_000, 0.0) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert a.status().hits == start + 9_999_999  # the refused report counted nothing
    # A hit said to save two days counts, with a day's seconds (before: refused,
    # and the worker sent it again forever with every later hit in it).
    saved = a.status().compile_seconds_saved
    assert report(target, "a-worker", 1, 86_400.0 * 2) == grpc.StatusCode.OK
    assert a.status().hits == start + 10_000_000
    assert a.status().compile_seconds_saved == pytest.approx(saved + 86_400.0)


def test_a_reporter_s_host_is_its_address_its_loopback_or_its_ipv6_64():
    assert reporter_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert reporter_host("ipv4:127.0.0.9:5555") == reporter_host("ipv6:[::1]:1") == "loopback"
    assert reporter_host("ipv6:[2001:db8::1]:80") == reporter_host("ipv6:[2001:db8::ffff]:81")
    assert reporter_host("ipv6:[2001:db8:0:1::1]:80") != reporter_host("ipv6:[2001:db8::1]:80")
    assert reporter_host("unix:/run/cc.sock") == "unix"
    # One worker token from 20 loopback addresses: one bucket, one burst.
    reports = HitReports(clock=lambda: 0.0)
    reports.take(f"w@{reporter_host('ipv4:127.0.0.1:1')}", int(HitReports.BURST))
    for i in range(2, 21):
        with pytest.raises(TooMany):
            reports.take(f"w@{reporter_host(f'ipv4:127.0.0.{i}:1')}", 1000)


def test_the_bucket_refills_with_time_and_forgets_the_oldest_reporters():
    now = [0.0]
    reports = HitReports(clock=lambda: now[0])
    reports.take("w@host1", int(HitReports.BURST))
    with pytest.raises(TooMany):
        reports.take("w@host1", 1000)
    reports.take("w@host2", 1000)  # another host's worker: a bucket of its own
    now[0] += 1.0
    reports.take("w@host1", int(HitReports.HITS_PER_S))
    with pytest.raises(TooMany):
        reports.take("w@host1", 1)
    reports.REPORTERS_MAX = 2
    reports.take("w@host3", 1)
    assert len(reports._buckets) == 2


def test_a_worker_reports_its_host_hits_with_its_token(secured, start_worker, tmp_path):
    token = tmp_path / "worker.token"
    token.write_text("a-worker")
    worker = start_worker(secured.cfg.listen, token_file=str(token))
    c = CacheClient(worker.target)  # acts as the worker: tenant team-a
    publish(c, "k", b"executable")
    start = CacheClient(secured.cfg.listen, token="a-pub").status().hits
    for _ in range(3):
        assert c.acquire("k").decision == pb.HIT  # the host cache answers
    worker.lt.run(worker.parts.hits.report_now())
    eventually(lambda: CacheClient(secured.cfg.listen, token="a-pub").status().hits >= start + 3,
               "team-a counts the worker's hits")


def test_a_token_no_header_can_carry_is_refused_before_it_is_sent(secured, tmp_path):
    import subprocess
    import sys

    from compilecast.errors import Unauthenticated
    from compilecast.grpcutil import bearer

    for token in ("tök€n", "with space", "x" * 5000, "new\nline"):
        with pytest.raises(Unauthenticated) as err:
            bearer(token)
        assert "printable ASCII" in str(err.value) and "0x" not in str(err.value)
    out = subprocess.run([sys.executable, "-m", "compilecast.cli", "ls", "--coordinator",
                          secured.cfg.listen, "--token", "tök€n"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "printable ASCII" in out.stderr
