"""Configuration: one dataclass per role, separate from the runtime.

Every setting has a flag (`--lease-ttl-s`), an environment variable with the
COMPILECAST_ prefix (`COMPILECAST_LEASE_TTL_S`) and a key in a YAML file
(`lease_ttl_s`). Precedence: flag > environment > file > default. `load()`
is the one place that parses and validates, and it records where each value
came from for `compilecast config`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import yaml

from compilecast import validate
from compilecast.errors import InvalidRequest

ENV_PREFIX = "COMPILECAST_"


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names it and its source."""


def default_home() -> Path:
    if os.environ.get("COMPILECAST_HOME"):
        return Path(os.environ["COMPILECAST_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compilecast"


def default_worker_target() -> str:
    return f"unix://{default_home() / 'worker.sock'}"


def _jax_share_binary_timeout_ms() -> int:
    # JAX's own knob, when the user set it in the environment.
    raw = os.environ.get("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS")
    return int(raw) if raw and raw.isdigit() else 20 * 60 * 1000


def _help(text: str) -> dict[str, str]:
    return {"help": text}


class Checked:
    """A configuration whose checks() each raise ConfigError on their own."""

    def checks(self) -> list[Callable[[], None]]:
        raise NotImplementedError

    def validate(self) -> None:
        for check in self.checks():
            check()

    def problems(self) -> list[str]:
        """Every check's ConfigError, in order ([] when valid)."""
        out = []
        for check in self.checks():
            try:
                check()
            except ConfigError as exc:
                out.append(str(exc))
        return out


@dataclass
class CoordinatorConfig(Checked):
    listen: str = field(default="127.0.0.1:7640", metadata=_help("gRPC listen address host:port or unix:///path"))
    etcd_endpoints: str = field(
        default="127.0.0.1:2379", metadata=_help("comma-separated etcd client endpoints host:port or unix:///path")
    )
    etcd_prefix: str = field(default="/compilecast/v1", metadata=_help("etcd key prefix"))
    store_dir: str = field(
        default_factory=lambda: str(default_home() / "coordinator"),
        metadata=_help("artifact store directory"),
    )
    metrics_port: int = field(default=7641, metadata=_help("Prometheus port (0: off)"))
    metrics_host: str = field(default="127.0.0.1", metadata=_help("Prometheus bind address"))
    lease_ttl_s: int = field(default=10, metadata=_help("compile lease TTL in seconds"))
    share_binary_between_hosts_timeout_ms: int = field(
        default_factory=_jax_share_binary_timeout_ms,
        metadata=_help("longest a waiter waits before compiling itself (JAX's name)"),
    )
    designated_grace_s: float = field(
        default=10.0,
        metadata=_help("how long the waiters of a program shared by a job's processes wait for "
                       "its designated process to take the lease (a slow or dead one)"),
    )
    local_marker_ttl_s: int = field(
        default=30, metadata=_help("how long a 'compile locally' verdict for a key lasts")
    )
    max_artifact_bytes: int = field(default=4 << 30, metadata=_help("largest accepted artifact"))
    store_type: str = field(
        default="disk", metadata=_help(
            "where artifact bytes live: disk (store_dir; replicas must share it) or s3 (a "
            "bucket; store_dir is then each replica's own bounded cache in front of it)"))
    s3_bucket: str = field(default="", metadata=_help("with store_type s3: the bucket"))
    s3_prefix: str = field(default="compilecast", metadata=_help(
        "with store_type s3: the key prefix under which objects go"))
    s3_endpoint: str = field(default="", metadata=_help(
        "with store_type s3: the endpoint URL (https://...; empty: AWS's); GCS through "
        "https://storage.googleapis.com with HMAC keys, MinIO, Ceph RGW, SeaweedFS"))
    s3_region: str = field(default="", metadata=_help("with store_type s3: the region"))
    s3_presign_s: int = field(default=60, metadata=_help(
        "with store_type s3: a worker's fetch may be answered with a presigned GET of the "
        "object, valid this long, and its bytes come from the bucket, not through this "
        "replica (0: never)"))
    store_max_bytes: int = field(
        default=0,
        metadata=_help("bound on the artifact store (e.g. 180Gi; keep it below the volume): "
                       "least recently read artifacts are evicted and recompile when next "
                       "asked for (0: unbounded)"))
    store_min_free_bytes: int = field(
        default=0,
        metadata=_help("space the artifact store leaves free on its volume: a publish that "
                       "would take it evicts least recently read artifacts first, and is "
                       "refused (RESOURCE_EXHAUSTED) when that is not enough"))
    store_scan_s: float = field(
        default=60.0, metadata=_help("how often a replica counts the whole artifact store "
                                     "(the other replicas' writes to a shared volume)"))
    index_sweep_s: float = field(
        default=3600.0,
        metadata=_help("how often a replica drops, from etcd, the index entries of artifacts "
                       "the store evicted and old key records (0: never)"))
    key_record_days: float = field(
        default=30.0,
        metadata=_help("a key's record (its components, for explain) first seen longer ago "
                       "than this is dropped once the key has no artifact (0: kept forever)"))
    store_reverify_s: float = field(
        default=600.0,
        metadata=_help("serve a blob this process wrote or verified, in an unchanged file, "
                       "without hashing it again for this many seconds (0: hash every read; "
                       "clients verify every byte either way)"))
    scrub_bytes_per_s: int = field(
        default=16 << 20,
        metadata=_help("verify stored blobs nobody reads in the background at most this many "
                       "stored bytes a second, quarantining the corrupt ones (e.g. 16Mi; 0: "
                       "off); a pass over the store, then one every store_scan_s"))
    hedge_factor: float = field(
        default=3.0,
        metadata=_help("hedge a holder compiling longer than this many times the program's "
                       "longest known compile time (0: never hedge)"))
    hedge_min_s: float = field(
        default=120.0, metadata=_help("never hedge a holder younger than this many seconds"))
    relay_fanout: int = field(
        default=2, metadata=_help("workers one relaying worker serves an artifact to, when "
                                  "many fetch it at once, past the chain (relay_chain_bytes; "
                                  "1: a chain throughout; 0: every worker fetches from here)"))
    relay_chain_bytes: int = field(
        default=1 << 20, metadata=_help(
            "workers fetching an artifact of S bytes at once are chained, each relaying to one "
            "(a whole link each), while the chain is shorter than S / this; later ones join a "
            "tree of relay_fanout peers per worker (0: never chain)"))
    job_stream_fanout: int = field(
        default=32, metadata=_help(
            "streams of one job this replica serves itself; later ones go to a worker that "
            "relays the job's news (relay_listen) and so down a tree of this many per node "
            "(0: every stream here)"))
    publish_stream_readers: int = field(
        default=0, metadata=_help("waiters an upload in progress streams to as it arrives "
                                  "(later ones get the committed blob); 0: waiters fetch once "
                                  "it is published. Worth 4 where holders upload over a slower "
                                  "link than the coordinator's"))
    decide_busy_gap_ms: float = field(
        default=12.0, metadata=_help(
            "the longest gap between two messages of a Decide stream this replica asks its "
            "clients for while its event loop is busy (from 0.3 of a core on, all of it at "
            "0.6): fewer, fuller messages cost it less per decision (0: never ask)"))
    data_listen: str = field(
        default="auto", metadata=_help(
            "the data plane's address host:port: whole artifacts go to clients that ask over "
            "plain TCP with sendfile (auto: listen's host, any free port, unless that host is "
            "a wildcard and data_advertise is empty; off: every fetch over gRPC; always off "
            "with TLS)"))
    data_advertise: str = field(
        default="", metadata=_help(
            "host:port clients reach the data plane at (this replica's own, behind a "
            "Service: the pod IP); empty: the host they dialed, the data plane's port"))
    auth_tokens_file: str = field(
        default="", metadata=_help("YAML file of token sha256 -> tenant, permissions"))
    allow_unauthenticated: bool = field(
        default=False,
        metadata=_help("serve calls without a token as tenant 'default' (loopback/tests only)"))
    otlp_endpoint: str = field(
        default="", metadata=_help("OpenTelemetry collector to send traces to, over OTLP/HTTP "
                                   "(http://host:4318; empty: tracing off)"))
    tls_cert_file: str = field(default="", metadata=_help("server certificate (PEM): enables TLS"))
    tls_key_file: str = field(default="", metadata=_help("server private key (PEM)"))
    tls_client_ca_file: str = field(
        default="", metadata=_help("CA for client certificates: requires mTLS"))
    etcd_ca_file: str = field(default="", metadata=_help("CA of etcd's certificate: enables TLS"))
    etcd_cert_file: str = field(default="", metadata=_help("client certificate for etcd (PEM)"))
    etcd_key_file: str = field(default="", metadata=_help("client key for etcd (PEM)"))

    def checks(self) -> list[Callable[[], None]]:
        """The checks of validate(), each raising ConfigError on its own."""
        def store() -> None:
            if self.store_type not in ("disk", "s3"):
                raise ConfigError(f"store_type must be disk or s3, got {self.store_type!r}")
            if self.store_type == "s3":
                if not self.s3_bucket:
                    raise ConfigError("store_type s3 needs s3_bucket")
                if not self.store_max_bytes:
                    raise ConfigError("store_type s3 needs store_max_bytes: the bound of this "
                                      "replica's local cache in front of the bucket")
                if self.s3_endpoint and not re.match(r"https?://[^/\s]+", self.s3_endpoint):
                    raise ConfigError(f"s3_endpoint {self.s3_endpoint!r} is not an http(s) URL")
            if 0 < self.store_max_bytes < self.max_artifact_bytes:
                raise ConfigError(f"store_max_bytes ({self.store_max_bytes}) must be 0 "
                                  "(unbounded) or at least max_artifact_bytes "
                                  f"({self.max_artifact_bytes})")

        def counts() -> None:
            for name in ("relay_fanout", "relay_chain_bytes", "publish_stream_readers",
                         "job_stream_fanout"):
                if getattr(self, name) < 0:
                    raise ConfigError(f"{name} must be >= 0")

        def data_plane() -> None:
            if self.data_listen not in ("auto", "off"):
                _hostport(self.data_listen, "data_listen")
            if self.data_advertise:
                _hostport(self.data_advertise, "data_advertise")

        def etcd() -> None:
            if not self.etcd_endpoints.strip():
                raise ConfigError("etcd_endpoints is empty")
            for endpoint in self.etcd_endpoints.split(","):
                if endpoint.strip():
                    check_address(endpoint.strip().removeprefix("http://").removeprefix("https://"),
                             "etcd_endpoints")
            if not self.etcd_prefix.startswith("/"):
                raise ConfigError(f"etcd_prefix {self.etcd_prefix!r} must start with '/'")

        def tls() -> None:
            if self.tls_client_ca_file and not self.tls_cert_file:
                raise ConfigError("tls_client_ca_file needs tls_cert_file and tls_key_file")

        def auth() -> None:
            if not self.auth_tokens_file and not self.allow_unauthenticated:
                raise ConfigError("set auth_tokens_file, or allow_unauthenticated explicitly "
                                  "(only for loopback and tests)")

        return [
            lambda: _no_nul(self),
            lambda: _positive(self, "lease_ttl_s", "share_binary_between_hosts_timeout_ms",
                              "local_marker_ttl_s", "max_artifact_bytes"),
            lambda: _at_most(self, MAX_LEASE_TTL_S, "lease_ttl_s", "local_marker_ttl_s"),
            lambda: _not_negative(self, "designated_grace_s", "hedge_factor", "hedge_min_s",
                                  "s3_presign_s"),
            lambda: _at_most(self, 7 * 86400, "s3_presign_s"),  # S3's longest presigned URL
            lambda: _port(self, "metrics_port"),
            lambda: _not_negative(self, "store_max_bytes", "store_min_free_bytes",
                                  "scrub_bytes_per_s"),
            lambda: _positive(self, "store_scan_s"),
            lambda: _not_negative(self, "index_sweep_s", "key_record_days"),
            store, counts, data_plane,
            lambda: _not_negative(self, "store_reverify_s", "decide_busy_gap_ms"),
            etcd,
            lambda: check_address(self.listen, "listen"),
            lambda: _pair(self, "tls_cert_file", "tls_key_file"),
            lambda: _pair(self, "etcd_cert_file", "etcd_key_file"),
            tls, auth,
            lambda: _readable(self, "auth_tokens_file", "tls_cert_file", "tls_key_file",
                              "tls_client_ca_file", "etcd_ca_file", "etcd_cert_file",
                              "etcd_key_file"),
            lambda: _times(self),
        ]


@dataclass
class WorkerConfig(Checked):
    listen: str = field(
        default_factory=default_worker_target,
        metadata=_help("local API: unix:///path or host:port"),
    )
    coordinator: str = field(default="127.0.0.1:7640", metadata=_help("coordinator host:port or unix:///path"))
    cache_dir: str = field(
        default_factory=lambda: str(default_home() / "worker"),
        metadata=_help("host cache directory"),
    )
    cache_max_bytes: int = field(default=20 << 30, metadata=_help("host cache size bound"))
    job: str = field(default="", metadata=_help(
        "the job this host runs (at most 128 of [A-Za-z0-9._:-]): its manifest's artifacts are "
        "prefetched into the host cache at start and its keys' HITs answered here "
        "(a caller's own job, Requester.job, too)"))
    job_streams: bool = field(default=True, metadata=_help(
        "a job's processes that do not compile a program wait for it on one stream per host "
        "and job (WatchJob), not with a request and a wait per key; off: key by key"))
    cache_min_free_bytes: int = field(
        default=2 << 30,
        metadata=_help("space the host cache leaves free on its disk for the jobs on the host: "
                       "it evicts its least recently read artifacts to keep it, and serves "
                       "a download it has no room for without keeping a copy"))
    cache_free_check_s: float = field(
        default=10.0, metadata=_help("how often the host cache checks its disk's free space "
                                     "and evicts to keep cache_min_free_bytes free"))
    store_reverify_s: float = field(
        default=600.0,
        metadata=_help("serve a blob this process wrote or verified, in an unchanged file, "
                       "without hashing it again for this many seconds (0: hash every read; "
                       "clients verify every byte either way)"))
    metrics_port: int = field(default=7642, metadata=_help("Prometheus port (0: off)"))
    metrics_host: str = field(default="127.0.0.1", metadata=_help("Prometheus bind address"))
    rpc_timeout_s: float = field(default=5.0, metadata=_help("deadline of unary upstream calls"))
    decide_gap_ms: float = field(
        default=5.0, metadata=_help("at least this long between two messages of the Decide "
                                    "stream to the coordinator: the decisions asked meanwhile "
                                    "leave together in the next (a message costs the "
                                    "coordinator more than a decision in it; 0: send at once)"))
    token_file: str = field(
        default="", metadata=_help("file holding this worker's bearer token for the coordinator"))
    coordinator_ca_file: str = field(
        default="", metadata=_help("CA of the coordinator's certificate: enables TLS upstream"))
    coordinator_cert_file: str = field(default="", metadata=_help("client certificate (mTLS)"))
    coordinator_key_file: str = field(default="", metadata=_help("client key (mTLS)"))
    tls_cert_file: str = field(default="", metadata=_help("certificate for a TCP listen address"))
    tls_key_file: str = field(default="", metadata=_help("key for a TCP listen address"))
    share_binary_between_hosts_timeout_ms: int = field(
        default=0,
        metadata=_help("operator bound on how long waiters on this host wait before "
                       "compiling themselves (0: the process's own setting)"),
    )
    revocation_poll_s: float = field(
        default=30.0, metadata=_help("how often to ask the coordinator for purged artifacts "
                                     "and drop them from the host cache"))
    local_files: bool = field(
        default=True, metadata=_help("answer a host cache hit for a process that asks over the "
                                     "unix socket with the file's path: it reads and verifies "
                                     "the file itself, without the bytes going through this "
                                     "worker (it must see cache_dir at the same path)"))
    wake_on_host_publish: bool = field(
        default=False, metadata=_help("when a process of this host starts to publish through "
                                      "this worker, wake the host's processes waiting for it "
                                      "at once, to follow the worker's copy as it is written "
                                      "(off: they are woken when the publish ends; on 2 shared "
                                      "cores following slowed the upload, BENCHMARKS.md)"))
    data_plane: bool = field(
        default=True, metadata=_help("take whole artifacts over the coordinator's data plane "
                                     "(plain TCP, sendfile) when it offers one; never with TLS "
                                     "to the coordinator"))
    bucket_urls: bool = field(
        default=True, metadata=_help("take a download straight from the object store's bucket "
                                     "when a coordinator over one offers a presigned URL "
                                     "(the bytes do not go through the coordinator)"))
    relay_listen: str = field(
        default="", metadata=_help("host:port where this worker relays artifacts it downloads, "
                                   "and its jobs' news, to other workers (empty: no "
                                   "relaying)"))
    job_relay_fanout: int = field(
        default=32, metadata=_help("peer workers this one relays a job's news to (with "
                                   "relay_listen); later ones go further down the tree"))
    relay_advertise: str = field(
        default="", metadata=_help("host:port other workers dial for relayed artifacts "
                                   "(default: this host's name and relay_listen's port)"))
    relay_data_listen: str = field(
        default="auto", metadata=_help(
            "host:port where this worker sends what it relays to peer workers over plain "
            "TCP with sendfile, when they ask (peers dial it on the host they reach the relay "
            "at; auto: relay_listen's host, any free port; off: relays over gRPC only; "
            "always off with TLS)"))
    dir_sync_s: float = field(
        default=10.0, metadata=_help("how often each directory this worker keeps in sync "
                                     "(XLA's autotune results, PyTorch/XLA's cache) publishes "
                                     "its new files and installs other hosts' (a process can "
                                     "ask for a pass at once)"))
    dir_settle_s: float = field(
        default=5.0, metadata=_help("a file in a synced directory is published once its size "
                                    "and time stayed unchanged over a pass and it is this many "
                                    "seconds old (0: at first sight, for writers that rename "
                                    "finished files into place)"))
    dir_max_entry_bytes: int = field(
        default=256 << 20, metadata=_help("largest file a synced directory publishes or "
                                          "installs"))
    otlp_endpoint: str = field(
        default="", metadata=_help("OpenTelemetry collector to send traces to, over OTLP/HTTP "
                                   "(http://host:4318; empty: tracing off)"))

    def checks(self) -> list[Callable[[], None]]:
        """The checks of validate(), each raising ConfigError on its own."""
        def relay() -> None:
            if self.relay_listen:
                _hostport(self.relay_listen, "relay_listen")
            if self.relay_advertise:
                _hostport(self.relay_advertise, "relay_advertise")
            if self.relay_data_listen not in ("auto", "off"):
                _hostport(self.relay_data_listen, "relay_data_listen")
            if self.job_relay_fanout < 1:
                raise ConfigError("job_relay_fanout must be >= 1")

        def listen() -> None:
            check_address(self.listen, "listen")

        return [
            lambda: _no_nul(self),
            lambda: _positive(self, "cache_max_bytes", "rpc_timeout_s", "revocation_poll_s",
                              "dir_sync_s", "dir_max_entry_bytes", "cache_free_check_s"),
            lambda: _port(self, "metrics_port"),
            relay,
            lambda: _not_negative(self, "share_binary_between_hosts_timeout_ms",
                                  "store_reverify_s", "cache_min_free_bytes", "decide_gap_ms",
                                  "dir_settle_s"),
            lambda: _pair(self, "coordinator_cert_file", "coordinator_key_file"),
            lambda: _pair(self, "tls_cert_file", "tls_key_file"),
            lambda: _readable(self, "token_file", "coordinator_ca_file", "coordinator_cert_file",
                              "coordinator_key_file", "tls_cert_file", "tls_key_file"),
            listen,
            lambda: check_address(self.coordinator, "coordinator"),
            lambda: _times(self),
            lambda: _job(self.job),
        ]


def _job(value: str) -> None:
    try:
        validate.job(value)
    except InvalidRequest as exc:
        raise ConfigError(str(exc)) from None


# etcd's longest lease (MaxLeaseTTL); a TTL beyond it is refused on every grant.
MAX_LEASE_TTL_S = 9_000_000_000


def _at_most(cfg: Any, limit: float, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) > limit:
            raise ConfigError(f"{n} must be at most {limit}, got {getattr(cfg, n)!r}")


def _port(cfg: Any, name: str) -> None:
    if not 0 <= getattr(cfg, name) <= 65535:
        raise ConfigError(f"{name} must be a port in 0-65535, got {getattr(cfg, name)!r}")


def _positive(cfg: Any, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) <= 0:
            raise ConfigError(f"{n} must be > 0, got {getattr(cfg, n)!r}")


def _not_negative(cfg: Any, *names: str) -> None:
    for n in names:
        if getattr(cfg, n) < 0:
            raise ConfigError(f"{n} must be >= 0, got {getattr(cfg, n)!r}")


def _pair(cfg: Any, a: str, b: str) -> None:
    if bool(getattr(cfg, a)) != bool(getattr(cfg, b)):
        raise ConfigError(f"{a} and {b} go together: set both or neither")


MAX_SETTING_CHARS = 4096  # a path (PATH_MAX), an address list, a name
SHORTEST_S, LONGEST_S = 0.001, 1e8  # a time in seconds, when it is not 0


def _no_nul(cfg: Any) -> None:
    """No setting holds a NUL (no path, address or name can: the OS refuses
    them) or more than MAX_SETTING_CHARS characters."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(f"{f.name} holds a NUL character")
            if len(value) > MAX_SETTING_CHARS:
                raise ConfigError(f"{f.name} is {len(value)} characters long: at most "
                                  f"{MAX_SETTING_CHARS}")


def _times(cfg: Any) -> None:
    """Every time in seconds (a setting named *_s) is 0 or a time a clock can
    keep: from a millisecond to about three years (checked after the
    settings' own bounds)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name.endswith("_s") and not f.name.endswith("_per_s") and \
                isinstance(value, float | int) and \
                not isinstance(value, bool) and value and \
                not SHORTEST_S <= abs(value) <= LONGEST_S:
            raise ConfigError(f"{f.name}={value!r} is not a time in seconds: use 0 or "
                              f"{SHORTEST_S:g} to {LONGEST_S:g}")


def _readable(cfg: Any, *names: str) -> None:
    for n in names:
        path = getattr(cfg, n)
        if path and "\x00" not in path and not os.access(path, os.R_OK):  # (a NUL is _no_nul's to report)
            raise ConfigError(f"{n} {path!r} is not a readable file")


UNIX_PATH_MAX = 107  # a unix socket's path, in bytes (sun_path, less its NUL)


def check_address(value: str, name: str) -> None:
    """host:port, or unix:///an/absolute/path a socket can have;
    ConfigError naming `name` otherwise."""
    if value.startswith("unix:"):
        path = value.removeprefix("unix://") if value.startswith("unix://") else ""
        if not path.startswith("/"):
            raise ConfigError(f"{name} {value[:120]!r}: a unix socket is unix:///absolute/path")
        if len(path.encode()) > UNIX_PATH_MAX:
            raise ConfigError(f"{name} {value[:120]!r}: a unix socket's path is at most "
                              f"{UNIX_PATH_MAX} bytes, this one {len(path.encode())}")
        return
    _hostport(value, name)


def _hostport(value: str, name: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name} {value!r} is not host:port")
    if int(port) > 65535:
        raise ConfigError(f"{name} {value!r}: port {port} is not in 0-65535")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_size(raw: Any) -> int:
    """Bytes from an int or a size as Kubernetes writes one: 180Gi, 500M,
    1.5Ti (binary with i, decimal without); ValueError for anything else,
    or for a size of 2**63 bytes or more."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        m = _SIZE.fullmatch(str(raw))
        if m is None or len(m.group(1)) > 40:  # (no size has 40 digits)
            raise ValueError("not a size")
        value = int(Decimal(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
    if not -2**63 <= value < 2**63:
        raise ValueError("out of range")
    return value


def shown(raw: Any) -> str:
    """A setting's value as a message quotes it: its repr, cut short (an
    integer too long to print is named, not printed)."""
    try:
        text = repr(raw)
    except ValueError:  # an int of more digits than Python prints
        return "<an integer of thousands of digits>"
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _coerce(f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    typ: Any = f.type if isinstance(f.type, type) else \
        {"int": int, "float": float, "str": str, "bool": bool}[f.type]
    if typ is int and f.name.endswith("_bytes"):
        try:
            return parse_size(raw)
        except ValueError:
            raise ConfigError(f"{f.name}={shown(raw)} from {source} is not a size in bytes "
                              "below 2**63 (e.g. 500000000, 500M, 180Gi)") from None
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(f"{f.name}={shown(raw)} from {source} is not a boolean (true/false)")
    # A YAML file's values come typed: take them only as what they are (a map
    # is no string, 2.7 no integer, true no number).
    wrong = isinstance(raw, (bool, dict, list)) or raw is None \
        or (typ is str and not isinstance(raw, (str, int))) \
        or (typ is int and isinstance(raw, float))
    convert = cast(Callable[[Any], Any], typ)
    value: Any = None
    try:
        value = None if wrong else convert(raw)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or (typ is float and not math.isfinite(value)) \
            or (typ is int and not -2**63 <= value < 2**63):
        kind = {int: "an integer", float: "a finite number", str: "a string"}.get(typ, typ.__name__)
        raise ConfigError(f"{f.name}={shown(raw)} from {source} is not {kind}")
    return value


MAX_SETTINGS_FILE = 16 << 20  # a tokens, certificate or token file's bytes
MAX_CONFIG_FILE = 256 << 10  # a config file's: every setting fits in a few KiB
MAX_YAML_ALIASES = 64  # aliases (*name) in one YAML file: anchors, not bombs


def read_small_file(path: str, what: str, max_bytes: int = MAX_SETTINGS_FILE) -> bytes:
    """The bytes of a settings file: a regular file of at most `max_bytes`
    (never a FIFO, a device or a directory, which could block or never end);
    ConfigError naming `what` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except ValueError as exc:  # a NUL in the name
        raise ConfigError(f"cannot read {what} {path!r}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        bound = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
        raise ConfigError(f"{what} {path} is larger than {bound}")
    return data


class _SettingsLoader(yaml.SafeLoader):
    """safe_load's loader, stricter: a key twice in one mapping and more
    than MAX_YAML_ALIASES aliases are errors."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_YAML_ALIASES} aliases")
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):  # type: ignore[no-untyped-def]
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # longer than Python reads: its digits, as the environment has them
            return self.construct_scalar(node)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) or key is None:
                if key in seen:
                    raise yaml.YAMLError(f"key {str(key)[:60]!r} is given twice "
                                         f"(line {key_node.start_mark.line + 1})")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_SettingsLoader.add_constructor("tag:yaml.org,2002:int", _SettingsLoader.construct_yaml_int)


def read_yaml(path: str, what: str, max_bytes: int = MAX_SETTINGS_FILE) -> Any:
    """A YAML file's content; ConfigError naming `what` when it cannot be
    read (read_small_file) or is not UTF-8 YAML, names a key twice in a
    mapping or has more than MAX_YAML_ALIASES aliases."""
    try:
        text = read_small_file(path, what, max_bytes).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    try:
        return yaml.load(text, Loader=_SettingsLoader)
    except RecursionError:
        raise ConfigError(f"{what} {path} is not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: "
                          f"{' '.join(str(exc).split())[:300]}") from None
    except ValueError as exc:  # an integer longer than Python reads (4,300 digits)
        raise ConfigError(f"{what} {path} holds a value that cannot be read: "
                          f"{str(exc).splitlines()[0][:200]}") from None


def load(cls: type, *, flags: dict[str, Any] | None = None,
         env: Mapping[str, str] | None = None,
         file: str | None = None, defaults: dict[str, Any] | None = None,
         defaults_from: str = "", validate: bool = True,
         problems: list[str] | None = None) -> tuple[Any, dict[str, str]]:
    """Build and validate a config; returns it and {setting: source}.
    `defaults` replace the class's defaults (a flag, the environment or the
    file still win); `defaults_from` names who set them. With `problems`, a
    value that cannot be read is added to it (and the default stands) instead
    of raising; with validate=False, the config is not checked."""
    if env is None:
        env = os.environ
    file_values: dict[str, Any] = {}
    if file:
        file_values = read_yaml(file, "config file", MAX_CONFIG_FILE) or {}
        if not isinstance(file_values, dict):
            raise ConfigError(f"config file {file} must hold a mapping of settings")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k)[:60] for k in file_values if k not in known)
    if unknown:
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise ConfigError(f"unknown settings in {file}: {', '.join(unknown[:10])}{more}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in known.items():
        if flags and flags.get(name) is not None:
            raw, src = flags[name], f"flag {flag_name(name)}"
        elif env_name(name) in env:
            raw, src = env[env_name(name)], f"env {env_name(name)}"
        elif name in file_values:
            raw, src = file_values[name], f"file {file}"
        elif defaults and name in defaults:
            values[name], sources[name] = defaults[name], f"default of {defaults_from}"
            continue
        else:
            sources[name] = "default"
            continue
        try:
            values[name], sources[name] = _coerce(f, raw, "flag" if src.startswith("flag") else src), src
        except ConfigError as exc:
            if problems is None:
                raise
            problems.append(str(exc))
            sources[name] = f"default ({src} refused)"
    cfg = cls(**values)
    if validate:
        cfg.validate()
    return cfg, sources
