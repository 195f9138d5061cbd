"""Synchronous client of the CompileCache API, for code inside a user's
process (the JAX integration), the CLI and tests.

Every call has a deadline. Artifacts are verified against their digest before
they are returned; a mismatch raises CorruptBlob and the bytes are dropped.
Lease keepalives run on a daemon thread that never blocks the caller.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from compilecast import retry, tracing, validate, wire
from compilecast.deadline import Deadline
from compilecast.decide import ends_wait
from compilecast.errors import CompilecastError, CorruptBlob, CutOff, Unavailable
from compilecast.grpcutil import CHANNEL_OPTIONS, TlsFiles, bearer
from compilecast.negotiate import PROCESS_FETCH, WAIT, Ends, Ladder, Routes, Way, carry
from compilecast.rpcedge import edged
from compilecast.streams import Sha256
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import TRANSFER_S

from . import policy
from .clientpublish import LeaseKeepers, Publisher
from .handoff import handoff_supported
from .identity import Identity
from .policy import acquire_request
from .received import Follower, Received, Stalled, Unfollowable, Watchdog, inflater
from .routeends import (
    DataPlane,
    DataPlaneUpload,
    GrowingFile,
    Handoff,
    LocalFile,
    Sender,
    Taker,
    UploadTickets,
)

log = logging.getLogger(__name__)

STALL_S = 60.0  # a transfer that moves nothing for this long is given up


class CacheClient:
    def __init__(self, target: str, *, timeout_s: float = 5.0,
                 identity: Identity | None = None, token: str = "",
                 tls: TlsFiles | None = None,
                 stall_s: float = STALL_S) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.stall_s = stall_s  # fetches and publishes: given up when nothing moves this long
        self.identity = identity or Identity()
        creds = tls.credentials() if tls is not None else None  # (None: plaintext)
        self._channel = (grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS) if creds
                         else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
        self._channel = grpc.intercept_channel(self._channel, _Metadata(bearer(token))) \
            if token or tracing.on() else self._channel
        # The one gRPC edge: every call raises compilecast's errors (compilecast/rpcedge.py).
        self.stub = edged(wire.stub(self._channel))
        self._directories = edged(rpc.HostDirectoriesStub(self._channel))  # the host's worker only
        # The routes besides gRPC this process may take (compilecast/negotiate.py),
        # each built as this process's end of it (worker/inprocess/routeends.py):
        # to this host's worker (a unix socket), fetches answered with the host
        # cache's file, or its file as the worker writes it, and publishes
        # handed over as sealed memory files; from a coordinator (plaintext
        # TCP), whole artifacts, uploads and waits over its data plane.
        unix = target.startswith("unix:")
        tickets = UploadTickets(self.stub, target, timeout_s=timeout_s)
        local = LocalFile() if unix else None
        self.growing = GrowingFile()
        handoff = Handoff(stall_s=stall_s) if unix and handoff_supported() else None
        tcp = not unix and creds is None
        plane = DataPlane(target, stall_s=stall_s, timeout_s=timeout_s) if tcp else None
        upload = DataPlaneUpload(target, stall_s=stall_s) if tcp else None
        self.routes = Routes.of([tickets, local, self.growing if unix else None, handoff, plane,
                                 upload])
        self.takers = Ends[Taker]([local, plane])  # what a fetch's answer names
        self.waiters = Ends[DataPlane]([plane])  # where a wait goes on
        self.leases = LeaseKeepers(self.keepalive)
        self.publisher = Publisher(self.stub, target, self.routes, self.leases,
                                   tickets=tickets, senders=Ends[Sender]([handoff, upload]),
                                   stall_s=stall_s)

    def close(self) -> None:
        self.leases.close()
        self._channel.close()

    # -- publishes and leases (worker/inprocess/clientpublish.py) ------------------
    def publish(self, key: str, lease: pb.Lease, data: bytes,
                compile_time_s: float, recipe: pb.Recipe | None = None, *,
                identity: Identity | None = None) -> pb.ArtifactInfo:
        """`identity`: the one the lease was taken with (default: the client's)."""
        return self.publisher.publish(key, lease, data, compile_time_s, recipe,
                                      requester=(identity or self.identity).requester())

    def keep_lease(self, key: str, lease: pb.Lease) -> None:
        """Keep the claim on `key` alive in the background until stop_lease(key, lease)."""
        self.leases.keep(key, lease)

    def stop_lease(self, key: str, lease: pb.Lease) -> None:
        self.leases.stop(key, lease)

    # -- decisions -------------------------------------------------------
    def acquire(self, key: str, *, components: dict[str, str] | None = None,
                program_name: str = "", key_seconds: float = 0.0,
                identity: Identity | None = None) -> pb.AcquireResponse:
        """`identity`: who asks for this program (default: the client's)."""
        return self.ask(acquire_request(key, identity or self.identity, components=components,
                                        program_name=program_name, key_seconds=key_seconds))

    def ask(self, request: pb.AcquireRequest) -> pb.AcquireResponse:
        """Acquire, asked again while the worker restarts (retry.ACQUIRE)."""
        return retry.ACQUIRE.run(functools.partial(self.stub.Acquire, request,
                                                   timeout=self.timeout_s),
                                 what=f"the ask for {request.key}")

    def acquire_many(self, keys: list[str]) -> list[pb.AcquireResponse]:
        req = self.identity.requester()
        resp = self.stub.AcquireMany(pb.AcquireManyRequest(
            requests=[pb.AcquireRequest(key=k, requester=req) for k in keys]),
            timeout=self.timeout_s)
        return list(resp.responses)

    def describe(self, key: str) -> pb.DescribeKeyResponse:
        return self.stub.DescribeKey(pb.DescribeKeyRequest(key=key), timeout=self.timeout_s)

    def list_artifacts(self, *, page: int = 0, prefix: str = "") -> Iterator[pb.ListedArtifact]:
        """Every published artifact of the caller's tenant whose key starts
        with `prefix`, in key order, asked for `page` at a time (0: the
        coordinator's default)."""
        after = ""
        while True:
            resp = self.stub.ListArtifacts(
                pb.ListArtifactsRequest(after=after, limit=page, prefix=prefix),
                timeout=self.timeout_s)
            yield from resp.artifacts
            if not resp.next_after:
                return
            after = resp.next_after

    # -- synced directories (the host's worker only) ----------------------
    def open_directory(self, kind: str, namespace: dict[str, str], *, publish_off: str = "",
                       install_off: str = "") -> pb.SyncedDirectory:
        """The host's directory of `kind` for `namespace`, which the worker
        keeps in sync with the fleet's (worker/daemon/dirsync.py)."""
        return self._directories.OpenDirectory(
            pb.OpenDirectoryRequest(kind=kind, namespace=namespace, publish_off=publish_off,
                                    install_off=install_off),
            timeout=self.timeout_s).directory

    def sync_directory(self, kind: str, namespace_id: str, *,
                       timeout_s: float = 60.0) -> pb.SyncDirectoryResponse:
        """One sync pass of an open directory, now."""
        return self._directories.SyncDirectory(
            pb.SyncDirectoryRequest(kind=kind, namespace_id=namespace_id), timeout=timeout_s)

    def wait(self, key: str, within: Deadline | float, *, publishing: bool = False,
             identity: Identity | None = None) -> pb.WaitEvent:
        """Wait until HIT, promotion (COMPILE) or COMPILE_LOCALLY; with
        `publishing`, also return the WAIT event that says the holder has
        started to publish (it carries the artifact: a fetch streams it).

        Never blocks past the deadline (`within`: a door's share-binary
        deadline, or seconds from now) plus the call deadline slack: the
        server ends the stream by it, and the client deadline backs it up. A
        wait that ran and then broke (UNAVAILABLE: the worker restarting) is
        sent again before the deadline; one refused at once is not.
        """
        return self._wait(key, Deadline.of(within), publishing, False, identity)[0]

    def _wait(self, key: str, deadline: Deadline, publishing: bool,
              data_wait: bool, identity: Identity | None) -> tuple[pb.WaitEvent, bytes | None]:
        """`wait`; with `data_wait`, over the coordinator's data plane where it
        offers that, and then with the verified bytes after a HIT when they
        came along (else None)."""
        return carry(self.routes.ladder(WAIT if data_wait else (), key=key),
                     lambda ladder: self._wait_once(key, deadline, publishing, ladder, identity),
                     again=retry.WAIT, what=f"the wait for {key}", deadline=deadline)

    def _wait_once(self, key: str, deadline: Deadline, publishing: bool, ladder: Ladder,
                   identity: Identity | None) -> tuple[pb.WaitEvent, bytes | None]:
        if ladder.failures and deadline.passed:  # the data plane's wait took it all
            return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                reason="share-binary timeout passed; compile locally"), None
        request = ladder.offer(pb.WaitRequest(
            key=key, requester=(identity or self.identity).requester(),
            timeout_ms=deadline.left_ms()))
        call = self.stub.Wait(request, timeout=max(0.001, deadline.left_s()) + self.timeout_s)
        for event in call:
            way = ladder.taken(event, request)
            if way is not None:  # the wait goes on there (the stream's only message)
                call.cancel()
                return self.waiters.of(way).wait(key, event.data_ticket, deadline)
            if ends_wait(event, publishing):
                call.cancel()
                return event, None
        return pb.WaitEvent(decision=pb.COMPILE_LOCALLY, reason="wait stream ended early"), None

    def wait_and_fetch(self, key: str, within: Deadline | float, *,
                       identity: Identity | None = None) -> tuple[pb.WaitEvent, bytes | None]:
        """Wait as `wait` does and fetch the artifact as soon as its holder
        starts to publish it, so the download overlaps the upload. Returns a
        HIT event and the verified bytes, or the event that ended the wait
        (COMPILE, COMPILE_LOCALLY) and None. If that early fetch fails (the
        publish failed midway), the wait goes on for the published artifact
        before the same deadline."""
        deadline = Deadline.of(within)
        early = True
        while True:
            if deadline.passed:
                return pb.WaitEvent(decision=pb.COMPILE_LOCALLY,
                                    reason=f"share-binary timeout of {deadline.said()} "
                                           "passed"), None
            # The first wait may go over the data plane, and bring the bytes.
            event, data = self._wait(key, deadline, early, early, identity)
            if data is not None:
                return event, data
            if event.decision not in (pb.HIT, pb.WAIT):
                return event, None
            try:
                info, data = self.fetch(key, event.artifact.digest)
            except CompilecastError as exc:
                if event.decision == pb.HIT:
                    raise
                why = exc.status.name if not isinstance(exc, CorruptBlob) else str(exc)
                log.info("fetching %s while it was published failed (%s); waiting for the "
                         "published artifact", key, why)
                early = False
                continue
            return pb.WaitEvent(decision=pb.HIT, artifact=info), data

    # -- artifacts -------------------------------------------------------
    def fetch(self, key: str, digest: str = "") -> tuple[pb.ArtifactInfo, bytes]:
        """Fetch and verify an artifact; returns its info and bytes. It takes
        as long as the bytes keep coming (the coordinator's heartbeats count),
        and raises Stalled when nothing came for `stall_s`. A fetch cut off
        midway (UNAVAILABLE after its header: the worker restarting) is tried
        again; one refused from the start is not (nobody there: fail fast)."""
        return carry(self.routes.ladder(PROCESS_FETCH, key=key),
                     lambda ladder: self._fetch_via(key, digest, ladder),
                     again=retry.FETCH, what=f"the fetch of {key}")

    def _fetch_via(self, key: str, digest: str, ladder: Ladder) -> tuple[pb.ArtifactInfo, bytes]:
        """One ask, offering the routes left on `ladder`: the server answers
        with the bytes or with one of them, which this end then takes
        (RouteFailed where it cannot)."""
        try:
            info, way, answer = self._fetch_stream(key, digest, ladder)
        except Unfollowable as exc:
            raise self.growing.unfollowable(exc) from None
        if way is None:  # the gRPC stream's bytes, verified
            return info, answer
        return info, self.takers.of(way).take(key, info, answer)

    def _fetch_stream(self, key: str, digest: str, ladder: Ladder
                      ) -> tuple[pb.ArtifactInfo, Way | None, Any]:
        """The artifact's info, None and its verified bytes; or the way (of
        those `ladder` offers) the server answered with instead and that
        way's answer (the host cache file's path, a data plane's ticket). Where
        the growing file is offered, the worker may go on in its file as it
        writes it; Unfollowable when that file cannot be read here."""
        request = ladder.offer(pb.FetchRequest(key=key, digest=digest, accept_zstd=True))
        info = None
        received = Received(key)
        h = Sha256()  # on a thread of its own for a big artifact: overlaps receiving
        follower = Follower(key, received, h)

        def take(data) -> None:
            h.update(data)
            received.add(data)

        inflate = None
        call = self.stub.Fetch(request, timeout=TRANSFER_S)
        with Watchdog(self.stall_s).watching(call.cancel) as dog, contextlib.closing(h):
            try:
                for chunk in call:
                    dog.tick()
                    if chunk.local_growing or follower.following is not None:
                        info = follower.take(chunk, info, inflate is not None)
                        continue
                    if chunk.HasField("artifact"):
                        info = chunk.artifact
                        way = ladder.taken(chunk, request)
                        if way is not None:
                            if digest and info.digest != digest:
                                raise CorruptBlob(f"the server answered {key} with "
                                                  f"{info.digest}, not {digest}")
                            call.cancel()  # (its only message)
                            return info, way, getattr(chunk, way.answer)
                        received.expect(info.size)
                    if chunk.zstd_data:
                        if inflate is None:
                            inflate = inflater(key, info, received, take)
                        try:
                            inflate.feed(chunk.zstd_data)
                        except CorruptBlob as exc:
                            # A stream relayed as it came (a worker's fill from
                            # a data plane or a peer) whose source sent a bad
                            # frame: the relay takes another route, and its
                            # copy is whole after it. Asked again (retry.FETCH);
                            # what comes is verified as ever.
                            raise CutOff(f"fetch of {key}: its zstd stream does not decode "
                                         f"({exc})") from None
                    elif chunk.data:
                        if inflate is not None:
                            raise CorruptBlob(f"fetch of {key} mixed zstd_data and data")
                        take(chunk.data)
            except CompilecastError as exc:
                if dog.fired:
                    raise Stalled(f"fetch of {key} from {self.target} moved nothing for "
                                  f"{self.stall_s:g}s") from None
                if info is not None and isinstance(exc, Unavailable):
                    raise CutOff(str(exc)) from None
                raise
            finally:
                follower.close()
        follower.check()
        if info is None:
            raise CorruptBlob(f"fetch of {key} returned no artifact header")
        if digest and info.digest != digest:
            raise CorruptBlob(f"the server answered {key} with {info.digest}, not {digest}")
        if h.hexdigest() != info.digest:
            raise CorruptBlob(f"fetched bytes of {key} hash to {h.hexdigest()}, "
                              f"expected {info.digest}; discarded")
        return info, None, received.result()

    def purge(self, keys: list[str], digests: Sequence[str] = (), reason: str = "", *,
              dry_run: bool = False) -> pb.PurgeResponse:
        """Purge, PURGE_PAGE keys and digests a request; one response for all."""
        named = [("key", k) for k in keys] + [("digest", d) for d in digests]
        resp = pb.PurgeResponse()
        purged: set[str] = set()
        revoked: set[str] = set()
        for start in range(0, max(len(named), 1), validate.PURGE_PAGE):
            page = named[start:start + validate.PURGE_PAGE]
            part = self.stub.Purge(pb.PurgeRequest(
                keys=[v for kind, v in page if kind == "key"],
                digests=[v for kind, v in page if kind == "digest"], reason=reason,
                dry_run=dry_run), timeout=max(60.0, self.timeout_s))
            resp.tenant = part.tenant
            resp.purged.extend(k for k in part.purged if k not in purged)
            purged.update(part.purged)
            resp.missing.extend(part.missing)
            resp.revoked.extend(d for d in part.revoked if d not in revoked)
            revoked.update(part.revoked)
        return resp

    def revoked(self, since_revision: int = 0) -> pb.RevokedResponse:
        return self.stub.Revoked(pb.RevokedRequest(since_revision=since_revision),
                                 timeout=self.timeout_s)

    def release(self, key: str, lease: pb.Lease, reason: pb.ReleaseReason.ValueType,
                detail: str = "") -> None:
        self.stub.Release(pb.ReleaseRequest(key=key, lease=lease, reason=reason,
                                            detail=detail[:validate.MAX_DETAIL_LEN]),
                          timeout=self.timeout_s)

    def keepalive(self, key: str, lease: pb.Lease) -> int:
        return self.stub.KeepAlive(pb.KeepAliveRequest(key=key, lease=lease),
                                   timeout=self.timeout_s).ttl_seconds

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=self.timeout_s)

    # -- ahead-of-time compiles ---------------------------------------------
    def list_recipes(self, job: str) -> list[pb.Recipe]:
        return list(self.stub.ListRecipes(pb.ListRecipesRequest(job=job),
                                          timeout=max(60.0, self.timeout_s)))

    def submit(self, recipes: Sequence[pb.Recipe] = (), *, replay_job: str = "",
               target: pb.Target | None = None) -> list[str]:
        req = pb.SubmitCompilesRequest(recipes=recipes, replay_job=replay_job, target=target)
        return list(self.stub.SubmitCompiles(req, timeout=max(60.0, self.timeout_s)).task_ids)

    def claim(self, worker: str, wait_ms: int) -> pb.ClaimCompileResponse:
        return self.stub.ClaimCompile(pb.ClaimCompileRequest(worker=worker, wait_ms=wait_ms),
                                      timeout=self.timeout_s + wait_ms / 1000.0)

    def renew(self, task_id: str, claim: pb.Lease) -> int:
        return self.stub.RenewClaim(pb.RenewClaimRequest(task_id=task_id, claim=claim),
                                    timeout=self.timeout_s).ttl_seconds

    def finish(self, task_id: str, claim: pb.Lease, ok: bool, detail: str, key: str = "") -> None:
        self.stub.FinishCompile(pb.FinishCompileRequest(task_id=task_id, claim=claim, ok=ok,
                                                        detail=detail[:validate.MAX_DETAIL_LEN],
                                                        key=key),
                                timeout=self.timeout_s)

    def tasks(self, task_ids: Sequence[str] = ()) -> list[pb.TaskStatus]:
        return list(self.stub.Tasks(pb.TasksRequest(task_ids=task_ids),
                                    timeout=self.timeout_s).tasks)

    # -- lease keepalive thread ------------------------------------------
