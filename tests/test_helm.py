"""The Helm chart: lint, render every ci/*-values.yaml scenario, and check the
rendered objects (kinds, labels, selectors that match, ports, probes,
resources), plus the value combinations the chart must refuse."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "compilecast"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))


def helm_binary() -> str:
    for candidate in (os.environ.get("HELM"), str(ROOT / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.path.exists(candidate):
            return candidate
    pytest.fail("helm is not installed: run `make install` (builds bin/helm from the Go module proxy)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def render(values: Path | None = None, *sets: str) -> list[dict]:
    args = ["template", "rel", str(CHART)]
    if values:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_lint_is_clean(values):
    r = helm("lint", "--strict", str(CHART), "-f", str(values))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_rendered_objects_are_consistent(values):
    docs = render(values)
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet") + \
        by_kind(docs, "StatefulSet")
    assert {w["kind"] for w in workloads} >= {"Deployment", "DaemonSet"}
    pod_labels = []
    for w in workloads:
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]
        assert "app.kubernetes.io/component" in selector
        pod_labels.append(labels)
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["resources"]["requests"], c["name"]
            assert "readinessProbe" in c, c["name"]
    # Every Service and PDB selects some workload's pods.
    for obj in by_kind(docs, "Service") + by_kind(docs, "PodDisruptionBudget"):
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        assert any(sel.items() <= labels.items() for labels in pod_labels), obj["metadata"]
    # Service target ports exist on the selected containers.
    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        names = {p.get("name") for w in workloads
                 if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
                 for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port.get("targetPort", port["name"]) in names, (svc["metadata"]["name"], port)
    for obj in docs:
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_share_binary_timeout_and_lease_ttl_reach_the_processes():
    docs = render(None, "cache.shareBinaryTimeoutMs=123000", "cache.leaseTtlSeconds=7")
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["data"]["COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS"] == "123000"
    assert cm["data"]["COMPILECAST_LEASE_TTL_S"] == "7"
    (ds,) = by_kind(docs, "DaemonSet")
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--share-binary-between-hosts-timeout-ms=123000" in args
    (dep,) = by_kind(docs, "Deployment")
    env_from = dep["spec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert env_from[0]["configMapRef"]["name"] == cm["metadata"]["name"]


def test_the_relay_data_plane_port_reaches_the_worker():
    def worker(*sets: str) -> tuple[list[str], set[int]]:
        (ds,) = by_kind(render(None, *sets), "DaemonSet")
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        return c["args"], {p["containerPort"] for p in c["ports"]}

    args, ports = worker()
    assert "--relay-data-listen=0.0.0.0:7645" in args and 7645 in ports
    for off in ("worker.relay.dataPort=0", "tls.secretName=certs"):
        args, ports = worker(off)
        assert "--relay-data-listen=off" in args and 7645 not in ports, off
    # The flags parse as the worker's settings.
    from compilecast.cli import build_parser

    flags = [a for a in worker("worker.relay.dataPort=7777")[0] if a.startswith("--relay")]
    parsed = build_parser().parse_args(["worker", "--coordinator", "c:1", *flags])
    assert parsed.relay_data_listen == "0.0.0.0:7777"


def test_the_relay_fanout_reaches_the_coordinator_as_a_setting_it_reads():
    from compilecast.config import CoordinatorConfig, load

    def coordinator_config(*sets: str):
        (cm,) = by_kind(render(None, *sets), "ConfigMap")
        # auth comes as a flag and a Secret, not in the ConfigMap
        cfg, sources = load(CoordinatorConfig, env=cm["data"], flags={"allow_unauthenticated": True})
        assert sources["relay_fanout"] == "env COMPILECAST_RELAY_FANOUT"
        return cfg

    assert coordinator_config().relay_fanout == 2
    assert coordinator_config("worker.relay.fanout=1").relay_fanout == 1
    assert coordinator_config("worker.relay.chainBytes=16Mi").relay_chain_bytes == 16 << 20
    assert coordinator_config().relay_chain_bytes == 1 << 20
    for bad, name in (("worker.relay.fanout=-1", "fanout"), ("worker.relay.chainBytes=lots",
                                                            "chainBytes")):
        r = helm("template", "rel", str(CHART), "--set", bad)
        assert r.returncode != 0 and name in r.stderr


def test_the_store_bound_reaches_the_coordinator_as_a_size_it_parses():
    from compilecast.cli import build_parser
    from compilecast.config import parse_size

    def store_bound(*sets: str) -> int:
        (dep,) = by_kind(render(None, *sets), "Deployment")
        args = build_parser().parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
        return parse_size(args.store_max_bytes or 0)

    assert store_bound() == 180 << 30  # the default: below the 200Gi volume
    assert store_bound("coordinator.storage.maxBytes=500M") == 500_000_000
    assert store_bound("coordinator.storage.maxBytes=0") == 0  # unbounded


def test_the_coordinator_serves_its_data_plane_at_its_own_address():
    """Tickets name the replica that issued them (its pod IP), whose port the
    pod and the network policy open; with TLS, or dataPort 0, it is off."""
    from compilecast.cli import build_parser
    from compilecast.config import CoordinatorConfig

    def coordinator(*sets: str):
        docs = render(None, *sets)
        (dep,) = by_kind(docs, "Deployment")
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        args = vars(build_parser().parse_args(c["args"]))
        env = {e["name"]: e for e in c.get("env", [])}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        policy = [p["port"] for d in by_kind(docs, "NetworkPolicy")
                  if d["metadata"]["name"].endswith("-coordinator")
                  for rule in d["spec"]["ingress"] for p in rule["ports"]]
        return args, env, ports, policy

    args, env, ports, policy = coordinator()
    assert args["data_listen"] == "0.0.0.0:7644" and ports["data"] == 7644 and 7644 in policy
    assert args["data_advertise"] == "$(POD_IP):7644"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    CoordinatorConfig(data_listen=args["data_listen"],
                      data_advertise=args["data_advertise"].replace("$(POD_IP)", "10.1.2.3"),
                      allow_unauthenticated=True
                      ).validate()
    for sets in (("tls.secretName=certs",), ("coordinator.dataPort=0",)):
        args, _, ports, policy = coordinator(*sets)
        assert args["data_listen"] == "off" and "data" not in ports and 7644 not in policy


def test_worker_args_are_accepted_by_the_cli():
    """Every flag the chart passes exists in `compilecast worker`/`coordinator`."""
    from compilecast.cli import build_parser

    docs = render(CHART / "ci" / "gke-tpu-values.yaml")
    parser = build_parser()
    for w in by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet"):
        args = w["spec"]["template"]["spec"]["containers"][0]["args"]
        parsed = parser.parse_args(args)
        assert parsed.command in ("coordinator", "worker", "farm")


def test_the_worker_keeps_its_host_cache_at_the_nodes_path_for_pods_to_read():
    """Pods read host cache hits from files at the path the worker hands out:
    the worker must see its cache at the node's path too, as pods mount it."""
    from compilecast.cli import build_parser
    from compilecast.config import WorkerConfig, load

    def worker(*sets: str) -> tuple[WorkerConfig, dict]:
        (ds,) = by_kind(render(None, *sets), "DaemonSet")
        spec = ds["spec"]["template"]["spec"]
        args = build_parser().parse_args(spec["containers"][0]["args"])
        flags = {k: v for k, v in vars(args).items() if v is not None}
        cfg, _ = load(WorkerConfig, env={}, flags={
            f: flags[f] for f in ("cache_dir", "local_files", "listen", "coordinator")})
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        return cfg, {"mount": mounts["cache"], "node": volumes["cache"]["hostPath"]["path"]}

    cfg, cache = worker()
    assert cfg.local_files is True
    assert cfg.cache_dir == cache["mount"] == cache["node"] == "/var/cache/compilecast"
    cfg, cache = worker("worker.cache.localFiles=false", "worker.cache.hostPath=/data/cc")
    assert cfg.local_files is False
    assert cfg.cache_dir == cache["mount"] == cache["node"] == "/data/cc"
    r = helm("template", "rel", str(CHART), "--set", "worker.cache.localFiles=maybe")
    assert r.returncode != 0 and "localFiles" in r.stderr


