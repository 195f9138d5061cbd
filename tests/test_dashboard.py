"""The dashboard's queries against a real run, as a real Prometheus scrapes
it: its hit ratio and compile time saved count the hits the workers answer
from their host caches, and agree with `compilecast status` on the
coordinator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from compilecast.launch import free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually, publish

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

pytestmark = pytest.mark.slow


def dashboard_exprs() -> dict[str, str]:
    board = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    return {f"{p['title']}/{t.get('legendFormat', '')}": t["expr"]
            for p in board["panels"] for t in p.get("targets", [])}


class Prometheus:
    def __init__(self, root: Path, targets: list[str]) -> None:
        if not os.path.exists(PROMETHEUS):
            pytest.fail(f"{PROMETHEUS} is missing: `make install` installs it (Debian's "
                        "prometheus)")
        self.port = free_port()
        config = root / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "compilecast",
                                "static_configs": [{"targets": targets}]}]}))
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(self, expr: str) -> float | None:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                result = json.load(r)["data"]["result"]
        except OSError:
            return None
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def test_the_dashboard_counts_host_cache_hits_as_status_does(start_coordinator, start_worker,
                                                            tmp_path):
    coordinator = start_coordinator(metrics_port=free_port())
    worker = start_worker(coordinator.cfg.listen, "w", metrics_port=free_port())
    prom = Prometheus(tmp_path, [f"127.0.0.1:{coordinator.cfg.metrics_port}",
                                 f"127.0.0.1:{worker.cfg.metrics_port}"])
    try:
        holder = CacheClient(worker.target)
        publish(holder, "k", b"an executable" * 100)
        process = CacheClient(worker.target)
        hits = 5
        for _ in range(hits):  # from the worker's host cache: never the coordinator's
            assert process.acquire("k").decision == pb.HIT
        # The worker's report reaches the coordinator; status counts it there.
        direct = CacheClient(coordinator.cfg.listen)
        eventually(lambda: direct.status().hits >= hits, "the host hits reported", seconds=60)
        status = direct.status()
        # What the worker counted is what the coordinator shows, reported.
        assert status.hits == worker.registry.get_sample_value(
            "compilecast_worker_lookups_total", {"result": "host_hit"}) == hits
        exprs = dashboard_exprs()
        ratio = next(e for k, e in exprs.items() if k.startswith("Hit ratio/fleet"))
        saved = next(e for k, e in exprs.items() if k.startswith("Compile time saved/"))
        saved_total = saved.replace("rate(", "max_over_time(")  # the counter's total
        # Prometheus has scraped the reported counts: the dashboard's sums agree
        # with the coordinator's status (totals over the run), and its hit
        # ratio counts the host-cache hits.
        eventually(lambda: prom.query(saved_total) == pytest.approx(
            status.compile_seconds_saved), "Prometheus scraped the reported counts", seconds=60)
        eventually(lambda: (prom.query(ratio) or 0) > 0, "a hit ratio", seconds=60)
        hits_now = prom.query(
            'sum(max_over_time(compilecast_coordinator_lookups_total{result=~"hit|host_hit"}'
            '[5m]))')
        assert hits_now == status.hits
        coordinator_only = prom.query(
            'sum(rate(compilecast_coordinator_lookups_total{result="hit"}[5m])) / '
            'sum(rate(compilecast_coordinator_lookups_total[5m]))') or 0.0
        assert prom.query(ratio) > coordinator_only
    finally:
        prom.stop()
