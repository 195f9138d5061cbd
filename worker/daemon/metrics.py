"""Worker metrics (injected registry)."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from compilecast.v1 import cache_pb2 as pb


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Interposed compiles by (platform, outcome), for Status.
        self._pjrt: collections.Counter[tuple[str, str]] = collections.Counter()
        self._decisions(registry)
        self._transfers(registry)
        self._host_cache(registry)
        self._frameworks(registry)

    def _decisions(self, registry: CollectorRegistry) -> None:
        """What this host's processes asked, and how it was answered."""
        self.lookups = Counter(
            "compilecast_worker_lookups",
            "Acquire requests by outcome: host_hit (served from the host cache), hit, "
            "compile, wait, or compile_locally (decided upstream or by fallback)",
            ["result"], registry=registry,
        )
        self.manifest_hits = Counter(
            "compilecast_worker_manifest_hits",
            "Acquires answered HIT from a job's manifest (counted among lookups' host_hit)",
            registry=registry,
        )
        self.prefetched = Counter(
            "compilecast_worker_prefetched_artifacts",
            "Artifacts of a job's manifest fetched into the host cache before they were asked for",
            registry=registry,
        )
        self.prefetched_bytes = Counter(
            "compilecast_worker_prefetched_bytes",
            "Bytes of a job's manifest fetched into the host cache before they were asked for",
            registry=registry,
        )
        self.fallbacks = Counter(
            "compilecast_worker_fallbacks",
            "Requests answered 'compile locally' because the coordinator was unreachable",
            ["rpc"], registry=registry,
        )
        self.key_seconds = Histogram(
            "compilecast_worker_key_seconds",
            "Time processes on this host spent computing canonical keys",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=registry,
        )
        self.upstream_decision_seconds = Histogram(
            "compilecast_worker_upstream_decision_seconds",
            "Requests of this host's processes that the host cache did not answer: seconds "
            "until the coordinator's answer (or until it was found unreachable), one sample "
            "a batch, by result",
            ["result"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                 2.5, 5, 10), registry=registry,
        )
        self.waiting = Gauge(
            "compilecast_worker_waiting",
            "Processes on this host waiting for a compile on another host", registry=registry,
        )
        self.waits = Counter(
            "compilecast_worker_waits",
            "Waits of this host's processes: upstream (sent to the coordinator), joined "
            "(shared another local process's upstream wait for the same key) or stream "
            "(on the job's stream; one the stream sends back to ask goes upstream too)",
            ["how"], registry=registry,
        )
        self.decisions = Counter(
            "compilecast_worker_decisions",
            "Requests of this host's processes that the host cache did not answer: upstream "
            "(sent to the coordinator), joined (answered by another local process's request "
            "for the same key) or stream (WAIT here: the job's stream waits for the key)",
            ["how"], registry=registry,
        )
        self.compile_seconds_saved = Counter(
            "compilecast_worker_saved_compile_seconds",
            "Compile time avoided by hits the coordinator did not count: from the host "
            "cache, or a coordinator's HIT shared with another local process's request",
            registry=registry,
        )

    def _transfers(self, registry: CollectorRegistry) -> None:
        """How the bytes came and went: fetches, downloads and the routes they took."""
        self.fetches = Counter(
            "compilecast_worker_fetches", "Fetches served, by where the bytes came from",
            ["source"], registry=registry,
        )
        self.data_plane = Counter(
            "compilecast_worker_data_plane_downloads",
            "Downloads over the coordinator's data plane, or from its bucket by a presigned URL: "
            "taken (the whole artifact came that way), fallback (it failed, and the rest came "
            "over gRPC)",
            ["result"], registry=registry,
        )
        self.handoffs = Counter(
            "compilecast_worker_handoffs",
            "Publishes this host's processes handed over as sealed memory files, by result: "
            "published, refused (the status a Publish would have ended with, or a file not "
            "sealed or of another size), unknown_ticket",
            ["result"], registry=registry,
        )
        self.local_files = Counter(
            "compilecast_worker_local_files",
            "Host cache hits answered with the file's path: the process on this host read and "
            "verified the bytes itself, none of them went through the worker",
            registry=registry,
        )
        self.woken_here = Counter(
            "compilecast_worker_woken_by_host_publish",
            "Waits of this host's processes ended by a publish of another process of the host "
            "through this worker, as it began (they follow the worker's copy of the upload)",
            registry=registry,
        )
        self.growing_files = Counter(
            "compilecast_worker_growing_files",
            "Downloads that a process on this host followed in the host cache's file as this "
            "worker wrote it, instead of taking their bytes over the socket",
            registry=registry,
        )
        self.fetch_seconds = Histogram(
            "compilecast_worker_fetch_seconds", "Time to fill the host cache from the coordinator",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=registry,
        )
        self.bytes = Counter(
            "compilecast_worker_artifact_bytes",
            "Artifact bytes moved (served: as sent, zstd as stored to processes that decode it)",
            ["direction"], registry=registry,
        )
        self.relay_data_plane = Counter(
            "compilecast_worker_relay_data_plane",
            "Relays to peer workers over this worker's relay data plane: offered (a ticket "
            "given), sent (the whole artifact), short (the download it followed failed, or "
            "the peer left), refused (a connection without a valid ticket)",
            ["result"], registry=registry,
        )
        self.relays = Counter(
            "compilecast_worker_relays",
            "Downloads the coordinator pointed at a peer worker (redirected), those that came "
            "whole over the peer's relay data plane (data_plane), and those that went back to "
            "the coordinator because the peer failed (fallback)",
            ["event"], registry=registry,
        )

    def _host_cache(self, registry: CollectorRegistry) -> None:
        """The host cache and what it holds or refuses."""
        self.cache_bytes = Gauge(
            "compilecast_worker_cache_bytes", "Bytes stored in the host cache", registry=registry,
        )
        self.corrupt_blobs = Counter(
            "compilecast_worker_corrupt_blobs",
            "Host-cache blobs that failed digest verification and were quarantined",
            registry=registry,
        )
        self.refused_entries = Counter(
            "compilecast_worker_refused_entries",
            "Host-cache key entries refused and removed: not signed by this worker "
            "(tampered with, or written by another)",
            registry=registry,
        )
        self.revoked = Counter(
            "compilecast_worker_revoked",
            "Artifacts dropped from the host cache because an operator purged them",
            registry=registry,
        )
        self.uncached = Counter(
            "compilecast_worker_uncached",
            "Artifacts this worker passed on without keeping a copy: its disk had no room "
            "above cache_min_free_bytes even after evicting its least recently read ones",
            registry=registry,
        )

    def _frameworks(self, registry: CollectorRegistry) -> None:
        """Synced directories and the PJRT interposer's compiles."""
        self.dir_entries = Counter(
            "compilecast_worker_dir_entries",
            "Entries of the directories this worker keeps in sync, by directory kind and "
            "event: published (a file of this host's sent to the fleet), installed (another "
            "host's entry written here), refused (unverifiable, too large, or listed under "
            "another namespace: never installed)",
            ["kind", "event"], registry=registry,
        )
        self.dir_bytes = Counter(
            "compilecast_worker_dir_bytes",
            "Bytes of the synced directories' entries, by kind and event (published, installed)",
            ["kind", "event"], registry=registry,
        )
        self.pjrt_compiles = Counter(
            "compilecast_worker_pjrt_compiles",
            "Compiles of frameworks on an interposed PJRT plugin (worker/pjrtdoor/pjrtgate.py), by "
            "platform and outcome: hit (loaded a shared executable), compile (held the lease), "
            "local (compiled without sharing), failed (the compile failed or was not published)",
            ["platform", "outcome"], registry=registry,
        )

    def count_pjrt(self, platform: str, outcome: str) -> None:
        """One interposed compile's outcome (hit, compile, local, failed)."""
        self.pjrt_compiles.labels(platform, outcome).inc()
        self._pjrt[(platform, outcome)] += 1

    def pjrt_status(self) -> list[pb.PjrtCompiles]:
        """The interposed compiles per platform, for Status."""
        by: dict[str, pb.PjrtCompiles] = {}
        for (platform, outcome), n in sorted(self._pjrt.items()):
            row = by.setdefault(platform, pb.PjrtCompiles(platform=platform))
            field = {"hit": "hits", "compile": "compiles"}.get(outcome, outcome)
            setattr(row, field, getattr(row, field) + n)
        return list(by.values())