def test_the_worker_owns_its_host_directories_before_it_starts(tmp_path):
    """kubelet makes a missing hostPath directory root's (0755), where the
    worker's user could create neither its socket nor its cache: the init
    container, the only part that runs as root, hands both to that user.
    Its rendered command is run here on two such directories."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    (ds,) = by_kind(render(None, f"worker.socketDir={run}", f"worker.cache.hostPath={cache}",
                           "worker.runAsUser=4321", "worker.runAsGroup=8765"), "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                       "add": ["CHOWN", "FOWNER"]}
    assert {m["mountPath"] for m in init["volumeMounts"]} == {str(run), str(cache)}
    (worker,) = spec["containers"]
    assert (worker["securityContext"]["runAsUser"], worker["securityContext"]["runAsGroup"]) \
        == (4321, 8765)
    if os.geteuid() != 0:
        pytest.skip("running the init command needs root, as in its pod")
    for d in (run, cache):
        d.mkdir(mode=0o700)
    subprocess.run(init["command"], check=True)
    for d in (run, cache):
        st = d.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4321, 8765, 0o755)


def test_tpu_scenario_places_workers_on_tpu_nodes_and_enables_monitoring():
    docs = render(CHART / "ci" / "gke-tpu-values.yaml")
    (ds,) = by_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
    assert spec["tolerations"][0]["key"] == "google.com/tpu"
    assert len(by_kind(docs, "ServiceMonitor")) == 2
    dash = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard")]
    assert dash and "compilecast_coordinator_lookups_total" in dash[0]["data"]["compilecast.json"]
    assert not by_kind(docs, "PersistentVolumeClaim")  # existingClaim used


def test_farm_is_off_by_default_and_wired_when_enabled():
    names = [d["metadata"]["name"] for d in by_kind(render(), "Deployment")]
    assert not any(n.endswith("-farm") for n in names)
    docs = render(CHART / "ci" / "gke-tpu-values.yaml")
    (farm,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-farm")]
    spec = farm["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert "--coordinator=rel-compilecast-coordinator:7640" in args
    assert "--token-file=/etc/compilecast/token/token" in args
    assert "--cert-file=/etc/compilecast/tls/tls.crt" in args  # mTLS in this scenario
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-highmem"}
    assert farm["spec"]["replicas"] == 4
    (policy,) = [d for d in by_kind(docs, "NetworkPolicy")
                 if d["metadata"]["name"].endswith("-coordinator")]
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"app.kubernetes.io/component": "farm"}.items() <= \
        peers[1]["podSelector"]["matchLabels"].items()
    assert peers[2]["namespaceSelector"]["matchLabels"]


def test_service_monitor_is_off_by_default():
    assert by_kind(render(), "ServiceMonitor") == []


def test_replicas_over_a_bucket_share_no_volume():
    docs = render(CHART / "ci" / "s3-values.yaml")
    assert by_kind(docs, "PersistentVolumeClaim") == []
    (deploy,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith(
        "-coordinator")]
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    (store,) = [v for v in pod["volumes"] if v["name"] == "store"]
    assert store == {"name": "store", "emptyDir": {"sizeLimit": "50Gi"}}
    (container,) = pod["containers"]
    for arg in ("--store-type=s3", "--s3-bucket=compilecast-artifacts",
                "--s3-endpoint=https://storage.googleapis.com", "--store-max-bytes=45Gi"):
        assert arg in container["args"], container["args"]
    assert {"secretRef": {"name": "compilecast-s3"}} in container["envFrom"]


def test_external_etcd_renders_no_etcd():
    docs = render(CHART / "ci" / "external-etcd-values.yaml")
    assert by_kind(docs, "StatefulSet") == []
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["data"]["COMPILECAST_ETCD_ENDPOINTS"].startswith("etcd-0.infra:2379,")


@pytest.mark.parametrize(("sets", "message"), [
    (["etcd.enabled=false"], "externalEndpoints"),
    (["etcd.replicas=2"], "must be odd"),
    (["coordinator.storage.accessModes={ReadWriteOnce}"], "shared artifact store"),
    (["cache.leaseTtlSeconds=ten"], "leaseTtlSeconds"),
    (["worker.socketDir=relative/dir"], "socketDir"),
    (["auth.tokensSecret="], "allowUnauthenticated=true explicitly"),
    (["tls.requireClientCerts=true"], "needs tls.secretName"),
    (["coordinator.storage.maxBytes=lots"], "maxBytes"),
    (["metrics.alerts.etcdWriteSeconds=250ms"], "etcdWriteSeconds"),
    (["metrics.alerts.coordinatorBusy=80"], "coordinatorBusy"),
    (["metrics.serviceMonitor.interval=often"], "interval"),
    (["store.type=s3"], "store.type s3 needs store.s3.bucket"),
    (["store.type=gcs"], "/store/type"),
    (["store.type=s3", "store.s3.bucket=b-1", "store.s3.cacheMaxBytes="], "cacheMaxBytes"),
    (["store.type=s3", "store.s3.bucket=b-1", "store.s3.endpoint=ftp://x"], "endpoint"),
])
def test_bad_value_combinations_fail_with_a_clear_message(sets, message):
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode != 0
    assert message in r.stderr


def test_tls_and_tokens_are_wired_into_both_roles():
    docs = render(CHART / "ci" / "gke-tpu-values.yaml")
    (dep,) = [d for d in by_kind(docs, "Deployment")
              if d["metadata"]["name"].endswith("-coordinator")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--auth-tokens-file=/etc/compilecast/auth/tokens.yaml" in c["args"]
    assert "--tls-client-ca-file=/etc/compilecast/tls/ca.crt" in c["args"]
    assert "tcpSocket" in c["readinessProbe"]  # gRPC probes cannot speak TLS
    assert not any(a.startswith("--allow-unauthenticated") for a in c["args"])
    (ds,) = by_kind(docs, "DaemonSet")
    w = ds["spec"]["template"]["spec"]["containers"][0]
    assert "--coordinator-ca-file=/etc/compilecast/tls/ca.crt" in w["args"]
    assert "--token-file=/etc/compilecast/token/token" in w["args"]
    mounts = {m["name"] for m in w["volumeMounts"]}
    assert {"tls", "token"} <= mounts


# -- the Kubernetes API schema, offline ---------------------------------------------

MODELS = {"Deployment": "V1Deployment", "DaemonSet": "V1DaemonSet",
          "StatefulSet": "V1StatefulSet", "Service": "V1Service",
          "PodDisruptionBudget": "V1PodDisruptionBudget", "ConfigMap": "V1ConfigMap",
          "NetworkPolicy": "V1NetworkPolicy", "PersistentVolumeClaim": "V1PersistentVolumeClaim",
          "Pod": "V1Pod"}


def _dropped(original, roundtrip, path="") -> list[str]:
    """Paths present in `original` that the typed model did not keep."""
    if isinstance(original, dict):
        out = []
        for k, v in original.items():
            if not isinstance(roundtrip, dict) or k not in roundtrip:
                out.append(f"{path}.{k}")
            else:
                out += _dropped(v, roundtrip[k], f"{path}.{k}")
        return out
    if isinstance(original, list):
        return [p for i, v in enumerate(original)
                for p in _dropped(v, roundtrip[i] if i < len(roundtrip) else None,
                                  f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_rendered_objects_match_the_kubernetes_api_schema(values):
    """Every field of every built-in object is one the Kubernetes API knows,
    with the right nesting and required fields (kubernetes' OpenAPI models)."""
    import json as _json

    from kubernetes.client import ApiClient

    api = ApiClient()
    docs = render(values, "tls.secretName=s") + render(values)
    checked = 0
    for obj in docs:
        model = MODELS.get(obj["kind"])
        if model is None:
            assert obj["kind"] in ("ServiceMonitor", "PrometheusRule"), obj["kind"]  # CRDs
            continue
        typed = api.deserialize(_json.dumps(obj), model, "application/json")
        unknown = _dropped(obj, api.sanitize_for_serialization(typed))
        assert unknown == [], (obj["kind"], obj["metadata"]["name"], unknown)
        checked += 1
    assert checked >= 8


def _metric_names() -> set[str]:
    """Every series name compilecast's coordinator and worker export."""
    from prometheus_client import CollectorRegistry

    from compilecast.coordinator.metrics import CoordinatorMetrics
    from compilecast.worker.daemon.metrics import WorkerMetrics

    names = set()
    for cls in (CoordinatorMetrics, WorkerMetrics):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():
            names.add(family.name)
            names |= {family.name + s for s in ("_total", "_bucket", "_count", "_sum")}
    return names


def test_the_alerts_are_valid_promql_over_metrics_that_exist():
    """Each alert parses as PromQL, names only series compilecast exports,
    and is scoped to the release's namespace."""
    import re

    import promql_parser

    (rule,) = by_kind(render(None, "metrics.alerts.enabled=true"), "PrometheusRule")
    alerts = rule["spec"]["groups"][0]["rules"]
    assert {a["alert"] for a in alerts} == {
        "CompilecastCoordinatorDown", "CompilecastEtcdUnavailable",
        "CompilecastWorkersFallingBack", "CompilecastCorruptArtifacts",
        "CompilecastStoreThrashing", "CompilecastStoreFull", "CompilecastHostCacheFull",
        "CompilecastCoordinatorBusy", "CompilecastEtcdSlow", "CompilecastTamperedHostCacheEntries",
        "CompilecastBucketFailing", "CompilecastBucketStalled"}
    exported = _metric_names()
    for a in alerts:
        promql_parser.parse(a["expr"])  # raises on a syntax error
        used = set(re.findall(r"\b(compilecast_[a-z_]+)\b", a["expr"]))
        assert used and used <= exported, (a["alert"], used - exported)
        selectors = re.findall(r"compilecast_[a-z_]+\{([^}]*)\}", a["expr"])
        assert selectors and all('namespace="default"' in s for s in selectors), a["alert"]
        assert a["labels"]["severity"] in ("critical", "warning") and a["annotations"]["summary"]
    assert by_kind(render(None), "PrometheusRule") == []  # off by default


def test_alert_thresholds_given_with_set_reach_the_rules():
    """`--set` passes a decimal as a string: the schema takes it, and the rule
    compares with it."""
    (rule,) = by_kind(render(None, "metrics.alerts.enabled=true",
                             "metrics.alerts.etcdWriteSeconds=0.5",
                             "metrics.alerts.coordinatorBusy=0.9"), "PrometheusRule")
    exprs = {a["alert"]: a["expr"].strip() for a in rule["spec"]["groups"][0]["rules"]}
    assert exprs["CompilecastEtcdSlow"].endswith("> 0.5")
    assert exprs["CompilecastCoordinatorBusy"].endswith("> 0.9")


def test_the_dashboard_queries_are_valid_promql_over_metrics_that_exist():
    import json
    import re

    import promql_parser

    exported = _metric_names()
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    for expr in exprs:
        promql_parser.parse(expr)  # raises on a syntax error
        used = set(re.findall(r"\b(compilecast_[a-z_]+)\b", expr))
        assert used and used <= exported, (expr, used - exported)


def test_the_charts_dashboard_is_the_documented_one():
    """docs/grafana-dashboard.json is what operators import by hand; the chart
    ships the same file as a ConfigMap."""
    docs_copy = ROOT / "docs" / "grafana-dashboard.json"
    assert (CHART / "dashboards" / "compilecast.json").read_text() == docs_copy.read_text()


def test_the_chart_sets_whether_a_host_publish_wakes_its_waiters():
    from compilecast.cli import build_parser
    from compilecast.config import WorkerConfig, load

    def wake(*sets: str) -> bool:
        (ds,) = by_kind(render(None, *sets), "DaemonSet")
        args = build_parser().parse_args(ds["spec"]["template"]["spec"]["containers"][0]["args"])
        cfg, _ = load(WorkerConfig, env={},
                      flags={"wake_on_host_publish": args.wake_on_host_publish})
        return cfg.wake_on_host_publish

    assert wake() is False
    assert wake("worker.cache.wakeOnHostPublish=true") is True


def _compilecast_commands(docs: list[dict]) -> list[tuple[str, list[str]]]:
    """(where, argv after `compilecast`) of every command the rendered chart
    runs with the image's entrypoint or names `compilecast` itself: the
    containers' args and their exec probes."""
    found = []
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            if "command" not in c and c.get("args"):  # ENTRYPOINT ["compilecast"]
                found.append((where, [str(a) for a in c["args"]]))
            elif c.get("command", [None])[0] == "compilecast":
                found.append((where, [str(a) for a in c["command"][1:] + c.get("args", [])]))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command", [])
                if command[:1] == ["compilecast"]:
                    found.append((f"{where} {probe}", [str(a) for a in command[1:]]))
    return found


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_every_command_of_the_chart_is_accepted_by_the_cli(values):
    """A dry run of each command line the chart gives `compilecast`: the CLI
    parses it, and each setting of a server role reads. A renamed flag breaks
    this test, not a pod."""
    import contextlib
    import dataclasses
    import io

    from compilecast.cli import build_parser
    from compilecast.config import CoordinatorConfig, WorkerConfig, load

    commands = _compilecast_commands(render(values))
    roles = {argv[[a.startswith("-") for a in argv].index(False)] for _, argv in commands}
    assert {"coordinator", "worker"} <= roles, roles
    parser = build_parser()
    for where, argv in commands:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                args = parser.parse_args(argv)
            except SystemExit as exc:
                raise AssertionError(f"{where}: compilecast {' '.join(argv)}: "
                                     f"{err.getvalue().strip()}") from exc
        cls = {"coordinator": CoordinatorConfig, "worker": WorkerConfig}.get(args.command)
        if cls is not None:
            problems: list[str] = []
            load(cls, flags={f.name: getattr(args, f.name, None)
                             for f in dataclasses.fields(cls)},
                 env={}, validate=False, problems=problems)
            assert problems == [], (where, problems)
