"""Index sweeps (coordinator/sweep.py) and the key records they prune,
against real etcd, gRPC and coordinators."""

from __future__ import annotations

import json
import time

from compilecast.coordinator.etcd import Etcd
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient

from .conftest import eventually, publish

COMPONENTS = {"program": "p0", "compile_options": "o0", "platform": "cpu"}


def etcd_keys(loop_thread, endpoint: str, prefix: str) -> set[str]:
    async def read():
        client = Etcd([endpoint])
        try:
            return {kv.key.decode()[len(prefix):]
                    for kv in await client.get_prefix(prefix.encode() + b"/")}
        finally:
            await client.close()

    return loop_thread.run(read())


def swept(coordinator, record: str) -> float:
    return coordinator.registry.get_sample_value("compilecast_coordinator_swept_total",
                                                 {"record": record}) or 0.0


def test_a_sweep_drops_the_entries_of_evicted_artifacts(coordinator, loop_thread, etcd, prefix):
    c = CacheClient(coordinator.cfg.listen)
    infos = {k: publish(c, k, k.encode() * 1000, components=dict(COMPONENTS, program=k),
                        program_name="step") for k in ("k1", "k2", "k3")}
    eventually(lambda: {f"/k/default/{k}" for k in infos} <= etcd_keys(loop_thread,
               etcd.endpoint, prefix), "the key records are written")
    assert loop_thread.run(coordinator.state.sweeper.sweep()) == (0, 0)  # nothing to drop
    coordinator.store.delete(infos["k2"].digest)  # as the bounded store evicts it
    assert loop_thread.run(coordinator.state.sweeper.sweep()) == (1, 0)
    keys = etcd_keys(loop_thread, etcd.endpoint, prefix)
    assert "/a/default/k2" not in keys
    assert {"/a/default/k1", "/a/default/k3"} <= keys
    assert "/k/default/k2" in keys  # its record stays: it is young, and explains misses
    assert swept(coordinator, "index_entry") == 1
    assert c.acquire("k1").decision == pb.HIT
    assert c.acquire("k2").decision == pb.COMPILE  # compiles again
    assert loop_thread.run(coordinator.state.sweeper.sweep()) == (0, 0)  # idempotent


def test_old_key_records_go_once_their_key_has_no_artifact(start_coordinator, loop_thread,
                                                           etcd, prefix):
    coordinator = start_coordinator(key_record_days=1)
    c = CacheClient(coordinator.cfg.listen)
    publish(c, "published", b"x" * 1000, components=COMPONENTS, program_name="step")
    claims = {key: c.acquire(key, components=dict(COMPONENTS, program=key),
                             program_name="step") for key in ("released", "compiling", "young")}
    assert all(r.decision == pb.COMPILE for r in claims.values())
    c.release("released", claims["released"].lease, pb.ABANDONED, "gave up")
    eventually(lambda: {f"/k/default/{k}" for k in ("published", "released", "compiling",
                                                    "young")}
               <= etcd_keys(loop_thread, etcd.endpoint, prefix), "the key records are written")

    async def age(keys: list[str]) -> None:  # as if first seen two days ago
        client = Etcd([etcd.endpoint])
        try:
            for key in keys:
                record = f"{prefix}/k/default/{key}".encode()
                value = json.loads((await client.get(record)).value)
                value["first_seen"] = time.time() - 2 * 86400
                await client.put(record, json.dumps(value).encode())
        finally:
            await client.close()

    loop_thread.run(age(["published", "released", "compiling"]))
    assert c.keepalive("compiling", claims["compiling"].lease) > 0  # still compiling
    assert loop_thread.run(coordinator.state.sweeper.sweep()) == (0, 1)
    keys = etcd_keys(loop_thread, etcd.endpoint, prefix)
    assert "/k/default/released" not in keys  # old, no artifact, nobody compiling it
    assert not [k for k in keys if k.startswith("/n/") and k.endswith("/released")]
    for kept in ("published", "compiling", "young"):  # an artifact, a claim, young
        assert f"/k/default/{kept}" in keys
        assert [k for k in keys if k.startswith("/n/") and k.endswith(f"/{kept}")]
    assert swept(coordinator, "key_record") == 1


def test_sweeps_can_be_switched_off(start_coordinator, loop_thread):
    coordinator = start_coordinator(key_record_days=0, index_sweep_s=0)
    assert coordinator._sweeps is None
    c = CacheClient(coordinator.cfg.listen)
    c.acquire("k", components=COMPONENTS, program_name="step")
    assert loop_thread.run(coordinator.state.sweeper.sweep()) == (0, 0)


