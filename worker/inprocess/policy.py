"""The one client policy of every door: what a process does with its
worker's answers, from the ask to the lease's end, written once and driven
by two shells (as httpx's BaseClient serves Client and AsyncClient):

    the JAX door (worker/jaxdoor/jax_integration.py)  sync: a CacheClient
    the PJRT gate (worker/pjrtdoor/pjrtgate.py)         async: an AsyncCacheClient

A policy is a generator of steps (`Ask`, `Await`, `Fetch`, `Publish`,
`Release`) that does no I/O: a shell carries out each step it yields
(`drive` or `adrive`) and sends back the result, or throws in the step's
error (compilecast's own: the clients' edges raise nothing else).

    decide   Ask -> (WAIT: Await) -> (HIT: Fetch, verified) -> a Decision:
             HIT with the bytes, COMPILE with the lease, or LOCAL with why.
             A HIT whose copy proves corrupt or gone is asked again (each
             copy is dropped where it is found bad), CORRUPT_ASKS times in
             all, so that the process that found it compiles in its place.
             A caller that may not publish (no token where the worker has
             one) gives a COMPILE's lease back at once and compiles locally.
    settle   Publish; taken already (AlreadyPublished): Describe the key, and
             bytes of the same digest there are this publish's (an earlier
             try's answer lost, or a hedge that made the same bytes); refused
             for what it is (too large, no room): Release PUBLISH_REFUSED,
             so every waiter compiles at once; any other failure: Release
             ABANDONED, and a waiter is promoted. A release's detail is cut
             to what the wire takes (validate.MAX_DETAIL_LEN).

And the rules every door shares: the key's components go up only from a
job's designated process (`acquire_request`), and a lease is renewed every
TTL/3, at least every KEEPALIVE_MIN_S (`keepalive_every`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from compilecast import validate
from compilecast.deadline import Deadline
from compilecast.errors import (
    AlreadyPublished,
    CompilecastError,
    CorruptBlob,
    InvalidRequest,
    NotFound,
    TooMany,
)
from compilecast.v1 import cache_pb2 as pb

from .identity import Identity

log = logging.getLogger("compilecast.policy")

CORRUPT_ASKS = 3
KEEPALIVE_MIN_S = 0.5

T = TypeVar("T")


def keepalive_every(lease: pb.Lease) -> float:
    """How often a lease holder renews `lease`."""
    return max(lease.ttl_seconds / 3.0, KEEPALIVE_MIN_S)


def acquire_request(key: str, identity: Identity, *, components: dict[str, str] | None = None,
                    program_name: str = "", key_seconds: float = 0.0) -> pb.AcquireRequest:
    """The ask for `key`. Acquire never tells a job's other processes to
    compile, and the coordinator records a key's components only with a
    COMPILE: they go up from the designated process alone (at a pod's job
    start, all but one request of a program carry none)."""
    if identity.job and identity.process_id != identity.designated_process:
        components = None
    return pb.AcquireRequest(key=key, requester=identity.requester(),
                             key_components=components or {}, program_name=program_name[:200],
                             key_seconds=key_seconds)


# -- the steps a shell carries out ---------------------------------------------------

class Shell(Protocol):
    """What a door's client does for a policy's steps (sync: returns the
    result; async: returns an awaitable of it)."""

    def ask(self, step: Ask) -> Any: ...

    def await_(self, step: Await) -> Any: ...

    def fetch(self, step: Fetch) -> Any: ...

    def publish(self, step: Publish) -> Any: ...

    def release(self, step: Release) -> Any: ...

    def describe(self, step: Describe) -> Any: ...


@dataclass(frozen=True)
class Ask:
    """-> pb.AcquireResponse"""

    op: ClassVar[str] = "ask"
    request: pb.AcquireRequest


@dataclass(frozen=True)
class Await:
    """-> (pb.WaitEvent that ended the wait, its verified bytes or None):
    a shell may fetch as the holder publishes and send both."""

    op: ClassVar[str] = "await_"
    key: str
    identity: Identity
    deadline: Deadline  # the door's share-binary deadline


@dataclass(frozen=True)
class Fetch:
    """-> bytes, verified against `digest` (CorruptBlob where they are not)"""

    op: ClassVar[str] = "fetch"
    key: str
    digest: str


@dataclass(frozen=True)
class Publish:
    """-> pb.ArtifactInfo"""

    op: ClassVar[str] = "publish"
    key: str
    lease: pb.Lease
    data: bytes
    seconds: float
    identity: Identity
    recipe: pb.Recipe | None = None


@dataclass(frozen=True)
class Release:
    """-> None. `trace`: the W3C context of the decision that granted the lease."""

    op: ClassVar[str] = "release"
    key: str
    lease: pb.Lease
    reason: pb.ReleaseReason.ValueType
    detail: str
    trace: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Describe:
    """-> pb.DescribeKeyResponse (what the key holds now)"""

    op: ClassVar[str] = "describe"
    key: str


def release(key: str, lease: pb.Lease, reason: pb.ReleaseReason.ValueType, detail: str,
            trace: dict | None = None) -> Release:
    """The Release step, its detail cut to what the wire takes."""
    return Release(key, lease, reason, detail[:validate.MAX_DETAIL_LEN], trace or {})


Step = Ask | Await | Fetch | Publish | Release | Describe
Policy = Generator[Step, Any, T]


def carried_out(step: Step, shell: Shell) -> Any:
    """What `shell` makes of `step`: the shell's method the step names (`op`)."""
    return getattr(shell, step.op)(step)


# -- the outcomes ----------------------------------------------------------------------

