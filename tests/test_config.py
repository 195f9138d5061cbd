"""Configuration: precedence, sources and clear errors."""

from __future__ import annotations

import re

import pytest
import yaml

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
    ({"COMPILECAST_LISTEN": "127.0.0.1:99999"}, "listen '127.0.0.1:99999': port 99999 is not"),
    ({"COMPILECAST_METRICS_PORT": "70000"}, "metrics_port must be a port in 0-65535"),
    ({"COMPILECAST_DESIGNATED_GRACE_S": "-1"}, "designated_grace_s must be >= 0"),
    ({"COMPILECAST_DESIGNATED_GRACE_S": "nan"}, "designated_grace_s='nan' from env"),
    ({"COMPILECAST_HEDGE_FACTOR": "inf"}, "HEDGE_FACTOR is not a finite number"),
    ({"COMPILECAST_LEASE_TTL_S": "1e23"}, "LEASE_TTL_S is not an integer"),
    ({"COMPILECAST_LEASE_TTL_S": "99999999999"}, "lease_ttl_s must be at most 9000000000"),
])
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1", **env})


def test_the_workers_decide_gap_is_a_setting_in_milliseconds():
    assert load(WorkerConfig, env={})[0].decide_gap_ms == 5.0
    cfg, src = load(WorkerConfig, flags={"decide_gap_ms": "0"}, env={})
    assert cfg.decide_gap_ms == 0 and src["decide_gap_ms"] == "flag --decide-gap-ms"
    with pytest.raises(ConfigError, match=re.escape("decide_gap_ms must be >= 0")):
        load(WorkerConfig, env={"COMPILECAST_DECIDE_GAP_MS": "-1"})


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


# -- the tokens file (coordinator/auth.py) ----------------------------------------

GOOD_DIGEST = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"  # sha256("test")


@pytest.mark.parametrize(("entry", "message"), [
    ({"sha256": "abc", "tenant": "team-a", "permissions": ["read"]},
     "tokens[0]: sha256 must be 64 hex characters"),
    ({"sha256": GOOD_DIGEST, "tenant": "Team_A", "permissions": ["read"]},
     "tokens[0]: tenant 'Team_A' must match"),
    ({"sha256": GOOD_DIGEST, "tenant": "team-a\n", "permissions": ["read"]},
     "tokens[0]: tenant 'team-a\\n' must match"),
    ({"sha256": GOOD_DIGEST, "tenant": "team-a", "permissions": []},
     "tokens[0]: permissions must be a list, a subset"),
    ({"sha256": GOOD_DIGEST, "tenant": "team-a", "permissions": ["read", "root"]},
     "tokens[0]: permissions must be a list, a subset"),
])
def test_a_bad_tokens_file_is_a_readable_error(tmp_path, entry, message):
    from compilecast.coordinator.auth import Authenticator

    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [entry]}))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        Authenticator.from_file(str(path), allow_unauthenticated=False)


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("lease_ttl_s: 2.7\n", "lease_ttl_s=2.7 from file"),
    ("lease_ttl_s: 100000000000000000000000\n", "lease_ttl_s=100000000000000000000000 from"),
    ("lease_ttl_s: true\n", "lease_ttl_s=True from file"),
    ("etcd_endpoints: {a: 1}\n", "etcd_endpoints={'a': 1} from file"),
    ("etcd_prefix: [/a]\n", "etcd_prefix=['/a'] from file"),
    ("designated_grace_s: .nan\n", "designated_grace_s=nan from file"),
    ("1: 2\n", "unknown settings in"),
    ("- a\n- b\n", "must hold a mapping of settings"),
    ("a: [\n", "is not valid YAML"),
])
def test_a_config_file_value_is_taken_only_as_what_it_is(tmp_path, yaml_text, message):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"}, file=str(f))


def test_a_binary_config_file_is_a_readable_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load(WorkerConfig, env={}, file=str(f))


