"""Writes sent together (WriteBatcher) and reads shared by waiters, against a
real etcd on loopback."""

from __future__ import annotations

import asyncio

from compilecast.coordinator.etcd import Etcd, GuardedBatcher, WriteBatcher, cmp_absent, op_put
from compilecast.coordinator.records import scope
from compilecast.errors import Unavailable
from compilecast.launch import free_port
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually, slow_counted_reads


def test_concurrent_writes_share_txns(etcd, loop_thread, prefix):
    async def body():
        client = Etcd([etcd.endpoint])
        batcher = WriteBatcher(client, max_ops=64)
        try:
            keys = [f"{prefix}/w/{i:03d}".encode() for i in range(200)]
            await asyncio.gather(*(batcher.put(k, b"v%d" % i) for i, k in enumerate(keys)))
            stored = await client.get_prefix(f"{prefix}/w/".encode())
            await asyncio.gather(*(batcher.delete(k) for k in keys[:150]))
            left = await client.get_prefix(f"{prefix}/w/".encode())
            return stored, left, batcher.txns
        finally:
            await client.close()

    stored, left, txns = loop_thread.run(body())
    assert [kv.value for kv in stored] == [b"v%d" % i for i in range(200)]
    assert [kv.key for kv in left] == [f"{prefix}/w/{i:03d}".encode() for i in range(150, 200)]
    # 350 writes: at least ceil(200 / 64) + ceil(150 / 64) = 7 txns, far fewer than one each.
    assert 7 <= txns <= 20, txns


def test_a_delete_cancels_a_put_not_sent_yet(etcd, loop_thread, prefix):
    async def body():
        client = Etcd([etcd.endpoint])
        batcher = WriteBatcher(client)
        try:
            key = f"{prefix}/gone".encode()
            # The second put queues behind the first txn; its delete arrives
            # before it is sent. etcd would refuse both in one txn.
            first = asyncio.ensure_future(batcher.put(f"{prefix}/first".encode(), b"1"))
            await asyncio.sleep(0)
            put = asyncio.ensure_future(batcher.put(key, b"x"))
            await asyncio.sleep(0)
            await asyncio.gather(batcher.delete(key), put, first)
            return await client.get(key), await client.get(f"{prefix}/first".encode())
        finally:
            await client.close()

    gone, first = loop_thread.run(body())
    assert gone is None and first.value == b"1"


def test_a_failed_txn_fails_its_writes(loop_thread):
    async def body():
        client = Etcd([f"127.0.0.1:{free_port()}"], timeout=1.0)  # nothing listens
        try:
            return await asyncio.gather(*(WriteBatcher(client).put(b"/k%d" % i, b"v")
                                          for i in range(3)), return_exceptions=True)
        finally:
            await client.close()

    results = loop_thread.run(body())
    assert all(isinstance(r, Unavailable) for r in results), results


def test_waiters_share_a_read_unless_the_watch_moved(coordinator, loop_thread):
    state = coordinator.state
    sk = scope("default", "shared-wait")

    async def body():
        with slow_counted_reads(state) as reads:
            first = asyncio.ensure_future(state.view.read_shared(sk, fresh=True))
            await asyncio.sleep(0)
            joined = [asyncio.ensure_future(state.view.read_shared(sk, fresh=True))
                      for _ in range(20)]
            await asyncio.sleep(0)
            shared = len(reads)
            state.hub.events += 1  # an event after the read started: later waiters read again
            late = await state.view.read_shared(sk, fresh=True)
            await asyncio.gather(first, *joined)
            return shared, len(reads), late

    shared, total, late = loop_thread.run(body())
    assert shared == 1 and total == 2
    assert late.artifact is None and late.lease is None


def test_acquire_reads_join_any_read_in_flight(coordinator, loop_thread):
    state = coordinator.state
    sk = scope("default", "shared-acquire")

    async def body():
        with slow_counted_reads(state) as reads:
            first = asyncio.ensure_future(state.view.read_shared(sk))
            await asyncio.sleep(0)
            state.hub.events += 1
            await state.view.read_shared(sk)
            await first
            return len(reads)

    assert loop_thread.run(body()) == 1


