"""Fuzzing the coordinator and the worker: arbitrary protobuf messages and raw
random bytes on every RPC. Never INTERNAL or UNKNOWN, never a crash, healthy
afterwards."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilecast.v1 import cache_pb2 as pb

from .conftest import CALL_ERRORS, status_code

pytestmark = pytest.mark.slow

BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SERVICE = "/compilecast.v1.CompileCache/"
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

texts = st.text(max_size=300)
keys = st.one_of(st.text(alphabet="abcXYZ019._-", min_size=0, max_size=210), texts)
ints = st.integers(-(2**31), 2**31 - 1)
longs = st.integers(-(2**63), 2**63 - 1)
requesters = st.builds(pb.Requester, job=st.one_of(st.just(""), texts), process_id=ints,
                       designated_process=ints, client=texts)
leases = st.builds(pb.Lease, id=longs, ttl_seconds=ints, revision=longs)
digests = st.one_of(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), texts)
components = st.dictionaries(texts, texts, max_size=40)

UNARY = {
    "Acquire": st.builds(pb.AcquireRequest, key=keys, requester=requesters,
                         key_components=components, program_name=texts),
    "Release": st.builds(pb.ReleaseRequest, key=keys, lease=leases,
                         reason=st.integers(-5, 10), detail=st.text(max_size=3000)),
    "KeepAlive": st.builds(pb.KeepAliveRequest, key=keys, lease=leases),
    "DescribeKey": st.builds(pb.DescribeKeyRequest, key=keys),
    "Status": st.just(pb.StatusRequest()),
}
targets = st.builds(pb.Target, platform=st.sampled_from(["tpu", "cpu", "", "x"]), topology=texts)
recipes = st.builds(pb.Recipe, key=st.one_of(st.just(""), keys), job=texts, program_name=texts,
                    entry=st.one_of(st.just("m:f"), texts), entry_index=ints,
                    program=st.binary(max_size=200), device_ids=st.lists(longs, max_size=4),
                    target=targets)
task_ids = st.one_of(st.from_regex(r"\A[0-9]{20}-[0-9a-f]{8}\Z"), texts)
UNARY.update({
    "SubmitCompiles": st.builds(pb.SubmitCompilesRequest, recipes=st.lists(recipes, max_size=3),
                                replay_job=st.one_of(st.just(""), texts),
                                target=st.one_of(st.none(), targets)),
    "ClaimCompile": st.builds(pb.ClaimCompileRequest, worker=texts,
                              wait_ms=st.integers(-100, 200)),
    "RenewClaim": st.builds(pb.RenewClaimRequest, task_id=task_ids, claim=leases),
    "FinishCompile": st.builds(pb.FinishCompileRequest, task_id=task_ids, claim=leases,
                               ok=st.booleans(), detail=texts, key=keys),
    "Tasks": st.builds(pb.TasksRequest, task_ids=st.lists(task_ids, max_size=3)),
})
STREAMING = {
    "Wait": st.builds(pb.WaitRequest, key=keys, requester=requesters,
                      timeout_ms=st.integers(-1000, 300)),
    "Fetch": st.builds(pb.FetchRequest, key=keys, digest=digests),
    "ListRecipes": st.builds(pb.ListRecipesRequest, job=texts),
}
publish_streams = st.lists(
    st.one_of(
        st.builds(pb.PublishChunk, data=st.binary(max_size=2000)),
        st.builds(pb.PublishChunk, header=st.builds(
            pb.PublishHeader, key=keys, lease=leases, digest=digests,
            size=st.integers(-10, 10**12), compile_time_seconds=st.floats(allow_nan=True),
            requester=requesters)),
    ),
    max_size=5,
)


def call(channel: grpc.Channel, method: str, request: bytes | list[bytes], kind: str,
         timeout: float = 10):
    """Send raw bytes; return the status code."""
    ident = lambda b: b  # noqa: E731
    try:
        if kind == "unary":
            channel.unary_unary(SERVICE + method, request_serializer=ident,
                                response_deserializer=ident)(request, timeout=timeout)
        elif kind == "stream":
            list(channel.unary_stream(SERVICE + method, request_serializer=ident,
                                      response_deserializer=ident)(request, timeout=timeout))
        else:
            channel.stream_unary(SERVICE + method, request_serializer=ident,
                                 response_deserializer=ident)(iter(request), timeout=timeout)
    except CALL_ERRORS as exc:
        return status_code(exc)
    return grpc.StatusCode.OK


@pytest.fixture(params=["coordinator", "worker"])
def target(request, coordinator, start_worker):
    if request.param == "coordinator":
        return coordinator.cfg.listen
    return start_worker(coordinator.cfg.listen).target


@pytest.fixture
def channel(target):
    ch = grpc.insecure_channel(target)
    yield ch
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    ch.close()


@FUZZ
@given(st.data())
def test_random_messages_never_break_the_server(channel, data):
    method = data.draw(st.sampled_from(sorted(UNARY) + sorted(STREAMING) + ["Publish"]))
    if method in UNARY:
        code = call(channel, method, data.draw(UNARY[method]).SerializeToString(), "unary")
    elif method in STREAMING:
        code = call(channel, method, data.draw(STREAMING[method]).SerializeToString(), "stream")
    else:
        msgs = [m.SerializeToString() for m in data.draw(publish_streams)]
        code = call(channel, method, msgs, "client-stream")
    assert code not in BAD, (method, code)


@FUZZ
@given(st.sampled_from(sorted(UNARY) + sorted(STREAMING) + ["Publish"]),
       st.lists(st.binary(max_size=512), min_size=1, max_size=4))
def test_random_bytes_never_break_the_server(channel, method, blobs):
    kind = "unary" if method in UNARY else "stream" if method in STREAMING else "client-stream"
    code = call(channel, method, blobs if kind == "client-stream" else blobs[0], kind)
    assert code not in BAD, (method, code)


# -- stream-shaped inputs under a real lease -----------------------------------
# A holder's Publish stream that is malformed in its shape (the digest
# announced last that never comes, a second header, zstd_data, the digest
# twice, data after the digest) is refused at once, on both servers: never
# left open until the call's deadline.

STREAM_TIMEOUT_S = 20.0
DATA = b"x" * 5000


def _header(key: str, lease: pb.Lease, digest: str = "") -> pb.PublishChunk:
    return pb.PublishChunk(header=pb.PublishHeader(key=key, lease=lease, size=len(DATA),
                                                   digest=digest, compile_time_seconds=1.0))


def _digest() -> str:
    import hashlib

    return hashlib.sha256(DATA).hexdigest()


SHAPES = {
    "the digest announced last never comes": lambda h: [h(""), pb.PublishChunk(data=DATA)],
    "a second header": lambda h: [h(""), pb.PublishChunk(data=DATA), h(""),
                                  pb.PublishChunk(digest=_digest())],
    "zstd_data": lambda h: [h(""), pb.PublishChunk(zstd_data=DATA),
                            pb.PublishChunk(digest=_digest())],
    "the digest in the header and last": lambda h: [h(_digest()), pb.PublishChunk(data=DATA),
                                                   pb.PublishChunk(digest=_digest())],
    "data after the digest": lambda h: [h(""), pb.PublishChunk(digest=_digest()),
                                        pb.PublishChunk(data=DATA)],
}


def _publish_raw(target: str, msgs: list[pb.PublishChunk]) -> grpc.StatusCode:
    ch = grpc.insecure_channel(target)
    try:
        return call(ch, "Publish", [m.SerializeToString() for m in msgs], "client-stream",
                    timeout=STREAM_TIMEOUT_S)
    finally:
        ch.close()


def _lease(target: str, key: str):
    from compilecast.worker.inprocess.client import CacheClient

    client = CacheClient(target)
    resp = client.acquire(key)
    assert resp.decision == pb.COMPILE, resp
    return client, resp.lease


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_malformed_publish_stream_is_refused_at_once(target, shape):
    import uuid

    key = f"malformed-{uuid.uuid4().hex[:12]}"
    client, lease = _lease(target, key)
    code = _publish_raw(target, SHAPES[shape](lambda d: _header(key, lease, d)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (shape, code)
    # Nothing was left half-done: the holder publishes under its lease.
    assert client.publish(key, lease, DATA, 1.0).digest == _digest()
    client.close()


stream_parts = st.lists(st.sampled_from(["data", "zstd", "header", "digest", "bad-digest"]),
                        max_size=6)


@FUZZ
@given(parts=stream_parts)
def test_random_publish_streams_under_a_real_lease_are_answered(target, parts):
    """Any sequence after a valid header: answered OK or refused, never left
    open until the deadline, never INTERNAL."""
    import uuid

    key = f"fuzzed-{uuid.uuid4().hex[:12]}"
    client, lease = _lease(target, key)
    make = {"data": lambda: pb.PublishChunk(data=DATA),
            "zstd": lambda: pb.PublishChunk(zstd_data=DATA),
            "header": lambda: _header(key, lease),
            "digest": lambda: pb.PublishChunk(digest=_digest()),
            "bad-digest": lambda: pb.PublishChunk(digest="0" * 64)}
    code = _publish_raw(target, [_header(key, lease)] + [make[p]() for p in parts])
    assert code not in BAD | {grpc.StatusCode.DEADLINE_EXCEEDED}, (parts, code)
    client.close()


def test_a_publish_stream_that_stops_without_closing_frees_the_server(target):
    """A holder that sends its header and then nothing, never closing the
    stream: its call ends at its own deadline, and the server is left able
    to take the publish again under the same lease."""
    import uuid

    key = f"stalled-{uuid.uuid4().hex[:12]}"
    client, lease = _lease(target, key)
    ch = grpc.insecure_channel(target)
    never = threading.Event()

    def stalled():
        yield _header(key, lease).SerializeToString()
        never.wait(30)

    ident = lambda b: b  # noqa: E731
    with pytest.raises(CALL_ERRORS) as err:
        ch.stream_unary(SERVICE + "Publish", request_serializer=ident,
                        response_deserializer=ident)(stalled(), timeout=2)
    never.set()
    assert status_code(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    ch.close()
    assert client.publish(key, lease, DATA, 1.0).digest == _digest()
    client.close()


# -- the Decide stream: any sequence of messages, then the end ------------------

decide_messages = st.one_of(
    st.builds(pb.DecideRequest, id=st.integers(0, 5),
              requests=st.lists(st.builds(pb.AcquireRequest, key=keys, requester=requesters),
                                max_size=3),
              answer_in_parts=st.booleans(), takes_bundles=st.booleans()),
    st.builds(pb.DecideRequest, id=st.integers(0, 5),
              wait=st.builds(pb.WaitRequest, key=keys, requester=requesters,
                             timeout_ms=st.integers(-5, 300)),
              until_publishing=st.booleans()),
    st.builds(pb.DecideRequest, id=st.integers(0, 5), cancel=st.lists(st.integers(0, 5),
                                                                      max_size=3)),
)


@FUZZ
@given(msgs=st.lists(st.one_of(decide_messages.map(lambda m: m.SerializeToString()),
                               st.binary(max_size=64)), max_size=6))
def test_any_decide_stream_is_answered_and_ended(channel, msgs):
    """Repeated ids, waits, cancels of unknown ids, undecodable messages, in
    any order, then the client's end: the server answers and ends the
    stream (an error status at worst), never INTERNAL, never left open."""
    ident = lambda b: b  # noqa: E731
    call = channel.stream_stream(SERVICE + "Decide", request_serializer=ident,
                                 response_deserializer=ident)(iter(msgs), timeout=STREAM_TIMEOUT_S)
    try:
        for _ in call:
            pass
        code = grpc.StatusCode.OK
    except CALL_ERRORS as exc:
        code = status_code(exc)
    assert code not in BAD | {grpc.StatusCode.DEADLINE_EXCEEDED}, (msgs, code)