@pytest.mark.parametrize(("content", "message"), [
    ("tokens: [\n", "is not valid YAML"),
    ("- a\n- b\n", "must hold a mapping with a list 'tokens'"),
    ("tokens: 5\n", "must hold a mapping with a list 'tokens'"),
    ("tokens: [just-a-string]\n", "tokens[0] must be a mapping"),
    (f"tokens: [{{sha256: {GOOD_DIGEST}, tenant: a, permissions: 5}}]\n",
     "tokens[0]: permissions must be a list"),
    (f"tokens: [{{sha256: {GOOD_DIGEST}, tenant: a, permissions: [[read]]}}]\n",
     "tokens[0]: permissions must be a list"),
])
def test_a_malformed_tokens_file_is_a_readable_error(tmp_path, content, message):
    from compilecast.coordinator.auth import Authenticator

    path = tmp_path / "tokens.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Authenticator.from_file(str(path), allow_unauthenticated=False)
    path.write_bytes(b"\xff\xfe" + bytes(range(200)))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        Authenticator.from_file(str(path), allow_unauthenticated=False)


def test_a_tokens_file_that_is_missing_or_absent(tmp_path):
    from compilecast.coordinator.auth import Authenticator

    with pytest.raises(ConfigError, match=r"cannot read auth_tokens_file .*No such file"):
        Authenticator.from_file(str(tmp_path / "gone.yaml"), allow_unauthenticated=False)
    with pytest.raises(ConfigError, match="no auth_tokens_file"):
        Authenticator.from_file("", allow_unauthenticated=False)
    assert Authenticator.from_file("", allow_unauthenticated=True).allow_unauthenticated


def test_a_tokens_file_maps_digests_to_tenants_and_permissions(tmp_path):
    from compilecast.coordinator.auth import Authenticator

    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [
        {"name": "reader", "sha256": GOOD_DIGEST.upper(), "tenant": "team-a",
         "permissions": ["read"]},
        {"sha256": "0" * 64, "tenant": "team-b", "permissions": ["read", "publish", "admin"]}]}))
    auth = Authenticator.from_file(str(path), allow_unauthenticated=False)
    reader, admin = auth._by_digest[GOOD_DIGEST], auth._by_digest["0" * 64]
    assert (reader.name, reader.tenant, reader.can_publish, reader.can_admin) == \
        ("reader", "team-a", False, False)
    assert (admin.name, admin.tenant, admin.can_publish, admin.can_admin) == \
        ("token-1", "team-b", True, True)


def test_the_store_of_up_is_bounded_on_the_users_disk(tmp_path):
    """A standalone coordinator's store is unbounded (a volume of its own);
    under `compilecast up` it shares the user's disk, so it is bounded like
    the host cache and leaves as much free. The environment still decides."""
    from compilecast.up import UpConfig, configs

    base = {"COMPILECAST_ALLOW_UNAUTHENTICATED": "true"}
    alone, _ = load(CoordinatorConfig, env=base)
    assert alone.store_max_bytes == 0 and alone.store_min_free_bytes == 0
    ccfg, wcfg = configs(UpConfig(home=tmp_path), env={})
    assert ccfg.store_max_bytes == wcfg.cache_max_bytes == 20 << 30
    assert ccfg.store_min_free_bytes == wcfg.cache_min_free_bytes == 2 << 30
    assert ccfg.store_dir == str(tmp_path / "coordinator")
    ccfg, _ = configs(UpConfig(home=tmp_path), env={"COMPILECAST_STORE_MAX_BYTES": "0"})
    assert ccfg.store_max_bytes == 0


def test_defaults_given_to_load_lose_to_flags_env_and_file(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump({"lease_ttl_s": 30}))
    given = {"lease_ttl_s": 20, "local_marker_ttl_s": 40}
    cfg, sources = load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"},
                        defaults=given, defaults_from="a test")
    assert (cfg.lease_ttl_s, cfg.local_marker_ttl_s) == (20, 40)
    assert sources["lease_ttl_s"] == "default of a test"
    cfg, _ = load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1"},
                  defaults=given, file=str(file))
    assert cfg.lease_ttl_s == 30
    cfg, _ = load(CoordinatorConfig, env={"COMPILECAST_ALLOW_UNAUTHENTICATED": "1",
                                          "COMPILECAST_LEASE_TTL_S": "15"},
                  defaults=given, flags={"local_marker_ttl_s": 50})
    assert (cfg.lease_ttl_s, cfg.local_marker_ttl_s) == (15, 50)


