"""Key records (what each key was made of, to explain misses), written in
batches in the background, against a real etcd on loopback."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from compilecast.coordinator.etcd import Etcd
from compilecast.coordinator.metrics import CoordinatorMetrics
from compilecast.coordinator.records import (
    LATEST,
    KeyRecords,
    _Components,
    _Latest,
    json_dict,
    scope,
)

BASE = {"program": "p1", "compile_options": "o1", "platform": "cpu", "xla_flags": "f1"}


def counts(registry: CollectorRegistry) -> dict[str, float]:
    """misses_by_component by component."""
    return {s.labels["component"]: s.value
            for m in registry.collect() if m.name == "compilecast_coordinator_misses_by_component"
            for s in m.samples if s.name.endswith("_total")}


async def recorded(records: KeyRecords, etcd: Etcd, prefix: bytes, keys: list[str]) -> list:
    """Wait for the recorder to finish; each key's record (None: none)."""
    for _ in range(500):
        if records._recorder is None:
            break
        await asyncio.sleep(0.01)
    got = await etcd.get_many([prefix + f"/k/{scope('default', k)}".encode() for k in keys])
    return [json_dict(kv.value) if kv is not None else None for kv in got]


def test_keys_recorded_together_are_compared_with_each_other(etcd, loop_thread, prefix):
    """Three keys of one program name in one batch: the second is explained
    by what differs from the first, the third by what differs from the
    nearer of the two; another name's key is a new program. Recording a key
    again counts nothing."""
    registry = CollectorRegistry()

    async def body():
        client = Etcd([etcd.endpoint])
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(registry))
        try:
            second = dict(BASE, compile_options="o2")
            third = dict(second, program="p2", xla_flags="f2")
            for key, name, comps in (("a", "jit_step", BASE), ("b", "jit_step", second),
                                     ("c", "jit_step", third), ("d", "jit_other", BASE)):
                records.record(scope("default", key), name, comps)
            first_round = await recorded(records, client, prefix.encode(), ["a", "b", "c", "d"])
            before = counts(registry)
            records.record(scope("default", "b"), "jit_step", second)  # seen already
            await recorded(records, client, prefix.encode(), ["b"])
            return first_round, before, counts(registry)
        finally:
            await records.close()
            await client.close()

    got, before, after = loop_thread.run(body())
    assert [r["program_name"] for r in got] == ["jit_step"] * 3 + ["jit_other"]
    assert got[1]["components"]["compile_options"] == "o2"
    assert before == {"new_program": 2, "compile_options": 1, "program": 1, "xla_flags": 1}
    assert after == before


def test_a_storm_of_misses_is_recorded_up_to_the_backlog(etcd, loop_thread, prefix):
    """Keys asked to be recorded while more than backlog_max wait go
    unrecorded, counted; the others are recorded."""
    registry = CollectorRegistry()

    async def body():
        client = Etcd([etcd.endpoint])
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(registry))
        records.backlog_max = 40
        try:
            keys = [f"k{i}" for i in range(100)]
            for i, key in enumerate(keys):  # no await between: all arrive at once
                records.record(scope("default", key), "jit_step", dict(BASE, program=f"p{i}"))
            return await recorded(records, client, prefix.encode(), keys)
        finally:
            await records.close()
            await client.close()

    got = loop_thread.run(body())
    assert [r is not None for r in got] == [True] * 40 + [False] * 60
    assert registry.get_sample_value("compilecast_coordinator_key_records_skipped_total") == 60
    assert counts(registry) == {"new_program": 1, "program": 39}


def test_keys_that_trickle_in_are_recorded_in_one_round(etcd, loop_thread, prefix):
    """Short of a full batch, a round waits round_gap_s for more keys: five
    keys asked 10 ms apart are recorded in one round (two etcd round trips),
    not one round each."""
    registry = CollectorRegistry()

    async def body():
        client = Etcd([etcd.endpoint])
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(registry))
        records.round_gap_s = 1.0
        rounds = []
        record_batch = records._record_batch

        async def counted(batch):
            rounds.append(len(batch))
            await record_batch(batch)

        records._record_batch = counted
        try:
            keys = [f"t{i}" for i in range(5)]
            for i, key in enumerate(keys):
                records.record(scope("default", key), "jit_step", dict(BASE, program=f"p{i}"))
                await asyncio.sleep(0.01)
            return rounds, await recorded(records, client, prefix.encode(), keys)
        finally:
            await records.close()
            await client.close()

    rounds, got = loop_thread.run(body())
    assert rounds == [5]
    assert all(r is not None for r in got)
    assert counts(registry) == {"new_program": 1, "program": 4}


