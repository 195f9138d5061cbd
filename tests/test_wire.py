"""The hand-made codec for artifact chunks: the same bytes protobuf writes,
read back as views; real gRPC on loopback with the generated stubs too."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compilecast import wire
from compilecast.v1 import cache_pb2 as pb
from compilecast.v1 import cache_pb2_grpc as rpc
from compilecast.wire import DataChunk
from compilecast.worker.inprocess.client import CacheClient


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=70_000) | st.sampled_from([b"", b"x" * 127, b"y" * 128,
                                                     b"z" * 16_384, b"w" * 2_097_152]))
def test_data_chunks_encode_as_protobuf_does_and_parse_as_views(data):
    for cls in (pb.FetchChunk, pb.PublishChunk):
        encoded = wire.serialize(DataChunk(data))
        # protobuf leaves an empty field out; one written empty reads the same
        assert encoded == (cls(data=data).SerializeToString() if data else b"\x12\x00")
        assert cls.FromString(encoded).data == data
        parsed = wire.parser(cls)(encoded)
        assert bytes(parsed.data) == data and wire.serialize(parsed) == encoded
        framed = DataChunk.framed(data)
        assert wire.serialize(framed) == encoded and bytes(framed.data) == data


def test_other_messages_go_through_protobuf():
    info = pb.ArtifactInfo(key="k", digest="ab" * 32, size=3)
    for msg in (pb.FetchChunk(artifact=info), pb.FetchChunk(artifact=info, data=b"abc"),
                pb.FetchChunk(relay_from="127.0.0.1:1"),
                pb.PublishChunk(header=pb.PublishHeader(key="k"), data=b"abc")):
        raw = wire.serialize(msg)
        assert raw == msg.SerializeToString()
        back = wire.parser(type(msg))(raw)
        assert isinstance(back, type(msg)) and back == msg
    # A data field followed by anything else is not data-only.
    raw = pb.FetchChunk(data=b"abc").SerializeToString() + \
        pb.FetchChunk(relay_from="x").SerializeToString()
    assert wire.parser(pb.FetchChunk)(raw).relay_from == "x"


@pytest.mark.parametrize("raw", [b"\x12", b"\x12\x05ab", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff"
                                 b"\xff\xff\x01", b"\x12\x80"])
def test_truncated_or_malformed_chunks_are_errors(raw):
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        wire.parser(pb.FetchChunk)(raw)


def test_generated_protobuf_stubs_interoperate(coordinator):
    """A client that knows only the .proto (here: the generated stubs,
    plain protobuf) publishes to and fetches from the coordinator."""
    data = os.urandom(5 << 20)
    digest = hashlib.sha256(data).hexdigest()
    channel = grpc.insecure_channel(coordinator.cfg.listen,
                                    options=[("grpc.max_receive_message_length", 8 << 20)])
    stub = rpc.CompileCacheStub(channel)
    lease = stub.Acquire(pb.AcquireRequest(key="interop"), timeout=10).lease

    def messages():
        yield pb.PublishChunk(header=pb.PublishHeader(key="interop", lease=lease, digest=digest,
                                                      size=len(data)))
        for off in range(0, len(data), 1 << 20):
            yield pb.PublishChunk(data=data[off:off + (1 << 20)])

    assert stub.Publish(messages(), timeout=30).artifact.digest == digest
    chunks = list(stub.Fetch(pb.FetchRequest(key="interop"), timeout=30))
    assert chunks[0].artifact.digest == digest
    assert b"".join(c.data for c in chunks) == data
    # ...and compilecast's own client reads what a plain client published.
    c = CacheClient(coordinator.cfg.listen)
    assert c.fetch("interop")[1] == data
    c.close()
    channel.close()


def test_a_file_opened_for_a_cancelled_caller_is_closed_not_leaked(tmp_path):
    import asyncio
    import threading

    from compilecast.streams import opened

    path = tmp_path / "blob"
    path.write_bytes(b"x")
    go, files = threading.Event(), []

    def slow_open():
        go.wait()
        files.append(open(path, "rb"))
        return files[-1]

    async def main():
        caller = asyncio.ensure_future(opened(slow_open))
        await asyncio.sleep(0)  # (the thread started: the caller awaits it)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        go.set()
        for _ in range(3000):  # the thread's file, closed when it comes
            if files and files[0].closed:
                break
            await asyncio.sleep(0.01)
        assert files and files[0].closed, "the file opened for the cancelled caller is open"
        with await opened(open, path, "rb") as f:  # an uncancelled caller gets its file
            assert f.read() == b"x"

    asyncio.run(main())