def test_waiter_records_do_not_move_the_watch_count(coordinator, loop_thread):
    """Waiters share a read while no event that could wake them arrived: the
    waiter records a pod's job start writes by the thousand are not such
    events; a claim is."""
    state = coordinator.state
    sk = scope("default", "counted")
    before = state.hub.events
    loop_thread.run(state.etcd.txn([], [op_put(state.view.k("w", sk) + b"/0000000001/x", b"{}")]))
    client = CacheClient(coordinator.cfg.listen)
    try:
        assert client.acquire("counted").decision == pb.COMPILE  # writes the claim record
    finally:
        client.close()
    eventually(lambda: state.view.claimed.get(sk), "the watch delivered the claim")
    assert state.hub.events == before + 1


async def _claims(endpoint: str, prefix: str, names: list[str], *, taken: tuple[str, ...] = (),
                  batcher_kw: dict | None = None):
    """Claim P/l/NAME for each name (absent-guarded, reading it back on
    failure), all at once through one GuardedBatcher; `taken` exist first."""
    client = Etcd([endpoint])
    batcher = GuardedBatcher(client, **(batcher_kw or {}))
    try:
        for name in taken:
            await client.put(f"{prefix}/l/{name}".encode(), b"earlier")

        async def claim(i: int, name: str):
            key = f"{prefix}/l/{name}".encode()
            return await batcher.txn([cmp_absent(key)], [op_put(key, b"claim-%d" % i)], [key])

        results = await asyncio.gather(*(claim(i, n) for i, n in enumerate(names)),
                                       return_exceptions=True)
        stored = {kv.key.decode().rsplit("/", 1)[1]: kv.value
                  for kv in await client.get_prefix(f"{prefix}/l/".encode())}
        return results, stored, batcher.txns
    finally:
        await client.close()


def test_guarded_claims_of_distinct_keys_share_txns(etcd, loop_thread, prefix):
    names = [f"k{i:03d}" for i in range(200)]
    results, stored, txns = loop_thread.run(_claims(etcd.endpoint, prefix, names))
    assert all(r[0] and r[2] == [] for r in results)
    assert stored == {n: b"claim-%d" % i for i, n in enumerate(names)}
    assert txns <= 40, txns  # 200 claims, at most 32 a txn


def test_a_failed_compare_fails_only_its_claim(etcd, loop_thread, prefix):
    """k0 goes alone; k1-k9 wait for it and go together, which fails on k3;
    the other eight go again, together, and succeed."""
    names = [f"k{i}" for i in range(10)]
    results, stored, txns = loop_thread.run(_claims(etcd.endpoint, prefix, names, taken=("k3",),
                                                    batcher_kw={"in_flight": 1}))
    assert txns == 3
    lost = results[3]
    assert lost[0] is False and lost[2][0].value == b"earlier"  # what a txn alone would read
    assert all(r[0] for i, r in enumerate(results) if i != 3)
    assert stored == {**{n: b"claim-%d" % i for i, n in enumerate(names)}, "k3": b"earlier"}


def test_claims_of_one_key_never_share_a_txn_and_one_wins(etcd, loop_thread, prefix):
    results, stored, _ = loop_thread.run(
        _claims(etcd.endpoint, prefix, ["same"] * 12 + ["other"], batcher_kw={"in_flight": 1}))
    winners = [i for i, r in enumerate(results[:12]) if r[0]]
    assert len(winners) == 1 and stored["same"] == b"claim-%d" % winners[0]
    assert all(r[2][0].value == stored["same"] for r in results[:12] if not r[0])
    assert results[12][0] and stored["other"] == b"claim-12"


def test_a_failed_guarded_txn_fails_its_claims(loop_thread):
    async def body():
        client = Etcd([f"127.0.0.1:{free_port()}"], timeout=1.0)  # nothing listens
        batcher = GuardedBatcher(client)
        try:
            return await asyncio.gather(*(batcher.txn([cmp_absent(b"/k%d" % i)],
                                                      [op_put(b"/k%d" % i, b"v")], [b"/k%d" % i])
                                          for i in range(5)), return_exceptions=True)
        finally:
            await client.close()

    results = loop_thread.run(body())
    assert all(isinstance(r, Unavailable) for r in results), results


