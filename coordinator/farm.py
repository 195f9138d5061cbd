"""Recipes (how to compile a program again) and the compile farm's task queue.

etcd layout under the prefix P (TENANT scopes everything, as in state.py):

    P/r/TENANT/JOBHASH/KEY   digest of the recipe recorded with KEY's artifact, for a job
    P/q/TENANT/TASK          a pending farm task (JSON: recipe digest, program, target)
    P/c/TENANT/TASK          the claim of a running task, attached to the farm
                             worker's etcd lease: when the worker dies the claim
                             lapses and the task is pending again
    P/d/TENANT/TASK          a finished task (JSON, state DONE)
    P/f/TENANT/TASK          a failed task (JSON, state FAILED)

Recipes themselves are blobs in the coordinator's content-addressed store,
next to the artifacts, bounded and evicted like them; a recipe whose blob was
evicted is skipped by a replay (and logged). Task ids sort by submission time,
so a claim takes the oldest pending task. Claims follow the lease rules of
compile leases: created by a txn that checks the claim is absent and the task
unchanged, settled by a txn on the claim's revision (the fencing token).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator

from compilecast import validate
from compilecast.errors import CorruptBlob, InvalidRequest, LeaseError, NotFound
from compilecast.store import ArtifactStore
from compilecast.v1 import cache_pb2 as pb

from .etcd import EtcdClient, cmp_absent, cmp_mod_revision, op_delete, op_put
from .metrics import CoordinatorMetrics
from .records import json_dict

log = logging.getLogger(__name__)

MAX_WAIT_MS = 60_000
POLL_S = 0.25
MAX_TASKS_LISTED = 1000
MAX_FINISHED = 10_000  # finished (done + failed) task records kept per tenant and state


def target_name(t: pb.Target) -> str:
    return f"{t.platform}:{t.topology}" if t.topology else f"{t.platform}:local"


def new_task_id() -> str:
    return f"{time.time_ns():020d}-{os.urandom(4).hex()}"


class Farm:
    def __init__(self, etcd: EtcdClient, store: ArtifactStore, prefix: bytes,
                 metrics: CoordinatorMetrics, claim_ttl_s: int) -> None:
        self.etcd = etcd
        self.claiming = 0  # ClaimCompile calls waiting for a task now
        self.store = store
        self.prefix = prefix
        self.metrics = metrics
        self.claim_ttl_s = max(claim_ttl_s, 5)
        self._submitted = asyncio.Event()

    def _k(self, kind: str, tenant: str, rest: str = "") -> bytes:
        return self.prefix + f"/{kind}/{tenant}/{rest}".encode()

    @staticmethod
    def _job_hash(job: str) -> str:
        return hashlib.sha256(job.encode()).hexdigest()[:32]

    # -- recipes ---------------------------------------------------------
    async def store_recipe(self, recipe: pb.Recipe) -> str:
        validate.recipe(recipe, need_target=False)
        return await asyncio.to_thread(self.store.put_bytes, recipe.SerializeToString())

    async def record(self, tenant: str, recipe: pb.Recipe, digest: str) -> None:
        """Index a published artifact's recipe under its job, for replays."""
        if recipe.job:
            await self.etcd.put(self._k("r", tenant, f"{self._job_hash(recipe.job)}/{recipe.key}"),
                                digest.encode())

    async def load_recipe(self, digest: str) -> pb.Recipe:
        try:
            data = await asyncio.to_thread(self.store.read_bytes, digest)
        except FileNotFoundError as exc:
            raise NotFound(f"recipe {digest} is no longer stored") from exc
        recipe = pb.Recipe()
        recipe.ParseFromString(data)
        return recipe

    async def list_recipes(self, tenant: str, job: str) -> AsyncIterator[pb.Recipe]:
        if not job:
            raise InvalidRequest("name the job whose recipes to list")
        validate.job(job)
        for kv in await self.etcd.get_prefix(self._k("r", tenant, self._job_hash(job) + "/")):
            digest = kv.value.decode()
            try:
                recipe = await self.load_recipe(digest)
            except (NotFound, CorruptBlob) as exc:  # evicted with the store: forget it
                log.warning("dropping the recipe index entry %s: %s", kv.key.decode(), exc)
                await self.etcd.delete(kv.key)
                continue
            yield recipe

    # -- tasks -----------------------------------------------------------
    async def submit(self, tenant: str, req: pb.SubmitCompilesRequest) -> list[str]:
        recipes = list(req.recipes)
        if req.replay_job:
            validate.target(req.target)
            async for r in self.list_recipes(tenant, req.replay_job):
                r.target.CopyFrom(req.target)
                r.key = ""  # the key on the new target is whatever it compiles to
                recipes.append(r)
            if not recipes:
                raise NotFound(f"no recipes recorded for job {req.replay_job}")
        elif req.HasField("target"):
            raise InvalidRequest("target goes with replay_job; each recipe carries its own")
        if not recipes:
            raise InvalidRequest("nothing to compile: give recipes or replay_job")
        if len(recipes) > MAX_TASKS_LISTED:
            raise InvalidRequest(f"at most {MAX_TASKS_LISTED} tasks per request")
        for r in recipes:  # all valid before any is queued
            validate.recipe(r, need_target=True)
        ids = []
        for r in recipes:
            digest = await self.store_recipe(r)
            task = new_task_id()
            body = {"recipe": digest, "program": r.program_name or r.entry,
                    "target": target_name(r.target), "submitted": time.time()}
            await self.etcd.put(self._k("q", tenant, task), json.dumps(body).encode())
            ids.append(task)
        self.metrics.tasks.labels("submitted").inc(len(ids))
        log.info("queued %d compile tasks%s", len(ids),
                 f" (replay of job {req.replay_job})" if req.replay_job else "")
        self._submitted.set()
        return ids

    async def claim(self, tenant: str, worker: str, wait_ms: int) -> pb.ClaimCompileResponse:
        if not 0 <= wait_ms <= MAX_WAIT_MS:
            raise InvalidRequest(f"wait_ms must be in [0, {MAX_WAIT_MS}]")
        if len(worker) > validate.MAX_CLIENT_LEN:
            raise InvalidRequest("worker name is too long")
        deadline = time.monotonic() + wait_ms / 1000.0
        while True:
            got = await self._try_claim(tenant, worker)
            if got is not None or time.monotonic() >= deadline:
                return got or pb.ClaimCompileResponse()
            self._submitted.clear()
            # Woken early by a submit on this replica; other replicas' submits
            # are seen at the next poll.
            self.claiming += 1
            try:
                await asyncio.wait_for(self._submitted.wait(),
                                       min(POLL_S * 4, max(deadline - time.monotonic(), 0)))
            except TimeoutError:
                pass
            finally:
                self.claiming -= 1

    async def _try_claim(self, tenant: str, worker: str) -> pb.ClaimCompileResponse | None:
        pending = await self.etcd.get_prefix(self._k("q", tenant), limit=MAX_TASKS_LISTED)
        if not pending:
            return None
        claimed = {kv.key.rsplit(b"/", 1)[1]
                   for kv in await self.etcd.get_prefix(self._k("c", tenant))}
        for kv in pending:
            task = kv.key.rsplit(b"/", 1)[1]
            if task in claimed:
                continue
            task_id = task.decode()
            body = json_dict(kv.value) or {}
            lease_id = await self.etcd.grant(self.claim_ttl_s)
            claim = json.dumps({"worker": worker, "lease": lease_id, "claimed": time.time()})
            ok, revision, _ = await self.etcd.txn(
                [cmp_mod_revision(kv.key, kv.mod_revision), cmp_absent(self._k("c", tenant, task_id))],
                [op_put(self._k("c", tenant, task_id), claim.encode(), lease=lease_id)],
            )
            if not ok:  # another farm worker was faster
                await self.etcd.revoke(lease_id)
                continue
            try:
                recipe = await self.load_recipe(body["recipe"])
            except (NotFound, CorruptBlob) as exc:
                lease = pb.Lease(id=lease_id, ttl_seconds=self.claim_ttl_s, revision=revision)
                await self._settle(tenant, task_id, lease, False, f"recipe unreadable: {exc}", "")
                continue
            self.metrics.tasks.labels("claimed").inc()
            log.info("task %s (%s for %s) claimed by %s", task_id, body.get("program"),
                     body.get("target"), worker)
            return pb.ClaimCompileResponse(
                task_id=task_id, recipe=recipe,
                claim=pb.Lease(id=lease_id, ttl_seconds=self.claim_ttl_s, revision=revision))
        return None

    async def _check_claim(self, tenant: str, task_id: str, lease: pb.Lease) -> None:
        validate.task_id(task_id)
        validate.lease(lease)
        kv = await self.etcd.get(self._k("c", tenant, task_id))
        if kv is None or kv.mod_revision != lease.revision:
            raise LeaseError(f"the claim on task {task_id} is no longer held")

    async def renew(self, tenant: str, task_id: str, lease: pb.Lease) -> int:
        try:
            await self._check_claim(tenant, task_id, lease)
        except LeaseError:
            return 0
        return await self.etcd.keepalive_once(lease.id)

    async def finish(self, tenant: str, req: pb.FinishCompileRequest) -> None:
        await self._check_claim(tenant, req.task_id, req.claim)
        if req.key:
            validate.key(req.key)
        await self._settle(tenant, req.task_id, req.claim, req.ok,
                           req.detail[:validate.MAX_DETAIL_LEN], req.key)

    async def _settle(self, tenant: str, task_id: str, lease: pb.Lease, ok: bool, detail: str,
                      key: str) -> None:
        qkey, ckey = self._k("q", tenant, task_id), self._k("c", tenant, task_id)
        pending = await self.etcd.get(qkey)
        claim = await self.etcd.get(ckey)
        body = (json_dict(pending.value) or {}) if pending is not None else {}
        if claim is not None:
            body["worker"] = (json_dict(claim.value) or {}).get("worker", "")
        body.update(detail=detail, key=key, finished=time.time())
        done = self._k("d" if ok else "f", tenant, task_id)
        settled, _, _ = await self.etcd.txn(
            [cmp_mod_revision(ckey, lease.revision)],
            [op_put(done, json.dumps(body).encode()), op_delete(qkey), op_delete(ckey)],
        )
        if not settled:
            raise LeaseError(f"the claim on task {task_id} is no longer held")
        await self.etcd.revoke(lease.id)
        await self._prune(self._k("d" if ok else "f", tenant))
        self.metrics.tasks.labels("done" if ok else "failed").inc()
        log.info("task %s %s: %s", task_id, "done" if ok else "FAILED", detail[:200])

    async def _prune(self, prefix: bytes, keep: int = MAX_FINISHED) -> None:
        """Finished task records are history: keep the newest `keep`."""
        excess = await self.etcd.count_prefix(prefix) - keep
        if excess > 0:
            for kv in await self.etcd.get_prefix(prefix, limit=excess):  # oldest ids first
                await self.etcd.delete(kv.key)

    async def tasks(self, tenant: str, ids: list[str]) -> pb.TasksResponse:
        for t in ids:
            validate.task_id(t)
        wanted = set(ids)
        now = time.time()
        claims = {kv.key.rsplit(b"/", 1)[1].decode(): (json_dict(kv.value) or {})
                  for kv in await self.etcd.get_prefix(self._k("c", tenant))}
        # The three prefixes are read one after another: a task that finishes
        # between two reads is in both, and its later state is the one.
        found: dict[str, pb.TaskStatus] = {}
        for kind, state in (("q", pb.QUEUED), ("d", pb.DONE), ("f", pb.FAILED)):
            for kv in await self.etcd.get_prefix(self._k(kind, tenant), limit=0 if ids else MAX_TASKS_LISTED):
                task_id = kv.key.rsplit(b"/", 1)[1].decode()
                if wanted and task_id not in wanted:
                    continue
                body = json_dict(kv.value) or {}
                st = state
                worker = body.get("worker", "")
                if state == pb.QUEUED and task_id in claims:
                    st, worker = pb.RUNNING, claims[task_id].get("worker", "")
                found.pop(task_id, None)  # listed where it was last seen
                found[task_id] = pb.TaskStatus(
                    task_id=task_id, state=st, program_name=body.get("program", ""),
                    target=body.get("target", ""), worker=worker, detail=body.get("detail", ""),
                    key=body.get("key", ""), age_seconds=now - body.get("submitted", now))
        return pb.TasksResponse(tasks=found.values())

    async def counts(self, tenant: str) -> dict[str, int]:
        pending = await self.etcd.count_prefix(self._k("q", tenant))
        running = await self.etcd.count_prefix(self._k("c", tenant))
        return {"queued": max(pending - running, 0), "running": running,
                "done": await self.etcd.count_prefix(self._k("d", tenant)),
                "failed": await self.etcd.count_prefix(self._k("f", tenant))}
