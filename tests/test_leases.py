"""The pool of pre-granted claim leases, against a real etcd."""

from __future__ import annotations

import asyncio

from etcd3.etcdrpc import rpc_pb2 as epb

from compilecast.coordinator.etcd import Etcd
from compilecast.coordinator.leases import LeasePool


async def _ttl(etcd: Etcd, lease_id: int) -> int:
    resp = await etcd.lease.LeaseTimeToLive(epb.LeaseTimeToLiveRequest(ID=lease_id), timeout=5)
    return int(resp.TTL)  # -1: no such lease


async def _settle(pool: LeasePool) -> None:
    for _ in range(200):
        if pool._refill is None:
            return
        await asyncio.sleep(0.01)


def test_pool_hands_out_fresh_leases_reuses_unused_ones_and_revokes_on_close(etcd, loop_thread):
    async def scenario():
        client = Etcd([etcd.endpoint])
        pool = LeasePool(client, 20, size=4)
        first = await pool.take()  # an empty pool grants at once
        assert await _ttl(client, first[0]) >= 16
        await _settle(pool)
        assert len(pool._free) == 1  # one taken lately: one kept ready, not `size`
        for _ in range(8):  # with demand the pool grows, up to its size
            await pool.take()
            await _settle(pool)
        assert 2 <= len(pool._free) <= 4
        granted = pool.granted
        second = await pool.take()  # from the pool: no grant while the caller waits
        assert pool.granted == granted and second[0] != first[0]
        assert await _ttl(client, second[0]) >= 16
        pool.give_back(second)
        assert (await pool.take())[0] == second[0]  # an unused lease is used again
        await _settle(pool)
        pooled = [lease_id for lease_id, _ in pool._free]
        await pool.close()
        assert pooled
        for lease_id in pooled:
            assert await _ttl(client, lease_id) == -1
        await client.close()

    loop_thread.run(scenario())


def test_stale_leases_are_not_handed_out(etcd, loop_thread):
    async def scenario():
        client = Etcd([etcd.endpoint])
        pool = LeasePool(client, 5, size=2)  # fresh for 1 s
        old = await pool.take()
        await asyncio.sleep(1.2)
        pool.give_back(old)
        assert old not in pool._free  # too old to promise 4/5 of the TTL
        got = await pool.take()
        assert got[0] != old[0] and await _ttl(client, got[0]) >= 4
        await pool.close()
        await client.close()

    loop_thread.run(scenario())
