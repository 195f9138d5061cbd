"""Coordinator metrics. One metric per concept, labels for variants, and an
injected registry (never the global one)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from compilecast.v1 import cache_pb2 as pb

# Latency buckets for etcd round trips and the decisions that wait on them:
# a healthy member answers in a millisecond or two, a slow disk's fsync in
# tens, and the client's deadline is seconds.
ETCD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RECENT_WRITES = 1024  # etcd write txns `compilecast status` takes its figures from


@dataclass
class TenantTally:
    """One tenant's lookups, as Status shows them to that tenant."""

    hits: int = 0  # Acquires answered HIT here
    host_hits: int = 0  # hits the workers answered, as they report them
    misses: int = 0  # every other answer
    saved_s: float = 0.0  # the compile time those hits saved


@dataclass
class Tally:
    """What Status reports, counted as it happens (never read back out of
    the registry): each tenant's lookups (tenants are those of the tokens
    file, a bounded set), and the replica's bucket reads."""

    tenants: dict[str, TenantTally] = field(default_factory=dict)
    bucket_errors: int = 0
    bucket_local_hits: int = 0  # bucket reads the replica's own disk answered
    bucket_local_misses: int = 0


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.tally = Tally()
        self._decisions(registry)
        self._bytes(registry)
        self._transfers(registry)
        self._etcd(registry)
        self._etcd_children: dict[str, Any] = {}
        self._recent_writes: deque[float] = deque(maxlen=RECENT_WRITES)  # seconds each
        # Every Acquire counts twice (and one that asked etcd is timed); the
        # labelled children are looked up once.
        self._by_decision = {
            d: (self.lookups.labels("hit" if d == pb.HIT else "miss"),
                self.decisions.labels(pb.Decision.Name(d).lower()),
                self.etcd_decision_seconds.labels(pb.Decision.Name(d).lower()))
            for d in pb.Decision.values() if d != pb.DECISION_UNSPECIFIED
        }

    def _decisions(self, registry: CollectorRegistry) -> None:
        """Acquires, waits and publishes, and the compile time they saved."""
        self.lookups = Counter(
            "compilecast_coordinator_lookups", "Acquire requests by result; host_hit: hits "
            "the workers answered from their host caches (or shared among their processes), "
            "as they report them",
            ["result"], registry=registry,
        )
        # From zero: a rate over the first report counts it.
        self.lookups.labels("host_hit")
        self.decisions = Counter(
            "compilecast_coordinator_decisions", "Decisions returned by Acquire and Wait",
            ["decision"], registry=registry,
        )
        self.compiles = Counter(
            "compilecast_coordinator_compiles",
            "Compile leases granted (first holders and promotions)", ["how"], registry=registry,
        )
        self.publishes = Counter(
            "compilecast_coordinator_publishes", "Publish attempts by outcome",
            ["outcome"], registry=registry,
        )
        self.releases = Counter(
            "compilecast_coordinator_releases", "Leases released without publishing",
            ["reason"], registry=registry,
        )
        self.waits = Counter(
            "compilecast_coordinator_waits", "Finished waits by outcome",
            ["outcome"], registry=registry,
        )
        self.compile_seconds_saved = Counter(
            "compilecast_coordinator_saved_compile_seconds",
            "Compile time avoided by hits (the publisher's compile time per hit)",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "compilecast_coordinator_wait_seconds", "Time a waiter waited",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200), registry=registry,
        )
        self.waiters = Gauge(
            "compilecast_coordinator_waiters", "Waits in progress on this replica",
            registry=registry,
        )
        self.decide_streams = Gauge(
            "compilecast_coordinator_decide_streams",
            "Decide streams open on this replica (one per worker and credential)",
            registry=registry,
        )
        self.key_records_skipped = Counter(
            "compilecast_coordinator_key_records_skipped",
            "Keys whose components went unrecorded: too many waited to be recorded (a storm "
            "of misses); `explain` and misses_by_component do not cover them",
            registry=registry,
        )
        self.decide_gap_ms = Gauge(
            "compilecast_coordinator_decide_gap_ms",
            "The gap between two messages of a Decide stream this replica asks of its "
            "clients now (0: none; it asks while its event loop is busy)",
            registry=registry,
        )
        self.loop_busy = Gauge(
            "compilecast_coordinator_loop_busy",
            "Share of a core the event loop's thread used lately (smoothed)",
            registry=registry,
        )
        self.misses_by_component = Counter(
            "compilecast_coordinator_misses_by_component",
            "Compiles by the key component that differed from the nearest earlier key of "
            "the same program name (new_program: no earlier key)",
            ["component"], registry=registry,
        )

    def _bytes(self, registry: CollectorRegistry) -> None:
        """Artifact bytes: the store and the bucket."""
        self.bytes = Counter(
            "compilecast_coordinator_artifact_bytes",
            "Artifact bytes moved, as sent (zstd as stored, to clients that decode it)",
            ["direction"], registry=registry,
        )
        self.corrupt_blobs = Counter(
            "compilecast_coordinator_corrupt_blobs",
            "Stored blobs that failed digest verification and were quarantined",
            registry=registry,
        )
        self.bucket_seconds = Histogram(
            "compilecast_coordinator_bucket_request_seconds",
            "Requests to the object store's bucket, by operation",
            ["op"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.bucket_errors = Counter(
            "compilecast_coordinator_bucket_errors",
            "Requests to the bucket that failed (refused, unreachable), by operation",
            ["op"], registry=registry,
        )
        self.bucket_stalls = Counter(
            "compilecast_coordinator_bucket_stalls",
            "Checks of whether a blob is in the bucket that got no answer within their "
            "deadline, or none at all (a slow, hung or unreachable bucket): the decision went "
            "on without it", registry=registry,
        )
        self.bucket_checks_waiting = Gauge(
            "compilecast_coordinator_bucket_checks_waiting",
            "Checks of whether a blob is in the bucket waiting on it now (one per digest; "
            "a stopped or hung bucket: they stay)", registry=registry,
        )
        self.bucket_bytes = Counter(
            "compilecast_coordinator_bucket_bytes",
            "Artifact bytes moved to (upload) and from (get_bytes) the bucket",
            ["op"], registry=registry,
        )
        self.bucket_local = Counter(
            "compilecast_coordinator_bucket_local_reads",
            "Reads of a bucket-backed store by whether this replica's local cache had the "
            "blob (hit) or fetched it from the bucket (miss)",
            ["result"], registry=registry,
        )
        self.bucket_urls = Counter(
            "compilecast_coordinator_bucket_urls",
            "Fetches answered with a presigned URL of the bucket's object (the bytes "
            "went from the bucket to the client, not through this replica)",
            registry=registry,
        )
        self.scrubbed = Counter(
            "compilecast_coordinator_scrubbed_blobs",
            "Stored blobs the background scrub verified",
            registry=registry,
        )
        self.store_bytes = Gauge(
            "compilecast_coordinator_store_bytes",
            "Bytes in the artifact store as this replica counts them (its writes, and the "
            "whole directory every store scan)",
            registry=registry,
        )
        self.store_evictions = Counter(
            "compilecast_coordinator_store_evictions",
            "Artifacts evicted from the bounded store (least recently read first); each "
            "recompiles when next asked for",
            registry=registry,
        )

    def _transfers(self, registry: CollectorRegistry) -> None:
        """How artifacts travel: the data plane, uploads streamed to readers, relays."""
        self.data_plane = Counter(
            "compilecast_coordinator_data_plane_sends",
            "Data plane connections by result: sent (a whole blob), refused (no such "
            "ticket), broken (the client went away midway), expired (a ticket never used)",
            ["result"], registry=registry,
        )
        self.data_uploads = Counter(
            "compilecast_coordinator_data_plane_uploads",
            "Publishes over the data plane by result: published, refused (the publish "
            "was refused, as a Publish stream would have been), broken (the connection broke "
            "or stalled midway), expired (a ticket never used)",
            ["result"], registry=registry,
        )
        self.data_waits = Counter(
            "compilecast_coordinator_data_plane_waits",
            "Waits carried on over the data plane by result: hit_sent (the HIT and the "
            "blob after it), answered (the event that ended the wait, without bytes), left "
            "(the client closed first), broken (the answer's send broke off), expired (a "
            "ticket never used)",
            ["result"], registry=registry,
        )
        self.data_tickets = Counter(
            "compilecast_coordinator_data_tickets",
            "Fetches answered with a data plane ticket instead of the bytes over gRPC",
            registry=registry,
        )
        self.streamed_while_publishing = Counter(
            "compilecast_coordinator_fetches_while_publishing",
            "Fetches of an upload still in progress on this replica (streamed as it "
            "arrives, to publish_stream_readers at a time; the rest once committed)",
            registry=registry,
        )
        self.relays = Counter(
            "compilecast_coordinator_relay_redirects",
            "Fetches sent to a peer worker that is downloading or holds the artifact",
            registry=registry,
        )
        self.job_streams = Gauge(
            "compilecast_coordinator_job_streams",
            "Job streams (WatchJob) this replica serves now: at most job_stream_fanout a "
            "job, the rest hang from workers that relay the job's news",
            registry=registry,
        )
        self.job_stream_events = Counter(
            "compilecast_coordinator_job_stream_events",
            "Job streams by what happened: redirected (pointed at a relaying worker), "
            "resumed (opened again after the news it had heard), named (keys hosts named "
            "that nobody had claimed)",
            ["event"], registry=registry,
        )
        self.job_news_bytes = Counter(
            "compilecast_coordinator_job_news_bytes",
            "Bytes of job news (publishes, claims, turns) sent on job streams",
            registry=registry,
        )

    def _etcd(self, registry: CollectorRegistry) -> None:
        """etcd, the sweeps, operators' purges and farm tasks."""
        self.etcd_unavailable = Counter(
            "compilecast_coordinator_etcd_unavailable",
            "Decisions (Acquire, Wait) answered compile-locally because etcd could not be reached",
            registry=registry,
        )
        self.swept = Counter(
            "compilecast_coordinator_swept",
            "Records the index sweep dropped from etcd: index entries whose artifacts the "
            "store evicted, and old key records of keys without an artifact",
            ["record"],
            registry=registry,
        )
        self.purges = Counter(
            "compilecast_coordinator_purges",
            "Artifacts an operator took out of service (digests revoked by Purge)",
            registry=registry,
        )
        self.tasks = Counter(
            "compilecast_coordinator_farm_tasks",
            "Compile-farm tasks by event (submitted, claimed, done, failed)",
            ["event"], registry=registry,
        )
        self.etcd_seconds = Histogram(
            "compilecast_coordinator_etcd_request_seconds",
            "etcd requests this replica made, by etcd method (Txn, Range, Put, LeaseGrant, "
            "...), from the call until its answer or failure, retries included",
            ["method"], buckets=ETCD_BUCKETS, registry=registry,
        )
        self.etcd_decision_seconds = Histogram(
            "compilecast_coordinator_etcd_decision_seconds",
            "Acquire decisions this replica could not answer from memory (a miss's claim, "
            "or a read of the key's state in etcd), from the request to the answer, by "
            "decision",
            ["decision"], buckets=ETCD_BUCKETS, registry=registry,
        )

    def observe_bucket(self, op: str, seconds: float, ok: bool, nbytes: int) -> None:
        if op != "get_bytes":  # (a download's bytes, counted once it ends)
            self.bucket_seconds.labels(op).observe(seconds)
            if not ok:
                self.bucket_errors.labels(op).inc()
                self.tally.bucket_errors += 1
        if nbytes and op in ("upload", "get_bytes"):
            self.bucket_bytes.labels(op).inc(nbytes)

    def observe_local(self, hit: bool) -> None:
        self.bucket_local.labels("hit" if hit else "miss").inc()
        if hit:
            self.tally.bucket_local_hits += 1
        else:
            self.tally.bucket_local_misses += 1

    def observe_etcd(self, method: str, seconds: float) -> None:
        """One etcd request's time (the Etcd client's `observe` hook)."""
        child = self._etcd_children.get(method)
        if child is None:
            child = self._etcd_children[method] = self.etcd_seconds.labels(method)
        child.observe(seconds)
        if method == "Txn":
            self._recent_writes.append(seconds)

    def recent_etcd_writes(self) -> tuple[int, float, float]:
        """How many of the latest etcd write txns there are (at most
        RECENT_WRITES), and their p50 and p99 in seconds (0 without any)."""
        times = sorted(self._recent_writes)
        if not times:
            return 0, 0.0, 0.0
        return len(times), times[len(times) // 2], times[min(len(times) - 1,
                                                              int(len(times) * 0.99))]

    def observe_etcd_decision(self, decision: pb.Decision.ValueType, seconds: float) -> None:
        self._by_decision[decision][2].observe(seconds)

    def of(self, tenant: str) -> TenantTally:
        """The tenant's tally."""
        tally = self.tally.tenants.get(tenant)
        if tally is None:
            tally = self.tally.tenants[tenant] = TenantTally()
        return tally

    def count_decision(self, tenant: str, decision: pb.Decision.ValueType, n: int = 1) -> None:
        """`n` Acquires of `tenant` answered with `decision`."""
        lookup, decided, _ = self._by_decision[decision]
        lookup.inc(n)
        decided.inc(n)
        if decision == pb.HIT:
            self.of(tenant).hits += n
        else:
            self.of(tenant).misses += n

    def saved(self, tenant: str, seconds: float) -> None:
        """Compile time that `tenant`'s hits saved."""
        self.compile_seconds_saved.inc(seconds)
        self.of(tenant).saved_s += seconds

    def host_hits(self, tenant: str, hits: int, seconds: float) -> None:
        """Hits a worker answered without us, and the compile time they saved."""
        self.lookups.labels("host_hit").inc(hits)
        self.of(tenant).host_hits += hits
        self.saved(tenant, seconds)
