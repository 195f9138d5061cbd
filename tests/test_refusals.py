"""Refusals: malformed, unauthorized and stale requests get the right gRPC
status and change nothing; a lost blob compiles again."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from compilecast.errors import InvalidRequest, NotFound, Unavailable
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.worker.inprocess.client import CacheClient, Identity
from compilecast.worker.inprocess.clientpublish import publish_messages

from .conftest import client, code_of, publish

DATA = b"executable-bytes" * 50_000


# -- refusals ----------------------------------------------------------------

@pytest.mark.parametrize("bad_key", ["", "a/b", "x" * 201, "..", "key with space", "ключ"])
def test_malformed_keys_are_invalid_argument(coordinator, bad_key):
    c = client(coordinator.cfg.listen)
    for call in (lambda: c.acquire(bad_key), lambda: c.wait(bad_key, 1),
                 lambda: c.fetch(bad_key)):
        code, details = code_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "key" in details


def test_malformed_publishes_are_invalid_argument(coordinator):
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    digest = hashlib.sha256(DATA).hexdigest()
    cases = {
        "no header": iter([pb.PublishChunk(data=b"x")]),
        "empty stream": iter([]),
        "bad digest": publish_messages(
            pb.PublishHeader(key="k", lease=lease, digest="xyz", size=1), b"x"),
        "no lease": publish_messages(
            pb.PublishHeader(key="k", digest=digest, size=len(DATA)), DATA),
        "zero size": publish_messages(
            pb.PublishHeader(key="k", lease=lease, digest=digest, size=0), DATA),
        "second header": iter([pb.PublishChunk(header=pb.PublishHeader(
            key="k", lease=lease, digest=digest, size=len(DATA))),
            pb.PublishChunk(header=pb.PublishHeader(key="k"))]),
        "more than declared": publish_messages(
            pb.PublishHeader(key="k", lease=lease, digest=digest, size=10), DATA),
    }
    for name, msgs in cases.items():
        code, details = code_of(lambda m=msgs: c.stub.Publish(m, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
    assert coordinator.store.count() == 0


def test_a_publish_may_send_its_digest_last(coordinator):
    """The holder hashes as it sends: a header without a digest, the bytes,
    then the digest alone. That is what CacheClient.publish sends (the
    coordinator does not ask for it first) and it lands as any publish."""
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    assert lease.takes_digest_last
    sent = list(publish_messages(pb.PublishHeader(key="k", lease=lease, size=len(DATA)), DATA))
    assert sent[0].header.digest == "" and sent[-1].digest == hashlib.sha256(DATA).hexdigest()
    info = c.stub.Publish(iter(sent), timeout=10).artifact
    assert info.digest == hashlib.sha256(DATA).hexdigest()
    assert c.fetch("k")[1] == DATA
    lease = c.acquire("k2").lease
    assert c.publish("k2", lease, DATA * 3, 1.0).digest == hashlib.sha256(DATA * 3).hexdigest()


def test_a_digest_sent_last_is_checked_as_one_sent_first(coordinator):
    """Wrong, missing, twice, or not last: refused, nothing stored, and the
    holder can still publish."""
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    digest = hashlib.sha256(DATA).hexdigest()

    def stream(header_digest: str, *tail: pb.PublishChunk):
        msgs = publish_messages(pb.PublishHeader(key="k", lease=lease, size=len(DATA),
                                                 digest=header_digest or digest), DATA)
        msgs = list(msgs)
        if not header_digest:
            msgs[0].header.digest = ""
        return iter(msgs + list(tail))

    cases = {
        "wrong": (stream("", pb.PublishChunk(digest="0" * 64)), "digest mismatch"),
        "missing": (stream(""), "ended without its digest"),
        "malformed": (stream("", pb.PublishChunk(digest="xyz")), "digest 'xyz' is invalid"),
        "twice": (stream(digest, pb.PublishChunk(digest=digest)), "not both"),
        "not last": (stream("", pb.PublishChunk(digest=digest), pb.PublishChunk(data=b"x")),
                     "must be a Publish's last"),
    }
    for name, (msgs, says) in cases.items():
        code, details = code_of(lambda m=msgs: c.stub.Publish(m, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, (name, details)
    assert coordinator.store.count() == 0
    assert list(coordinator.store.tmp_dir.iterdir()) == []
    c.publish("k", lease, DATA, 1.0)
    assert c.fetch("k")[1] == DATA


def test_a_purged_digest_sent_last_is_refused_before_it_is_stored(coordinator):
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    c.publish("k", lease, DATA, 1.0)
    c.purge(["k"], reason="bad build")
    lease = c.acquire("k").lease
    code, details = code_of(lambda: c.publish("k", lease, DATA, 1.0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "purged" in details, details
    assert coordinator.store.count() == 1  # the purged blob only; nothing new stored
    assert code_of(lambda: c.fetch("k"))[0] == grpc.StatusCode.NOT_FOUND


def test_wait_with_negative_timeout_is_invalid(coordinator):
    c = client(coordinator.cfg.listen)
    code, _ = code_of(lambda: list(c.stub.Wait(pb.WaitRequest(key="k", timeout_ms=-1),
                                               timeout=5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


BIG_TIMEOUTS = [2**63 - 1, 10**15]


@pytest.mark.parametrize("timeout_ms", BIG_TIMEOUTS)
def test_a_wait_lasts_no_longer_than_the_coordinators_own_timeout(start_coordinator,
                                                                   timeout_ms):
    """A request's timeout_ms past the replica's share-binary timeout is
    bounded by it: the wait ends there, as one that asked for nothing."""
    coordinator = start_coordinator(share_binary_between_hosts_timeout_ms=700)
    a, b = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    a.keep_lease("k", a.acquire("k").lease)
    events = list(b.stub.Wait(pb.WaitRequest(key="k", timeout_ms=timeout_ms,
                                             requester=pb.Requester(process_id=1)), timeout=60))
    assert events[-1].decision == pb.COMPILE_LOCALLY, events
    assert "0.7s" in events[-1].reason, events[-1].reason


@pytest.mark.parametrize("timeout_ms", [-1, -(2**63)])
def test_a_worker_refuses_a_negative_timeout_as_the_coordinator_does(coordinator, start_worker,
                                                                     timeout_ms):
    worker = start_worker(coordinator.cfg.listen)
    for target in (coordinator.cfg.listen, worker.cfg.listen):
        code, _ = code_of(lambda t=target: list(client(t).stub.Wait(
            pb.WaitRequest(key="k", timeout_ms=timeout_ms), timeout=30)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, target


@pytest.mark.parametrize("timeout_ms", BIG_TIMEOUTS)
@pytest.mark.parametrize("own_ms", [0, 700])
def test_a_worker_bounds_a_huge_timeout(start_coordinator, start_worker, timeout_ms, own_ms):
    """No value reaches a traceback: the worker's own share-binary timeout
    bounds the wait, or (none set) the coordinator's does, and what is left
    of it fits the wire's int64 on the way up."""
    coordinator = start_coordinator(share_binary_between_hosts_timeout_ms=700)
    worker = start_worker(coordinator.cfg.listen, share_binary_between_hosts_timeout_ms=own_ms)
    a = client(coordinator.cfg.listen)
    a.keep_lease("k", a.acquire("k").lease)
    events = list(client(worker.cfg.listen).stub.Wait(
        pb.WaitRequest(key="k", timeout_ms=timeout_ms, requester=pb.Requester(process_id=1)),
        timeout=60))
    assert events[-1].decision == pb.COMPILE_LOCALLY and "0.7s" in events[-1].reason, events