def test_a_stop_records_what_waits_first(etcd, loop_thread, prefix):
    """close() records the keys still waiting (without the round gap)
    before it stops; keys asked after it are not taken."""
    registry = CollectorRegistry()

    async def body():
        client = Etcd([etcd.endpoint])
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(registry))
        records.round_gap_s = 60.0  # a round would wait long for more
        try:
            keys = [f"s{i}" for i in range(3)]
            for i, key in enumerate(keys):
                records.record(scope("default", key), "jit_step", dict(BASE, program=f"p{i}"))
            await asyncio.sleep(0.05)  # the recorder is in its round gap
            await asyncio.wait_for(records.close(), 30)
            records.record(scope("default", "late"), "jit_step", BASE)
            assert records._recorder is None
            return await recorded(records, client, prefix.encode(), [*keys, "late"])
        finally:
            await client.close()

    got = loop_thread.run(body())
    assert [r is not None for r in got] == [True, True, True, False]


def test_a_stop_waits_for_records_at_most_close_s(loop_thread, prefix):
    """With etcd gone, close() gives up on the waiting keys after CLOSE_S."""
    from compilecast.launch import free_port

    async def body():
        client = Etcd([f"127.0.0.1:{free_port()}"], timeout=30.0)  # nothing listens
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(CollectorRegistry()))
        records.round_gap_s, records.CLOSE_S = 0.0, 0.5
        try:
            records.record(scope("default", "k"), "jit_step", BASE)
            await asyncio.sleep(0.05)  # its round is stuck on etcd
            # Etcd's own timeout is 30 s: a close that waited for it fails here.
            await asyncio.wait_for(records.close(), timeout=10)
            return records._recorder
        finally:
            await client.close()

    assert loop_thread.run(body()) is None


def test_a_twin_is_nearer_than_any_key_that_differs(etcd, loop_thread, prefix):
    """A key whose components all equal an earlier key's (a new key version,
    say) is explained by nothing, even when a key differing in one component
    was recorded after that twin."""
    registry = CollectorRegistry()

    async def body():
        client = Etcd([etcd.endpoint])
        records = KeyRecords(client, prefix.encode(), CoordinatorMetrics(registry))
        try:
            for key, comps in (("a", BASE), ("b", dict(BASE, program="p2")), ("c", BASE)):
                records.record(scope("default", key), "jit_step", comps)
            await recorded(records, client, prefix.encode(), ["a", "b", "c"])
            return counts(registry), list(records.recent)
        finally:
            await records.close()
            await client.close()

    got, recent = loop_thread.run(body())
    assert got == {"new_program": 1, "program": 1}
    assert [(sk, differing) for sk, _, differing, _ in recent] == [
        ("default/b", ["program"]), ("default/a", ["new_program"])]


_comps = st.dictionaries(st.sampled_from(["program", "flags", "platform", "options", "jax"]),
                         st.sampled_from(["a", "b", "c"]), min_size=1)


@settings(max_examples=300, deadline=None)
@given(earlier=st.lists(_comps, max_size=LATEST + 20), mine=_comps)
def test_the_nearest_key_is_the_newest_with_the_fewest_components_differing(earlier, mine):
    """The shared-entry search finds what comparing with every one of the
    LATEST keys would: fewest components differing, then the newest."""
    added = [_Components(c) for c in earlier]
    latest = _Latest([])
    for comps in added:
        latest.add(comps)
    window = added[::-1][:LATEST]  # newest first
    me = _Components(mine)
    got = latest.nearest(me)
    if not window:
        assert got is None
        return
    fewest = min(me.differing(o) for o in window)
    expected = next(o for o in window if me.differing(o) == fewest)
    assert got is expected
    # Built from a list read from etcd (newest first), the same answer.
    assert _Latest(window).nearest(me) is expected
