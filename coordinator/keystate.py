"""How a coordinator reads what etcd holds of a key: its state (artifact, claim, verdict, hedge), the holder and verdict it names, and a replica's waiters of a key as their record says."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

from compilecast.v1 import cache_pb2 as pb

from .etcd import (
    KV,
)
from .records import (
    json_dict,
    tenant_of,
)


@dataclass
class KeyState:
    artifact: pb.ArtifactInfo | None
    artifact_rev: int
    lease: dict | None
    lease_rev: int
    local: dict | None
    hedge: dict | None = None


def lease_owner(sk: str, req: pb.Requester) -> tuple | None:
    """Whose claims may share an etcd lease (coordinator/leases.py): one
    process, as the tenant, its job and process id and its own name
    (host:pid, which every worker sends) tell it. A requester that does not
    name itself gets a lease of its own per claim."""
    if not req.client:
        return None
    return tenant_of(sk), req.job, req.process_id, req.client


def revocation_reason(kv: KV) -> str:
    try:
        return json.loads(kv.value)["reason"]
    except (ValueError, KeyError, TypeError):
        return "revoked"


# A key's records, P/<kind>/<tenant>/<key>: what each kind is.
RECORD_KINDS = {"a": "index", "l": "compile lease", "x": "compile-locally", "h": "hedge"}
RECORDS = "alxh"  # the ones a decision reads, in this order


def local_verdict(marker: dict) -> dict:
    """The reason and cause of a COMPILE_LOCALLY from a key's "compile
    locally" marker (one written before causes has none: a warning)."""
    cause = marker.get("cause")
    return {"reason": marker.get("reason", "not cached"),
            "local_cause": cause if cause in pb.LocalCause.values() else 0}


def holder_name(rec: dict) -> str:
    if rec.get("job"):
        return f"job {rec['job']} process {rec.get('process', 0)} ({rec.get('client', '?')})"
    return rec.get("client") or "an independent process"


class KeyWaiters:
    """A replica's waiters of one key: how many wait under each rank (the
    process id in a job, else the arrival time: the lowest goes first) and
    of each job, and the lowest rank."""

    __slots__ = ("count", "jobs", "lowest", "ranks")

    def __init__(self) -> None:
        self.ranks: collections.Counter[str] = collections.Counter()
        self.jobs: collections.Counter[str] = collections.Counter()
        self.count = 0
        self.lowest = ""

    def add(self, rank: str, job: str) -> None:
        self.ranks[rank] += 1
        self.jobs[job] += 1
        self.count += 1
        if self.count == 1 or rank < self.lowest:
            self.lowest = rank

    def remove(self, rank: str, job: str) -> None:
        self.count -= 1
        for counter, name in ((self.ranks, rank), (self.jobs, job)):
            counter[name] -= 1
            if not counter[name]:
                del counter[name]
        if rank == self.lowest and rank not in self.ranks:
            # Each leave of the lowest scans once: a burst of n leaves in any
            # order meets the lowest about ln(n) times.
            self.lowest = min(self.ranks, default="")

    def below(self, rank: str) -> int:
        """How many wait here under a lower rank."""
        return sum(n for r, n in self.ranks.items() if r < rank)

    def record(self) -> bytes:
        return json.dumps({"count": self.count, "lowest": self.lowest,
                           "jobs": dict(self.jobs)}).encode()


def lowest_rank(kv: KV) -> str | None:
    """The lowest rank a replica's P/w record of its waiters names."""
    d = json_dict(kv.value) or {}
    return d.get("lowest") if isinstance(d.get("lowest"), str) and d["lowest"] else None


def waiters_by_job(kv: KV) -> dict[str, int]:
    """How many waiters of each job a replica's P/w record counts (one that
    does not parse: one waiter, of no job)."""
    d = json_dict(kv.value) or {}
    if "count" not in d:
        return {"": 1}
    jobs = d.get("jobs")
    if not isinstance(jobs, dict):
        return {}
    return {str(j): n for j, n in jobs.items() if isinstance(n, int) and n > 0}