@dataclass
class Decision:
    kind: str  # HIT, COMPILE, LOCAL
    key: str
    data: bytes | None = None  # HIT: the verified bytes
    artifact: pb.ArtifactInfo | None = None  # HIT
    lease: pb.Lease | None = None  # COMPILE
    reason: str = ""  # LOCAL
    cause: int = 0  # LOCAL: pb.LocalCause
    waited: bool = False  # the answer came after a wait
    promoted: bool = False  # COMPILE after a wait: the holder went away


@dataclass
class Settled:
    published: bool
    artifact: pb.ArtifactInfo | None = None
    problem: str = ""  # why not
    released: bool = False  # the lease was given back (else it lapses)


# -- the policies ---------------------------------------------------------------------

def decide(request: pb.AcquireRequest, identity: Identity, deadline: Deadline, *,
           may_publish: bool = True) -> Policy[Decision]:
    """HIT, COMPILE or LOCAL for `request` (see the module's docstring); a
    wait for it ends by `deadline` (the door's share-binary deadline, made
    where the decision began: every wait of it shares it)."""
    key = request.key
    for attempt in range(CORRUPT_ASKS):
        answer: pb.AcquireResponse = yield Ask(request)
        decision, artifact, lease = answer.decision, answer.artifact, answer.lease
        reason, cause, waited, data = answer.reason, answer.local_cause, False, None
        if decision == pb.WAIT:
            event, data = yield Await(key, identity, deadline)
            decision, artifact, lease = event.decision, event.artifact, event.lease
            reason, cause, waited = event.reason, event.local_cause, True
            if decision == pb.WAIT:  # the holder publishes: its bytes, as a HIT's
                decision = pb.HIT
        if decision == pb.HIT:
            if data is not None:
                return Decision("HIT", key, data=data, artifact=artifact, waited=waited)
            try:
                data = yield Fetch(key, artifact.digest)
            except (CorruptBlob, NotFound) as exc:
                if attempt + 1 == CORRUPT_ASKS:
                    raise
                log.warning("compilecast: the stored copy of %s is bad or gone (%s); asking "
                            "again", key, exc.status.name, extra={"key": key})
                continue
            return Decision("HIT", key, data=data, artifact=artifact, waited=waited)
        if decision == pb.COMPILE and not may_publish:
            yield from _give_back(key, lease, "this caller publishes nothing")
            return Decision("LOCAL", key, reason="this process has no token (COMPILECAST_TOKEN) "
                            "and the worker has one: it reads the fleet's executables but "
                            "compiles its own misses locally, publishing nothing")
        if decision == pb.COMPILE:
            return Decision("COMPILE", key, lease=lease, waited=waited, promoted=waited)
        return Decision("LOCAL", key, reason=reason or "compile locally", cause=cause,
                        waited=waited)
    raise AssertionError("unreachable")


def _give_back(key: str, lease: pb.Lease, why: str) -> Generator[Step, Any, bool]:
    try:
        yield release(key, lease, pb.ABANDONED, why)
    except CompilecastError as exc:
        log.info("compilecast: release of %s failed (%s); the lease lapses", key,
                 exc.status.name, extra={"key": key})
        return False
    return True


def settle(step: Publish, *, trace: dict | None = None) -> Policy[Settled]:
    """Publish the holder's executable; give the lease back where that fails."""
    try:
        info = yield step
    except AlreadyPublished as exc:
        mine = yield from _published_as(step)
        if mine is not None:
            return Settled(True, artifact=mine)
        problem = f"{exc.status.name}: {exc}"
        yield from _released(step, pb.ABANDONED, problem, trace)
        return Settled(False, problem=problem, released=True)
    except CompilecastError as exc:
        problem = f"{exc.status.name}: {exc}"
        # Refused for what it is (too large, no room): every waiter's publish
        # would be refused too, so they compile at once instead of each being
        # promoted and compiling in turn.
        refused = isinstance(exc, TooMany | InvalidRequest)
        released = yield from _released(
            step, pb.PUBLISH_REFUSED if refused else pb.ABANDONED, problem, trace)
        return Settled(False, problem=problem, released=released)
    return Settled(True, artifact=info)


def _published_as(step: Publish) -> Generator[Step, Any, pb.ArtifactInfo | None]:
    """What the key holds, when it is this publish's bytes."""
    try:
        described: pb.DescribeKeyResponse = yield Describe(step.key)
    except CompilecastError:
        return None
    mine = described.HasField("artifact") and \
        described.artifact.digest == hashlib.sha256(step.data).hexdigest()
    return described.artifact if mine else None


def _released(step: Publish, reason: pb.ReleaseReason.ValueType, problem: str,
              trace: dict | None) -> Generator[Step, Any, bool]:
    try:
        yield release(step.key, step.lease, reason, problem, trace)
    except CompilecastError as failed:
        log.warning("compilecast: release of %s failed (%s); the lease lapses in %ss",
                    step.key, failed.status.name, step.lease.ttl_seconds)
        return False
    return True


# -- the shells' loops --------------------------------------------------------------------

def drive(policy: Policy[T], shell: Shell) -> T:
    """Carry out `policy` with a synchronous shell: its outcome, or the
    error it did not handle."""
    try:
        step = next(policy)
        while True:
            try:
                result = carried_out(step, shell)
            except Exception as exc:
                step = policy.throw(exc)
            else:
                step = policy.send(result)
    except StopIteration as done:
        return done.value


async def adrive(policy: Policy[T], shell: Shell) -> T:
    """`drive` with an asynchronous shell."""
    try:
        step = next(policy)
        while True:
            try:
                pending: Awaitable[Any] = carried_out(step, shell)
                result = await pending
            except Exception as exc:
                step = policy.throw(exc)
            else:
                step = policy.send(result)
    except StopIteration as done:
        return done.value