def test_a_miss_is_explained_by_the_newest_keys_of_its_program(coordinator, loop_thread):
    """More keys of one program than the coordinator compares with (64): the
    nearest is among the most recent, whatever their keys sort as."""
    c = CacheClient(coordinator.cfg.listen)
    for i in range(70):  # old versions, far from the new one: k000 ... k069
        c.acquire(f"k{i:03d}", program_name="step", components={
            "program": f"p{i}", "compile_options": f"o{i}", "platform": f"cpu{i}"})
    eventually(lambda: coordinator.registry.get_sample_value(
        "compilecast_coordinator_misses_by_component_total",
        {"component": "platform"}) == 69, "the records are written")
    latest = {"program": "p69", "compile_options": "o69", "platform": "cpu69"}
    c.acquire("a-new-key", program_name="step", components=dict(latest, platform="tpu"))
    # a-new-key sorts before every k*: only the newest-first read finds k069.
    eventually(lambda: coordinator.registry.get_sample_value(
        "compilecast_coordinator_misses_by_component_total",
        {"component": "platform"}) == 70, "the miss is explained")
    assert coordinator.registry.get_sample_value(
        "compilecast_coordinator_misses_by_component_total", {"component": "program"}) == 69


def test_a_sweep_over_many_pages_drops_exactly_the_right_records(etcd, prefix, tmp_path,
                                                                  loop_thread, monkeypatch):
    """Pages of 50 over 300 keys: the entries without blobs go, and the old
    records of keys with no artifact and no claim, whatever page they are on."""
    from prometheus_client import CollectorRegistry

    from compilecast.blobstore import DiskBlobStore
    from compilecast.coordinator import sweep
    from compilecast.coordinator.etcd import op_put
    from compilecast.coordinator.metrics import CoordinatorMetrics
    from compilecast.coordinator.presence import Presence
    from compilecast.coordinator.records import KeyRecords

    monkeypatch.setattr(sweep, "PAGE", 50)
    store = DiskBlobStore(tmp_path / "store")
    old = time.time() - 90 * 86400
    p = prefix.encode()

    def sk(i: int) -> str:
        return f"t{i % 2}/key{i:04d}"  # two tenants, interleaved in key order

    async def body():
        client = Etcd([etcd.endpoint])
        metrics = CoordinatorMetrics(CollectorRegistry())
        forgotten = []
        sweeper = sweep.IndexSweeper(client, p, Presence(store, metrics.bucket_stalls), KeyRecords(client, p, metrics), metrics,
                                     record_max_age_s=30 * 86400,
                                     forget=lambda key, rev: forgotten.append(key))
        try:
            for start in range(0, 300, 20):
                ops = []
                for i in range(start, start + 20):
                    digest = f"{i:064x}"
                    if i % 3 == 0:  # an index entry, its blob present unless i % 9 == 0
                        ops.append(op_put(p + f"/a/{sk(i)}".encode(),
                                          json.dumps({"digest": digest}).encode()))
                        if i % 9:
                            store.path_of(digest).parent.mkdir(parents=True, exist_ok=True)
                            store.path_of(digest).touch()
                    if i % 5 == 0:  # a claim in progress
                        ops.append(op_put(p + f"/l/{sk(i)}".encode(), b"{}"))
                    ops.append(op_put(p + f"/k/{sk(i)}".encode(), json.dumps(
                        {"program_name": "step", "first_seen": old if i % 2 else time.time()}
                    ).encode()))
                await client.txn([], ops)
            result = await sweeper.sweep()
            left = {kv.key[len(p):].decode() for kv in await client.get_prefix(p + b"/")}
            return result, left, forgotten
        finally:
            await client.close()

    (entries, records), left, forgotten = loop_thread.run(body())
    gone_entries = {sk(i) for i in range(0, 300, 9)}
    assert sorted(forgotten) == sorted(gone_entries) and entries == len(gone_entries)
    assert {k[3:] for k in left if k.startswith("/a/")} == \
        {sk(i) for i in range(0, 300, 3)} - gone_entries
    # Old records (odd i) go unless the key has an entry left or a claim.
    kept_old = {sk(i) for i in range(1, 300, 2)
                if (i % 3 == 0 and i % 9) or i % 5 == 0}
    young = {sk(i) for i in range(0, 300, 2)}
    assert {k[3:] for k in left if k.startswith("/k/")} == young | kept_old
    assert records == 150 - len(kept_old)


def test_a_replica_sweeps_on_its_own(start_coordinator, loop_thread, etcd, prefix):
    coordinator = start_coordinator(index_sweep_s=0.5)
    c = CacheClient(coordinator.cfg.listen)
    gone = publish(c, "gone", b"g" * 1000)
    publish(c, "kept", b"k" * 1000)
    coordinator.store.delete(gone.digest)
    eventually(lambda: "/a/default/gone" not in etcd_keys(loop_thread, etcd.endpoint, prefix),
               "a periodic sweep drops the entry", seconds=15)
    assert "/a/default/kept" in etcd_keys(loop_thread, etcd.endpoint, prefix)
    assert swept(coordinator, "index_entry") == 1