class _ScriptedEtcd:
    """Our Etcd interface over a dict, for the batcher's rounds: each txn waits
    for `step` (so that the test decides what queues behind it) and applies
    like etcd (all compares hold: every put; else the failure reads)."""

    def __init__(self, existing: set[bytes]) -> None:
        from etcd3.etcdrpc import rpc_pb2

        self.pb = rpc_pb2
        self.kv = {k: b"earlier" for k in existing}
        self.step = asyncio.Event()
        self.batches: list[list[bytes]] = []  # the keys each txn tried to put
        self.arrived = asyncio.Event()  # set by every txn as it starts

    async def txn(self, compare, success, failure=()):
        from etcd3.etcdrpc import kv_pb2

        self.batches.append([op.request_put.key for op in success])
        self.arrived.set()
        await self.step.wait()
        self.step.clear()
        if all((c.key in self.kv) == (c.create_revision != 0) for c in compare):
            for op in success:
                self.kv[op.request_put.key] = op.request_put.value
            return True, 2, []
        responses = []
        for op in failure:
            key = op.request_range.key
            kvs = ([kv_pb2.KeyValue(key=key, value=self.kv[key], create_revision=1,
                                     mod_revision=1)] if key in self.kv else [])
            responses.append(self.pb.ResponseOp(
                response_range=self.pb.RangeResponse(kvs=kvs)))
        return False, 2, responses


def test_a_claim_blocked_by_others_twice_goes_alone(loop_thread):
    """b holds its compares but shares a failing txn twice (with x, then y,
    both taken): the third time it goes alone, not with z (taken too), and wins."""
    etcd = _ScriptedEtcd({b"x", b"y", b"z"})
    batcher = GuardedBatcher(etcd)

    def claim(key: bytes):
        return asyncio.ensure_future(batcher.txn([cmp_absent(key)], [op_put(key, b"mine")], [key]))

    async def sent(n: int) -> None:  # until the n-th txn waits for its step
        while len(etcd.batches) < n:
            etcd.arrived.clear()
            await etcd.arrived.wait()

    async def body():
        first = claim(b"a")  # goes alone at once
        await sent(1)
        b, x = claim(b"b"), claim(b"x")  # queue behind it: then one txn together
        await asyncio.sleep(0.01)
        etcd.step.set()
        await sent(2)
        y = claim(b"y")  # queues behind [b, x]
        await asyncio.sleep(0.01)
        etcd.step.set()  # [b, x] fails on x; b goes again, with y
        await sent(3)
        z = claim(b"z")  # taken as well, queues behind [y, b]
        await asyncio.sleep(0.01)
        etcd.step.set()  # [y, b] fails on y: b was blocked twice, so z does not take it along
        await sent(4)
        etcd.step.set()  # [z] alone, fails
        await sent(5)
        etcd.step.set()  # [b] alone
        return await asyncio.gather(first, b, x, y, z)

    first, b, x, y, z = loop_thread.run(body())
    assert first[0] and b[0] and not (x[0] or y[0] or z[0])
    assert [r[2][0].value for r in (x, y, z)] == [b"earlier"] * 3
    assert etcd.batches == [[b"a"], [b"b", b"x"], [b"y", b"b"], [b"z"], [b"b"]]
    assert etcd.kv[b"b"] == b"mine"


