"""The compile farm's queue over real gRPC and etcd: claims, fencing, lapses,
recipes, and clear errors for bad requests."""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess.client import CacheClient, Identity

from .conftest import CALL_ERRORS, details_of, eventually, status_code

TPU = pb.Target(platform="tpu", topology="v5e:2x2")


def entry(i: int = 0, **kw) -> pb.Recipe:
    return pb.Recipe(entry="pkg.mod:programs", entry_index=i, target=TPU, **kw)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(CALL_ERRORS) as err:
        fn()
    return status_code(err.value)


@pytest.mark.parametrize("recipe, why", [
    (pb.Recipe(target=TPU), "needs an entry point or a program"),
    (pb.Recipe(entry="not an entry", target=TPU), "recipe.entry"),
    (pb.Recipe(entry="m:f"), "target.platform"),
    (pb.Recipe(entry="m:f", target=pb.Target(platform="tpu", topology="v5e/../x")),
     "target.topology"),
    (pb.Recipe(entry="m:f", target=TPU, job="bad job"), "recipe.job"),
    (pb.Recipe(entry="m:f", target=TPU, entry_index=-1), "entry_index"),
])
def test_bad_recipes_are_refused_and_nothing_is_queued(coordinator, recipe, why):
    client = CacheClient(coordinator.cfg.listen)
    with pytest.raises(CALL_ERRORS) as err:
        client.submit([recipe])
    assert status_code(err.value) == grpc.StatusCode.INVALID_ARGUMENT and why in details_of(err.value)
    assert client.tasks() == []