@pytest.mark.parametrize("role,name", [("worker", "token_file"), ("worker", "cache_dir"),
                                       ("coordinator", "store_dir")])
def test_a_setting_with_a_nul_is_a_configuration_error(role, name):
    cfg = (WorkerConfig() if role == "worker"
           else CoordinatorConfig(allow_unauthenticated=True))
    setattr(cfg, name, "/tmp/a\x00b")
    with pytest.raises(ConfigError, match=f"{name} holds a NUL character"):
        cfg.validate()


# -- hostile settings: each refused in one line naming the setting, never a Python error

def _refused(env_over: dict | None = None, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        load(WorkerConfig, env=env_over or {}, **kw)
    message = str(err.value)
    assert "\n" not in message and "Error" not in message.split(":")[0]
    return message


def test_hostile_values_are_refused_in_one_line(tmp_path):
    assert "rpc_timeout_s" in _refused(flags={"rpc_timeout_s": 1e-320})
    assert "rpc_timeout_s" in _refused(flags={"rpc_timeout_s": 1e300})
    assert "at most 4096" in _refused(flags={"cache_dir": "d" * 100_000_000})
    assert "coordinator" in _refused(flags={"coordinator": "not a host"})
    dup = tmp_path / "dup.yaml"
    dup.write_text("rpc_timeout_s: 5\nrpc_timeout_s: 6\n")
    assert "given twice" in _refused(file=str(dup))
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in _refused(file=str(deep))


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        rows.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(rows) + "\n")
    assert "aliases" in _refused(file=str(bomb))
    anchors = tmp_path / "anchors.yaml"  # a few anchors are fine
    anchors.write_text("x: &t 7.5\nrpc_timeout_s: *t\n")
    with pytest.raises(ConfigError, match="unknown settings"):
        load(WorkerConfig, env={}, file=str(anchors))


def test_settings_files_must_be_bounded_regular_files(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        assert "not a regular file" in _refused(file=path)
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)
    assert "larger than 256 KiB" in _refused(file=str(big))  # a config file's bound
    # A token file is read the same way by the worker.
    from compilecast.config import read_small_file
    with pytest.raises(ConfigError, match="not a regular file"):
        read_small_file(str(fifo), "token_file")


def test_numbers_too_large_for_a_setting_are_refused_in_one_line(tmp_path):
    ones = "1" * 400  # (as a float: infinity)
    message = _refused(env_over={"COMPILECAST_CACHE_MAX_BYTES": ones})
    assert "cache_max_bytes" in message and "below 2**63" in message and len(message) < 300
    assert "cache_max_bytes" in _refused(env_over={"COMPILECAST_CACHE_MAX_BYTES": "9" * 30 + "Gi"})
    huge = tmp_path / "huge.yaml"  # more digits than Python reads an int of
    huge.write_text(f"cache_max_bytes: {'7' * 5000}\n")
    from_file = _refused(file=str(huge))
    from_env = _refused(env_over={"COMPILECAST_CACHE_MAX_BYTES": "7" * 5000})
    # The same message from a file as from the environment, never Python's advice.
    assert "set_int_max_str_digits" not in from_file and len(from_file) < 300
    assert from_file.split(" from ")[0] == from_env.split(" from ")[0], (from_file, from_env)
    huge.write_text(f"metrics_port: {'7' * 5000}\n")
    message = _refused(file=str(huge))
    assert "metrics_port=" in message and "not an integer" in message
    assert "rpc_timeout_s" in _refused(flags={"rpc_timeout_s": "9" * 5000})


def test_a_config_file_of_many_unknown_settings_is_refused_naming_a_few(tmp_path):
    many = tmp_path / "many.yaml"
    many.write_text("".join(f"k{i}: 1\n" for i in range(20_000)))  # under the file's bound
    message = _refused(file=str(many))
    assert "unknown settings" in message and "and 19990 more" in message
    assert len(message) < 500
