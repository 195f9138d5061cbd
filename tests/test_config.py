"""Configuration: precedence, sources and clear errors."""

from __future__ import annotations

import re

import pytest

from compilecast.config import ConfigError, CoordinatorConfig, WorkerConfig, load


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lease_ttl_s: 7\nmetrics_port: 9000\netcd_prefix: /fromfile\n")
    cfg, src = load(CoordinatorConfig, flags={"lease_ttl_s": "3"},
                    env={"COMPILECAST_METRICS_PORT": "9100",
                         "COMPILECAST_ALLOW_UNAUTHENTICATED": "yes"}, file=str(f))
    assert (cfg.lease_ttl_s, cfg.metrics_port, cfg.etcd_prefix) == (3, 9100, "/fromfile")
    assert src["lease_ttl_s"] == "flag --lease-ttl-s"
    assert src["metrics_port"] == "env COMPILECAST_METRICS_PORT"
    assert src["etcd_prefix"].startswith("file ")
    assert src["listen"] == "default"


@pytest.mark.parametrize("env,message", [
    ({"COMPILECAST_LEASE_TTL_S": "soon"}, "lease_ttl_s='soon' from env"),
    ({"COMPILECAST_LEASE_TTL_S": "0"}, "lease_ttl_s must be > 0"),
    ({"COMPILECAST_LISTEN": "nowhere"}, "listen 'nowhere' is not host:port"),
    ({"COMPILECAST_ETCD_PREFIX": "relative"}, "must start with '/'"),
    ({"COMPILECAST_STORE_REVERIFY_S": "-1"}, "store_reverify_s must be >= 0"),
    ({"COMPILECAST_STORE_MAX_BYTES": "lots"}, "store_max_bytes='lots' from env"),
    ({"COMPILECAST_STORE_MAX_BYTES": "1Gi"}, "store_max_bytes (1073741824) must be 0"),
    ({"COMPILECAST_INDEX_SWEEP_S": "-5"}, "index_sweep_s must be >= 0"),
    ({"COMPILECAST_KEY_RECORD_DAYS": "-1"}, "key_record_days must be >= 0"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1", **env})


def test_the_coordinator_refuses_to_start_open_unless_told():
    with pytest.raises(ConfigError, match="allow_unauthenticated explicitly"):
        load(CoordinatorConfig, env={})
    with pytest.raises(ConfigError, match="not a boolean"):
        load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "maybe"})


def test_tls_files_must_come_in_pairs_and_exist(tmp_path):
    env = {"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"}
    with pytest.raises(ConfigError, match="go together"):
        load(CoordinatorConfig, env=dict(env, COMPILECAST_TLS_CERT_FILE=str(tmp_path)))
    with pytest.raises(ConfigError, match="not a readable file"):
        load(CoordinatorConfig, env=dict(env, COMPILECAST_AUTH_TOKENS_FILE="/no/such/file"))


def test_unknown_file_keys_are_refused(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("cache_max_byte: 10\n")
    with pytest.raises(ConfigError, match=r"unknown settings.*cache_max_byte"):
        load(WorkerConfig, env={}, file=str(f))


def test_jax_share_binary_timeout_is_honoured(monkeypatch):
    monkeypatch.setenv("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", "1234")
    cfg, _ = load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"})
    assert cfg.share_binary_between_hosts_timeout_ms == 1234


@pytest.mark.parametrize("raw,size", [("180Gi", 180 << 30), ("500M", 500_000_000),
                                      ("1.5Ti", int(1.5 * 2**40)), ("64 MiB", 64 << 20),
                                      ("123", 123), (4096, 4096)])
def test_sizes_in_bytes_take_kubernetes_suffixes(raw, size):
    cfg, _ = load(CoordinatorConfig, flags={"store_max_bytes": raw, "max_artifact_bytes": "1"},
                  env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"})
    assert cfg.store_max_bytes == size