def test_a_task_is_claimed_once_renewed_and_settled_with_its_claim(coordinator):
    client = CacheClient(coordinator.cfg.listen)
    ids = client.submit([entry(0, program_name="jit_a"), entry(1, program_name="jit_b")])
    first = client.claim("w1", 0)
    second = client.claim("w2", 0)
    assert {first.task_id, second.task_id} == set(ids)
    assert first.task_id == ids[0]  # oldest first
    assert first.recipe.entry == "pkg.mod:programs" and first.recipe.entry_index == 0
    assert not client.claim("w3", 0).task_id  # nothing left
    assert client.renew(first.task_id, first.claim) > 0

    states = {t.task_id: t for t in client.tasks()}
    assert states[first.task_id].state == pb.RUNNING and states[first.task_id].worker == "w1"

    # Another worker's claim is not this one's: fenced by the claim's revision.
    assert code_of(lambda: client.finish(first.task_id, second.claim, True, "x")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    client.finish(first.task_id, first.claim, True, "published", key="k1")
    client.finish(second.task_id, second.claim, False, "boom")
    assert code_of(lambda: client.finish(first.task_id, first.claim, True, "again")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    states = {t.task_id: t for t in client.tasks()}
    assert (states[first.task_id].state, states[first.task_id].key) == (pb.DONE, "k1")
    assert (states[second.task_id].state, states[second.task_id].detail) == (pb.FAILED, "boom")
    st = client.status()
    assert (st.tasks_queued, st.tasks_running, st.tasks_done, st.tasks_failed) == (0, 0, 1, 1)


def test_a_claim_that_is_not_renewed_lapses_and_the_task_is_claimable_again(start_coordinator):
    coordinator = start_coordinator(lease_ttl_s=2)  # claims live at least 5 s
    client = CacheClient(coordinator.cfg.listen)
    [task] = client.submit([entry()])
    dead = client.claim("dies", 0)
    assert dead.task_id == task and dead.claim.ttl_seconds == 5
    assert not client.claim("w2", 0).task_id
    deadline = time.monotonic() + 30
    retaken = pb.ClaimCompileResponse()
    while not retaken.task_id and time.monotonic() < deadline:
        retaken = client.claim("w2", 1000)
    assert retaken.task_id == task
    assert client.renew(task, dead.claim) == 0  # the dead worker's claim is gone
    assert code_of(lambda: client.finish(task, dead.claim, True, "late")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    client.finish(task, retaken.claim, True, "published")


def test_a_claim_waits_for_a_submit(coordinator):
    client = CacheClient(coordinator.cfg.listen)
    call = client.stub.ClaimCompile.future(pb.ClaimCompileRequest(worker="w", wait_ms=20000))
    eventually(lambda: coordinator.state.farm.claiming == 1, "the claim waiting")
    [task] = client.submit([entry()])
    assert call.result(timeout=10).task_id == task


def test_recipes_are_recorded_with_the_artifact_and_listed_by_job(coordinator):
    client = CacheClient(coordinator.cfg.listen, identity=Identity(job="job-1"))
    data = b"executable" * 100
    lease = client.acquire("key-1").lease
    recipe = pb.Recipe(program=b"\x00mlir", compile_options=b"opts", device_ids=[0, 1],
                       target=TPU, program_name="jit_f")
    info = client.publish("key-1", lease, data, 1.5, recipe=recipe)
    assert info.recipe_digest
    listed = client.list_recipes("job-1")
    assert len(listed) == 1
    assert (listed[0].key, listed[0].job, listed[0].program) == ("key-1", "job-1", b"\x00mlir")
    assert hashlib.sha256(listed[0].SerializeToString()).hexdigest() == info.recipe_digest
    assert client.list_recipes("job-2") == []
    # Replaying a job queues one task per recipe, retargeted.
    ids = client.submit(replay_job="job-1", target=pb.Target(platform="tpu", topology="v5e:2x4"))
    claimed = client.claim("w", 0)
    assert claimed.task_id == ids[0] and claimed.recipe.target.topology == "v5e:2x4"
    assert claimed.recipe.program == b"\x00mlir" and not claimed.recipe.key
    assert code_of(lambda: client.submit(replay_job="nobody", target=TPU)) == \
        grpc.StatusCode.NOT_FOUND


def test_bad_farm_requests_get_clear_errors(coordinator):
    client = CacheClient(coordinator.cfg.listen)
    lease = pb.Lease(id=1, ttl_seconds=5, revision=1)
    assert code_of(lambda: client.finish("not-a-task", lease, True, "")) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: client.claim("w", 120000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: client.submit([])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: client.submit([entry()], target=TPU)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    big = pb.Recipe(program=b"x" * (4 << 20), target=TPU)
    assert code_of(lambda: client.submit([big])) in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                     grpc.StatusCode.INVALID_ARGUMENT)


def test_finished_tasks_are_pruned_to_the_newest(coordinator, loop_thread):
    client = CacheClient(coordinator.cfg.listen)
    ids = client.submit([entry(i) for i in range(4)])
    for _ in ids:
        c = client.claim("w", 0)
        client.finish(c.task_id, c.claim, True, "ok")
    farm = coordinator.state.farm
    loop_thread.run(farm._prune(farm._k("d", "default"), keep=2))
    assert [t.task_id for t in client.tasks()] == ids[2:]


def test_a_recipe_whose_blob_was_evicted_is_dropped_from_the_job_index(coordinator):
    client = CacheClient(coordinator.cfg.listen, identity=Identity(job="job-e"))
    recipe = pb.Recipe(program=b"\x00mlir", target=TPU)
    info = client.publish("key-e", client.acquire("key-e").lease, b"x" * 100, 1.0, recipe=recipe)
    coordinator.state.store.delete(info.recipe_digest)
    assert client.list_recipes("job-e") == []
    assert code_of(lambda: client.submit(replay_job="job-e", target=TPU)) == \
        grpc.StatusCode.NOT_FOUND


def test_a_worker_passes_the_farm_calls_on(coordinator, start_worker):
    worker = start_worker(coordinator.cfg.listen)
    via = CacheClient(worker.target, identity=Identity(job="job-w"))
    info = via.publish("key-w", via.acquire("key-w").lease, b"y" * 64, 1.0,
                       recipe=pb.Recipe(program=b"\x00p", target=TPU))
    assert info.recipe_digest
    assert [r.key for r in via.list_recipes("job-w")] == ["key-w"]
    [task] = via.submit([entry()])
    assert [t.task_id for t in via.tasks([task])] == [task]
