"""A tenant at the sizes a fleet reaches: thousands of artifacts listed,
purged and synced, every etcd transaction within etcd's limit of 128
operations (the test etcd runs with that default). Real etcd, coordinator
and workers on loopback."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from compilecast.coordinator.etcd import (
    MAX_TXN_OPS,
    Etcd,
    TxnTooLarge,
    op_get,
    op_put,
)
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import cc, publish
from .test_dirsync import KIND, NS, autotune, entries, host, write_whole

ARTIFACTS = 10_000
ENTRIES = 5_000


def publish_all(target: str, keys: list[str], data_of) -> None:
    """Publish each key through its own claim, eight clients at once."""
    clients = [CacheClient(target) for _ in range(8)]
    try:
        def part(i: int) -> None:
            for key in keys[i::len(clients)]:
                publish(clients[i], key, data_of(key))

        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(part, range(len(clients))))
    finally:
        for c in clients:
            c.close()


def test_a_txn_beyond_etcds_limit_is_refused_before_it_is_sent(etcd, loop_thread, prefix):
    async def body():
        client = Etcd([etcd.endpoint])
        try:
            keys = [f"{prefix}/m/{i:05d}".encode() for i in range(3 * MAX_TXN_OPS + 5)]
            with pytest.raises(TxnTooLarge):
                await client.txn([], [op_put(k, b"x") for k in keys[:MAX_TXN_OPS + 1]])
            with pytest.raises(TxnTooLarge):
                await client.txn([], [], [op_get(k) for k in keys[:MAX_TXN_OPS + 1]])
            for start in range(0, len(keys), MAX_TXN_OPS):
                await client.txn([], [op_put(k, k[-5:]) for k in keys[start:start + MAX_TXN_OPS]])
            before = await client.get_many(keys)
            # Rewritten after the read: the read saw one revision, all of it.
            await client.txn([], [op_put(k, b"later") for k in keys[:MAX_TXN_OPS]])
            return before, await client.get_many([*keys, f"{prefix}/absent".encode()])
        finally:
            await client.close()

    before, after = loop_thread.run(body())
    assert [kv.value for kv in before] == [f"{i:05d}".encode() for i in range(3 * MAX_TXN_OPS + 5)]
    assert len({kv.mod_revision for kv in before}) == 4  # the four txns that wrote them
    assert [kv.value for kv in after[:MAX_TXN_OPS]] == [b"later"] * MAX_TXN_OPS
    assert after[MAX_TXN_OPS].value == before[MAX_TXN_OPS].value and after[-1] is None


@pytest.mark.timeout(900)  # 10,000 claims and publishes first (about 2 min on 2 cores)
def test_a_tenant_of_ten_thousand_artifacts_is_listed_and_purged_page_by_page(coordinator):
    keys = [f"prog-{i:05d}" for i in range(ARTIFACTS)]
    publish_all(coordinator.cfg.listen, keys, lambda k: k.encode() * 3)
    c = CacheClient(coordinator.cfg.listen)

    listed = [a.artifact for a in c.list_artifacts()]  # the coordinator's page: 500
    assert [a.key for a in listed] == keys
    assert all(a.digest == hashlib.sha256(a.key.encode() * 3).hexdigest() for a in listed)
    assert [a.artifact.key for a in c.list_artifacts(page=5000)] == keys
    assert [a.artifact.key for a in c.list_artifacts(prefix="prog-0999")] == \
        [f"prog-0999{i}" for i in range(10)]
    out = cc("ls", "--coordinator", coordinator.cfg.listen)
    assert out.returncode == 0, out.stderr
    assert f"{ARTIFACTS} artifacts" in out.stdout.splitlines()[-1]
    assert c.status().artifacts == ARTIFACTS

    dry = c.purge(keys[:3000], dry_run=True)
    assert sorted(dry.purged) == keys[:3000] and c.status().artifacts == ARTIFACTS
    resp = c.purge(keys, reason="a bad compiler release")  # in pages of the client's
    assert sorted(resp.purged) == keys and not resp.missing
    assert len(resp.revoked) == ARTIFACTS
    assert list(c.list_artifacts()) == []
    assert c.status().artifacts == 0 and c.status().revoked == ARTIFACTS
    assert len(c.revoked().revocations) == ARTIFACTS
    assert c.acquire(keys[-1]).decision == pb.COMPILE  # a miss again
    again = c.purge(keys[:2])
    assert list(again.missing) == keys[:2]


@pytest.mark.timeout(900)  # 5,000 publishes and 5,000 installs (about 2 min on 2 cores)
def test_a_directory_of_five_thousand_entries_reaches_a_second_host(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    da, db = a.open_directory(KIND, NS), b.open_directory(KIND, NS)
    written = {f"entry-{i:05d}.textproto": autotune(i, 200) for i in range(ENTRIES)}
    for name, data in written.items():
        write_whole(da.path, name, data)

    # One pass each (a worker's background pass has no deadline; asked for, it has one).
    assert a.sync_directory(KIND, da.namespace_id, timeout_s=600).published == ENTRIES
    got = b.sync_directory(KIND, db.namespace_id, timeout_s=600)

    assert got.installed == ENTRIES and got.directory.entries == ENTRIES
    assert entries(db.path) == written
    assert b.sync_directory(KIND, db.namespace_id).installed == 0