def test_publish_without_the_lease_is_refused_and_stores_nothing(coordinator):
    holder, other = client(coordinator.cfg.listen), client(coordinator.cfg.listen)
    lease = holder.acquire("k").lease
    forged = pb.Lease(id=lease.id + 1, ttl_seconds=10, revision=lease.revision)
    code, details = code_of(lambda: other.publish("k", forged, DATA, 1.0))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "lease" in details
    stale = pb.Lease(id=lease.id, ttl_seconds=10, revision=lease.revision - 1)
    assert code_of(lambda: other.publish("k", stale, DATA, 1.0))[0] == \
        grpc.StatusCode.FAILED_PRECONDITION
    never = pb.Lease(id=12345, ttl_seconds=10, revision=1)
    assert code_of(lambda: other.publish("other-key", never, DATA, 1.0))[0] == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert coordinator.store.count() == 0
    assert code_of(lambda: other.fetch("k"))[0] == grpc.StatusCode.NOT_FOUND


def test_publish_with_wrong_digest_is_refused_and_stores_nothing(coordinator):
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    header = pb.PublishHeader(key="k", lease=lease, digest="0" * 64, size=len(DATA))
    code, details = code_of(lambda: c.stub.Publish(publish_messages(header, DATA), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "digest" in details
    assert coordinator.store.count() == 0
    assert list(coordinator.store.tmp_dir.iterdir()) == []
    # The holder keeps its lease and can publish the right bytes.
    c.publish("k", lease, DATA, 1.0)
    assert c.fetch("k")[1] == DATA


def test_fetch_of_unknown_key_is_not_found(coordinator):
    assert code_of(lambda: client(coordinator.cfg.listen).fetch("nope"))[0] == \
        grpc.StatusCode.NOT_FOUND


def test_the_client_raises_compilecasts_errors_never_grpcs(coordinator, tmp_path):
    """CacheClient is the one edge: a refusal, a server that is not there
    and a bad request each come as compilecast's error for their status."""
    c = client(coordinator.cfg.listen)
    with pytest.raises(NotFound) as missing:
        c.fetch("nope")
    with pytest.raises(InvalidRequest) as bad:
        c.acquire("a/b")
    gone = CacheClient(f"unix://{tmp_path}/nobody.sock", timeout_s=1.0)
    with pytest.raises(Unavailable) as down:
        gone.status()
    gone.close()
    for exc in (missing.value, bad.value, down.value):
        assert not isinstance(exc, grpc.RpcError), type(exc).__mro__


# -- bad input and a lost blob ----------------------------------------------------

def test_fetch_naming_another_digest_is_not_found(coordinator):
    c = client(coordinator.cfg.listen)
    info = publish(c, "k", DATA)
    code, details = code_of(lambda: c.fetch("k", digest="0" * 64))
    assert code == grpc.StatusCode.NOT_FOUND and f"holds digest {info.digest}" in details
    assert c.fetch("k", digest=info.digest)[1] == DATA


def test_a_blob_lost_from_the_store_is_compiled_again(coordinator):
    c = client(coordinator.cfg.listen)
    info = publish(c, "k", DATA)
    coordinator.store.path_of(info.digest).unlink()  # a disk lost, an operator's rm
    code, details = code_of(lambda: c.fetch("k"))
    assert code == grpc.StatusCode.NOT_FOUND and "missing; recompile" in details
    again = c.acquire("k")  # the index entry went with it: a miss, not a HIT with no bytes
    assert again.decision == pb.COMPILE, again
    c.publish("k", again.lease, DATA, 3.0)
    assert c.fetch("k")[1] == DATA


def test_a_release_without_a_reason_is_invalid_and_keeps_the_lease(coordinator):
    c = client(coordinator.cfg.listen)
    lease = c.acquire("k").lease
    code, details = code_of(lambda: c.release("k", lease, pb.RELEASE_REASON_UNSPECIFIED))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "reason must be" in details
    assert c.publish("k", lease, DATA, 3.0).digest == hashlib.sha256(DATA).hexdigest()


def test_malformed_acquires_are_invalid_argument_and_claim_nothing(coordinator):
    """Every field an Acquire names is checked whole: a trailing newline is
    not the end of a name (a `$` in a pattern would let it through)."""
    c = client(coordinator.cfg.listen)
    longest = {f"c{i}": "v" * 128 for i in range(32)}
    cases = {
        "key with a newline": (pb.AcquireRequest(key="k\n"), "key 'k\\n' is invalid"),
        "job with a newline": (pb.AcquireRequest(key="k", requester=pb.Requester(job="j\n")),
                               "requester.job"),
        "name with a newline": (pb.AcquireRequest(key="k", key_components={"a\nb": "v"}),
                                "key component name 'a\\nb' is invalid"),
        "name ending in one": (pb.AcquireRequest(key="k", key_components={"ok": "v", "a\n": "v"}),
                               "key component name 'a\\n' is invalid"),
        "upper case name": (pb.AcquireRequest(key="k", key_components={"Flags": "v"}),
                            "key component name 'Flags' is invalid"),
        "long value": (pb.AcquireRequest(key="k", key_components={**longest, "c3": "v" * 129}),
                       "key component c3 is longer than 128"),
        "too many": (pb.AcquireRequest(key="k", key_components={**longest, "c32": "v"}),
                     "at most 32 key_components, got 33"),
    }
    for name, (req, says) in cases.items():
        code, details = code_of(lambda r=req: c.stub.Acquire(r, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, (name, details)
    # At the limits it is decided, and the key was not claimed by any refused one.
    resp = c.stub.Acquire(pb.AcquireRequest(key="k", key_components=longest), timeout=10)
    assert resp.decision == pb.COMPILE


def test_component_names_checked_before_still_have_their_values_checked():
    """The names and program name of a request that passed are remembered;
    the next request with the same ones still has its values checked, and a
    bad program name with names seen before is still refused."""
    from compilecast import validate

    names = {f"component_{i}": "v" for i in range(11)}
    req = pb.AcquireRequest(key="k", key_components=names, program_name="jit_step")
    validate.acquire_request(req)
    assert ("\n".join(req.key_components), "jit_step") in validate._NAMED_OK
    long_value = pb.AcquireRequest(key="k", key_components={**names, "component_3": "v" * 129},
                                   program_name="jit_step")
    with pytest.raises(InvalidRequest, match="component_3 is longer than 128"):
        validate.acquire_request(long_value)
    bad_name = pb.AcquireRequest(key="k", key_components=names, program_name="jit step")
    with pytest.raises(InvalidRequest, match="program_name"):
        validate.acquire_request(bad_name)
    assert ("\n".join(req.key_components), "jit step") not in validate._NAMED_OK


def test_only_a_process_that_may_compile_sends_its_key_components():
    """The coordinator records a key's components when it answers COMPILE,
    and Acquire answers a job's other processes WAIT, HIT or COMPILE_LOCALLY:
    theirs are not sent. Processes outside a job may compile: theirs are.
    (A server of the test's own, keeping what it was sent.)"""
    from concurrent import futures

    got: list[pb.AcquireRequest] = []

    class Keeping(rpc.CompileCacheServicer):
        def Acquire(self, request, context):
            got.append(request)
            return pb.AcquireResponse(decision=pb.WAIT)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    rpc.add_CompileCacheServicer_to_server(Keeping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    comps = {"program": "p1", "platform": "cpu"}
    try:
        for process_id, ident in ((0, Identity(job="j", process_id=0, designated_process=0)),
                                  (1, Identity(job="j", process_id=1, designated_process=0)),
                                  (2, Identity())):
            c = CacheClient(f"127.0.0.1:{port}", identity=ident)
            c.acquire(f"k{process_id}", components=comps, program_name="step")
            c.close()
    finally:
        server.stop(0)
    assert [dict(r.key_components) for r in got] == [comps, {}, comps]
    assert [r.program_name for r in got] == ["step"] * 3
