"""The servers' shared lifecycle (compilecast.serving) on real gRPC."""

from __future__ import annotations

import asyncio

import pytest

from compilecast.serving import ListenError, listen, make_server
from compilecast.v1 import cache_pb2_grpc as rpc


def test_a_port_one_of_our_servers_serves_is_taken_for_the_next():
    """gRPC's default SO_REUSEPORT would let a second server bind the same
    port and take half of its connections; ours refuse, with a ListenError
    naming the address and the setting."""

    async def run():
        first, _ = make_server(rpc.CompileCacheServicer())
        port = listen(first, "127.0.0.1:0", setting="listen")
        await first.start()
        try:
            second, _ = make_server(rpc.CompileCacheServicer())
            with pytest.raises(ListenError) as err:
                listen(second, f"127.0.0.1:{port}", setting="relay_listen")
            assert f"127.0.0.1:{port} (relay_listen)" in str(err.value)
            # The first still serves the port alone.
            third, _ = make_server(rpc.CompileCacheServicer())
            with pytest.raises(ListenError):
                listen(third, f"127.0.0.1:{port}", setting="listen")
        finally:
            await first.stop(None)

    asyncio.run(run())