class ClientShell:
    """A CacheClient as the synchronous shell of the client policy
    (worker/inprocess/policy.py, `drive`): the JAX door's."""

    def __init__(self, client: CacheClient) -> None:
        self.client = client

    def ask(self, step: policy.Ask) -> pb.AcquireResponse:
        return self.client.ask(step.request)

    def await_(self, step: policy.Await) -> tuple[pb.WaitEvent, bytes | None]:
        log.info("compilecast: waiting for %s", step.key, extra={"key": step.key})
        # Fetched as soon as the holder starts publishing: the bytes stream
        # here while they upload.
        return self.client.wait_and_fetch(step.key, step.deadline, identity=step.identity)

    def fetch(self, step: policy.Fetch) -> bytes:
        return self.client.fetch(step.key, step.digest)[1]  # verified against the digest

    def publish(self, step: policy.Publish) -> pb.ArtifactInfo:
        return self.client.publish(step.key, step.lease, step.data, step.seconds, step.recipe,
                                   identity=step.identity)

    def release(self, step: policy.Release) -> None:
        with tracing.resumed(step.trace):  # in the trace of the decision that granted it
            self.client.release(step.key, step.lease, step.reason, step.detail)

    def describe(self, step: policy.Describe) -> pb.DescribeKeyResponse:
        return self.client.describe(step.key)


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor):
    """Adds fixed metadata (the bearer token) to every call, and the current
    span's context where tracing is on."""

    def __init__(self, metadata: tuple) -> None:
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata,
                                          *tracing.metadata()))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def wait_until_healthy(target: str, timeout_s: float = 30.0) -> pb.StatusResponse:
    """Poll Status until it answers (for `up` and tests)."""
    deadline = time.monotonic() + timeout_s
    client = CacheClient(target, timeout_s=2.0)
    try:
        while True:
            try:
                return client.status()
            except CompilecastError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        client.close()
