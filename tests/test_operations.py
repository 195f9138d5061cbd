"""Operator-facing surfaces: health checking, reflection, metric naming."""

from __future__ import annotations

import re

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from compilecast.coordinator.metrics import CoordinatorMetrics
from compilecast.worker.daemon.metrics import WorkerMetrics


def test_health_and_reflection_on_both_servers(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    for target in (coordinator.cfg.listen, worker.target):
        ch = grpc.insecure_channel(target)
        for service in ("", "compilecast.v1.CompileCache"):
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for s in answer.list_services_response.service}
        assert {"compilecast.v1.CompileCache", "grpc.health.v1.Health"} <= names
        ch.close()


NAME = re.compile(r"^compilecast_(coordinator|worker)_[a-z][a-z0-9_]*$")
UNITS = ("_seconds", "_bytes")


def test_metric_names_follow_prometheus_conventions():
    for cls in (CoordinatorMetrics, WorkerMetrics):
        registry = CollectorRegistry()
        cls(registry)
        families = list(registry.collect())
        assert families
        for fam in families:
            assert NAME.match(fam.name), fam.name
            assert fam.documentation, fam.name
            # No unbounded label values: never a key, job or digest as a label.
            for sample in fam.samples:
                assert not {"key", "job", "digest", "client"} & set(sample.labels), sample
            if fam.type == "counter":
                assert not fam.name.endswith("_total")  # the client appends _total
            if fam.type == "histogram":
                assert fam.name.endswith(UNITS), fam.name
            if "bytes" in fam.name or "seconds" in fam.name:  # the unit is the suffix
                assert fam.name.endswith(UNITS), fam.name
