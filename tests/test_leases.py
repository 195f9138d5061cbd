"""The pool of pre-granted claim leases, against a real etcd."""

from __future__ import annotations

import asyncio
import time

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
        pool = LeasePool(client, 3, size=2)  # fresh for 1.5 s
        old = await pool.take()
        await asyncio.sleep(1.7)
        pool.give_back(old)
        assert old not in pool._free  # too old to promise half of the TTL
        got = await pool.take()
        assert got[0] != old[0] and await _ttl(client, got[0]) >= 2
        await pool.close()
        await client.close()

    loop_thread.run(scenario())


def test_an_owner_reuses_its_fresh_lease_and_renewals_keep_it_fresh(etcd, loop_thread):
    async def scenario():
        client = Etcd([etcd.endpoint])
        pool = LeasePool(client, 3, size=2)  # fresh for 1.5 s
        a, b = ("t", "job", 0, "host:1"), ("t", "job", 1, "host:2")
        first = await pool.take(a)
        granted = pool.granted
        assert (await pool.take(a))[0] == first[0]  # the same process: its lease again
        assert pool.granted == granted
        other = await pool.take(b)
        anonymous = [await pool.take() for _ in range(2)]
        ids = {first[0], other[0], *(lease_id for lease_id, _ in anonymous)}
        assert len(ids) == 4  # other owners and anonymous claims never share it
        pool.give_back(first)  # an owner's lease stays the owner's, never pooled
        assert first not in pool._free and (await pool.take(a))[0] == first[0]
        await asyncio.sleep(1.7)
        renewals, granted = pool.renewals, pool.granted
        # half of the TTL no longer left but alive: renewed (once for all five), not replaced.
        again = await asyncio.gather(*(pool.take(a) for _ in range(5)))
        assert {lease_id for lease_id, _ in again} == {first[0]}
        assert await _ttl(client, first[0]) >= 2
        assert (pool.renewals, pool.granted) == (renewals + 1, granted)
        await client.revoke(first[0])
        await asyncio.sleep(1.7)
        stale = await pool.take(a)  # stale, and gone in etcd: a new one
        assert stale[0] != first[0] and await _ttl(client, stale[0]) >= 2
        await asyncio.sleep(1.7)
        pool.renewed(stale[0], await client.keepalive_once(stale[0]))
        assert (await pool.take(a))[0] == stale[0]  # renewed: fresh again
        pool.renewed(stale[0], 0)  # gone in etcd: forgotten
        assert (await pool.take(a))[0] != stale[0]
        await pool.close()
        await client.close()

    loop_thread.run(scenario())


def test_an_owner_lease_past_half_its_freshness_is_renewed_ahead(etcd, loop_thread):
    """A take hands the lease out at once and renews it in the background:
    the owner's next take, after the first lease would have gone stale, needs
    no renewal round trip."""
    async def scenario():
        client = Etcd([etcd.endpoint])
        pool = LeasePool(client, 3, size=2)  # fresh for 1.5 s, renewed ahead from 0.75 s
        a = ("t", "job", 0, "host:1")
        first = await pool.take(a)
        assert (await pool.take(a)) == first and pool.renewals == 0  # young: nothing to do
        await asyncio.sleep(0.9)
        got = await pool.take(a)
        assert got == first  # handed out as it was, without waiting ...
        assert first[0] in pool._renewing and pool.renewals == 1  # ... for the renewal
        for _ in range(100):
            if first[0] not in pool._renewing:
                break
            await asyncio.sleep(0.01)
        assert pool._owned[a][1] >= first[1] + 0.75  # fresh again
        await asyncio.sleep(0.9)  # past the first grant's freshness
        started = pool.renewals
        again = await pool.take(a)
        assert again[0] == first[0] and again[1] > first[1]  # fresh, no renewal awaited
        assert first[0] in pool._renewing and pool.renewals == started + 1
        assert await _ttl(client, first[0]) >= 2
        await pool.close()  # cancels the renewal in flight
        assert not pool._renewing
        await client.close()

    loop_thread.run(scenario())


def _client(target: str, name: str):
    from compilecast.worker.inprocess.client import CacheClient, Identity
    return CacheClient(target, identity=Identity(job="j", process_id=0, client=name))


def test_one_process_claims_on_one_lease_and_they_live_and_end_together(start_coordinator):
    from compilecast.v1 import cache_pb2 as pb

    coordinator = start_coordinator(lease_ttl_s=3)
    target = coordinator.cfg.listen
    a, b = _client(target, "host:1"), _client(target, "host:2")
    leases = [a.acquire(k).lease for k in ("k1", "k2", "k3")]
    assert len({lease.id for lease in leases}) == 1  # one grant for the process's burst
    assert b.acquire("k4").lease.id != leases[0].id  # another process: its own lease
    # One claim ending (published) ends neither the lease nor the others...
    a.publish("k1", leases[0], b"one", 1.0)
    assert a.keepalive("k2", leases[1]) > 0
    a.release("k2", leases[1], pb.ABANDONED, "gone")
    for _ in range(3):  # ...and renewing one claim keeps the rest alive past the TTL
        time.sleep(1.5)
        assert a.keepalive("k3", leases[2]) > 0
    a.publish("k3", leases[2], b"three", 1.0)
    # A process that stops renewing loses all its claims together.
    dead = [a.acquire(k).lease for k in ("k5", "k6")]
    assert dead[0].id == dead[1].id
    time.sleep(4.5)
    for key in ("k5", "k6"):
        assert b.acquire(key).decision == pb.COMPILE
    assert a.keepalive("k5", dead[0]) == 0


def test_a_process_keeps_each_claim_alive_until_that_claim_ends(start_coordinator):
    """Two claims of one process share a lease; publishing one and stopping its
    keeper leaves the other's keeper renewing, past the TTL, so it can publish."""
    from compilecast.v1 import cache_pb2 as pb

    coordinator = start_coordinator(lease_ttl_s=2)
    target = coordinator.cfg.listen
    a, waiter = _client(target, "host:1"), _client(target, "host:2")
    first, second = a.acquire("first").lease, a.acquire("second").lease
    assert first.id == second.id
    a.keep_lease("first", first)
    a.keep_lease("second", second)
    a.publish("first", first, b"one", 1.0)
    a.stop_lease("first", first)
    time.sleep(5.0)  # 2.5 TTLs: only the second claim's keeper keeps the lease alive
    assert waiter.acquire("second").decision == pb.WAIT
    a.publish("second", second, b"two", 1.0)
    a.stop_lease("second", second)
    assert waiter.acquire("second").decision == pb.HIT
    a.close()


def test_a_holder_is_told_the_ttl_its_lease_has_left(start_coordinator):
    """An owner's lease is handed out again while it has at least half of
    its TTL left; the Lease says how much, and the holder renews at a third
    of that, so its first renewal always has two thirds of it to land."""
    coordinator = start_coordinator(lease_ttl_s=6)
    a = _client(coordinator.cfg.listen, "host:1")
    first = a.acquire("k1").lease
    assert 5 <= first.ttl_seconds <= 6
    time.sleep(1.2)
    second = a.acquire("k2").lease
    assert second.id == first.id  # the process's lease, still fresh enough
    assert 3 <= second.ttl_seconds <= first.ttl_seconds - 1
    assert a.keepalive("k2", second) > second.ttl_seconds - 1  # renewed: the whole TTL again
    a.close()
