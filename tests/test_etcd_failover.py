"""The etcd client moves off a dead member once, however many calls fail on it
together (a real etcd member and two endpoints where nothing listens)."""

from __future__ import annotations

import asyncio

from compilecast.coordinator.etcd import Etcd
from compilecast.launch import free_port


def test_concurrent_failures_on_one_member_move_once_never_back_onto_it(etcd, loop_thread):
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]

    async def burst() -> tuple[list, str]:
        # The only live member sits between two dead ones.
        client = Etcd([dead[0], etcd.endpoint, dead[1]], timeout=2.0)
        try:
            await client.put(b"/failover-test", b"v")  # fails over once, onto the live member
            client._use(0)  # back onto a dead one, as when a member dies under load
            results = await asyncio.gather(*(client.get(b"/failover-test") for _ in range(12)),
                                           return_exceptions=True)
            return results, client.endpoints[client._current]
        finally:
            await client.close()

    results, current = loop_thread.run(burst())
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert all(r.value == b"v" for r in results)
    assert current == etcd.endpoint