def test_a_large_prefix_is_read_a_page_at_a_time_at_one_revision(etcd, loop_thread, prefix):
    """A tenant's whole index can exceed the client's 8 MiB message limit in
    one range; scan_prefix reads it in pages, all at the first page's
    revision."""

    async def body():
        client = Etcd([etcd.endpoint])
        head = f"{prefix}/a/t/".encode()
        value = b"x" * 4000  # 2,500 of these: 10 MB, over one message's limit
        for start in range(0, 2500, 100):
            await client.txn([], [op_put(head + b"k%05d" % i, value)
                                  for i in range(start, start + 100)])
        await client.put(f"{prefix}/a/u/k".encode(), b"another tenant")
        try:
            await client.get_prefix(head)
            raise AssertionError("one range of 10 MB was expected to be refused")
        except Unavailable as exc:
            assert "RESOURCE_EXHAUSTED" in str(exc)
        seen = []
        async for kv in client.scan_prefix(head, page=1000):
            if not seen:  # written after the scan began: not in it
                await client.put(head + b"k99999", value)
            seen.append(kv.key)
        await client.close()
        return seen

    seen = loop_thread.run(body())
    assert seen == [f"{prefix}/a/t/k{i:05d}".encode() for i in range(2500)]


class _GatedEtcd:
    """Our Etcd interface: every txn waits at a gate the test opens, then
    succeeds; records what each txn tried to put."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.batches: list[list[bytes]] = []

    async def txn(self, compare, success, failure=()):
        self.batches.append([op.request_put.key for op in success])
        await self.gate.wait()
        return True, 2, []


def test_a_full_batch_does_not_wait_for_the_txn_out():
    """One txn out at a time while batches are small (they grow while it is
    out); but a full batch's worth goes at once, up to full_in_flight."""
    etcd = _GatedEtcd()
    batcher = GuardedBatcher(etcd, max_items=4, full_in_flight=3)

    async def body():
        def claim(i: int):
            key = b"k%02d" % i
            return asyncio.ensure_future(batcher.txn([cmp_absent(key)], [op_put(key, b"v")], [key]))

        async def settle():
            for _ in range(5):
                await asyncio.sleep(0)

        claims = [claim(0)]
        await settle()
        claims += [claim(i) for i in range(1, 4)]  # 3 queue: not a full batch
        await settle()
        sent_small = len(etcd.batches)
        claims.append(claim(4))  # the 4th makes a full batch: it goes
        await settle()
        claims += [claim(i) for i in range(5, 9)]  # another full batch: a third txn
        await settle()
        claims += [claim(i) for i in range(9, 13)]  # full, but 3 txns are out already
        await settle()
        sent_full = len(etcd.batches)
        etcd.gate.set()
        results = await asyncio.gather(*claims)
        return sent_small, sent_full, results

    sent_small, sent_full, results = asyncio.run(body())
    assert sent_small == 1
    assert sent_full == 3
    assert all(r[0] for r in results)
    assert etcd.batches == [[b"k00"], [b"k%02d" % i for i in range(1, 5)],
                            [b"k%02d" % i for i in range(5, 9)],
                            [b"k%02d" % i for i in range(9, 13)]]


def test_renewals_share_one_stream_and_settle_in_order(etcd, loop_thread):
    async def body():
        client = Etcd([etcd.endpoint])
        try:
            leases = [await client.grant(30) for _ in range(3)]
            first = await client.keepalive_once(leases[0])
            stream = client._keepalives._stream
            answers = await asyncio.gather(*(client.keepalive_once(leases[i % 3])
                                             for i in range(12)))
            same_stream = client._keepalives._stream is stream and not stream.done()
            await client.revoke(leases[1])
            gone = await client.keepalive_once(leases[1])
            return first, answers, same_stream, gone
        finally:
            await client.close()

    first, answers, same_stream, gone = loop_thread.run(body())
    assert first >= 29 and all(a >= 29 for a in answers) and len(answers) == 12
    assert same_stream
    assert gone == 0  # revoked: etcd says so, the stream carries on


def test_a_renewal_against_an_unreachable_etcd_fails_and_does_not_hang(loop_thread):
    async def body():
        client = Etcd([f"127.0.0.1:{free_port()}"], timeout=1.0)  # nothing listens
        try:
            try:
                await client.keepalive_once(42)
            except Unavailable as exc:
                return str(exc)
            return None
        finally:
            await client.close()

    error = loop_thread.run(body(), timeout=10.0)  # the client's timeout, not a hang
    assert error is not None and "etcd" in error
