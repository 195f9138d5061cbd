"""A pod's cold start on one stream a host and job (coordinator/jobwatch.py,
worker/daemon/jobstream.py): the job's processes that do not compile a
program wait for it on their host's stream, not with a request and a wait a
key upstream; the designated process compiles, and when it dies another
host's process is given the turn. Real etcd, coordinators and workers on
loopback, more keys than one etcd transaction holds."""

from __future__ import annotations

import concurrent.futures

import grpc

from compilecast.deadline import Deadline
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.inprocess import policy
from compilecast.worker.inprocess.client import CacheClient, ClientShell, Identity

from .conftest import eventually, sample

JOB = "train-cold"
HOSTS = 3  # besides the designated process's


def process_of(host, process_id: int) -> tuple[CacheClient, Identity]:
    me = Identity(job=JOB, process_id=process_id, designated_process=0,
                  client=f"process-{process_id}")
    return CacheClient(host.target, timeout_s=60, identity=me), me


def decided(client: CacheClient, me: Identity, key: str) -> policy.Decision:
    return policy.drive(policy.decide(policy.acquire_request(key, me), me, Deadline.after_s(120.0)),
                        ClientShell(client))


def stream_open(host) -> pb.JobPrefetch | None:
    st = CacheClient(host.target).status()
    return next((p for p in st.prefetches if p.job == JOB and p.stream_open), None)


def hosts_of_the_job(coordinator, start_worker, n: int) -> list:
    """`n` hosts (workers) of JOB, each with its job's stream open."""
    hosts = [start_worker(coordinator.cfg.listen, f"h{i}", job=JOB) for i in range(n)]
    for h in hosts:
        eventually(lambda h=h: stream_open(h), "the job's stream open", 30)
    return hosts


def waits_on_streams(hosts: list, n: int) -> None:
    """Until `hosts` hold `n` waits on their streams in all."""
    eventually(lambda: sum(p.stream_waits for h in hosts
                           for p in CacheClient(h.target).status().prefetches) == n,
               f"{n} waits on the hosts' streams", 30)


def coordinator_asked(coordinator) -> int:
    """Acquires the coordinator answered (not the hits workers report)."""
    return sum(sample(coordinator, "compilecast_coordinator_lookups_total", result=r)
               for r in ("hit", "miss"))


def test_a_cold_start_waits_on_one_stream_a_host(coordinator, start_worker):
    n = 300
    artifacts = {f"prog{i:05d}": f"executable {i}".encode() * 40 for i in range(n)}
    keys = list(artifacts)
    hosts = hosts_of_the_job(coordinator, start_worker, HOSTS + 1)
    asked_before = coordinator_asked(coordinator)

    def waiter(i: int) -> list[policy.Decision]:  # process i of the job, on host i
        c, me = process_of(hosts[i], i)
        return [decided(c, me, k) for k in keys]

    with concurrent.futures.ThreadPoolExecutor(HOSTS) as pool:
        waiting = [pool.submit(waiter, i) for i in range(1, HOSTS + 1)]
        eventually(lambda: coordinator.state.job_watches.streams == HOSTS + 1, "streams up", 30)
        designated, me = process_of(hosts[0], 0)
        for key in keys:  # JAX's rule: process 0 compiles every program
            got = decided(designated, me, key)
            assert got.kind == "COMPILE", got
            designated.publish(key, got.lease, artifacts[key], 1.0)
        answers = [w.result(timeout=300) for w in waiting]

    for got in answers:
        assert [d.kind for d in got] == ["HIT"] * n
        assert [d.data for d in got] == list(artifacts.values())  # verified bytes
    # The coordinator decided the designated process's keys alone (a miss
    # each): no host's waiting process sent a request or a wait a key.
    assert coordinator_asked(coordinator) - asked_before == n
    # Nor named the keys on its stream, save a key not claimed soon enough.
    assert coordinator.state.job_watches.named < n
    for h in hosts[1:]:
        assert sample(h, "compilecast_worker_waits_total", how="upstream") == 0
        assert sample(h, "compilecast_worker_waits_total", how="stream") > 0
        assert sample(h, "compilecast_worker_decisions_total", how="upstream") == 0


def test_when_the_designated_process_dies_a_waiting_host_is_given_the_turn(
        coordinator, start_worker):
    hosts = hosts_of_the_job(coordinator, start_worker, 3)
    designated, me = process_of(hosts[0], 0)
    keys = [f"big{i}" for i in range(3)]
    leases = {}
    for key in keys:
        got = decided(designated, me, key)
        assert got.kind == "COMPILE"
        leases[key] = got.lease
        designated.keep_lease(key, got.lease)  # compiling, as long as it lives

    def process(i: int, key: str) -> tuple[str, bytes]:
        c, me = process_of(hosts[i], i)
        got = decided(c, me, key)
        if got.kind == "COMPILE":  # its turn: it compiles and publishes
            c.publish(key, got.lease, f"compiled by {i}: {key}".encode(), 1.0)
            return "COMPILE", f"compiled by {i}: {key}".encode()
        return got.kind, got.data

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        waiting = {(i, k): pool.submit(process, i, k) for i in (1, 2) for k in keys}
        waits_on_streams(hosts[1:], 6)
        for key in keys:  # the designated process dies: its leases are given up
            designated.stop_lease(key, leases[key])
            designated.release(key, leases[key], pb.ABANDONED, "killed")
        ends = {ik: w.result(timeout=120) for ik, w in waiting.items()}
    for key in keys:  # one waiting host is given the turn; the other gets its executable
        kinds = sorted(ends[(i, key)][0] for i in (1, 2))
        assert kinds == ["COMPILE", "HIT"], (key, kinds)
        assert ends[(1, key)][1] == ends[(2, key)][1]
    assert coordinator.state.job_watches.turns == len(keys)


def test_a_failed_compile_sends_every_host_to_ask_and_each_compiles_locally(
        coordinator, start_worker):
    hosts = hosts_of_the_job(coordinator, start_worker, 3)
    designated, me = process_of(hosts[0], 0)
    got = decided(designated, me, "broken")
    assert got.kind == "COMPILE"
    designated.keep_lease("broken", got.lease)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(lambda i=i: decided(*process_of(hosts[i], i), "broken"))
                   for i in (1, 2)]
        waits_on_streams(hosts[1:], 2)
        designated.stop_lease("broken", got.lease)
        designated.release("broken", got.lease, pb.COMPILE_FAILED, "it raised")
        ends = [w.result(timeout=120) for w in waiting]
    # The stream said "ask": each host asked on its own, and was told what the
    # per-key path tells: the compile raised, compile locally.
    assert [e.kind for e in ends] == ["LOCAL", "LOCAL"], ends
    assert all("compile failed" in e.reason for e in ends), ends
    # A process that comes to the key later is not left waiting on a stream
    # that said "ask" of it: it is told the same.
    again = decided(*process_of(hosts[1], 1), "broken")
    assert again.kind == "LOCAL" and "compile failed" in again.reason, again
    for h in hosts[1:]:
        assert sample(h, "compilecast_worker_waits_total", how="upstream") >= 1


class RawStream:
    """A job stream opened as an outsider can: any token, saying it serves
    `process_id` of the job, naming `keys` after saying so (once named, the
    rank was heard)."""

    def __init__(self, target: str, token: str, job: str, process_id: int = 0,
                 keys: tuple[str, ...] = ("decoy",)) -> None:
        import queue
        import threading

        import grpc

        from compilecast.grpcutil import bearer
        from compilecast.v1 import cache_pb2_grpc as rpc

        self._out: queue.Queue = queue.Queue()
        self._channel = grpc.insecure_channel(target)
        self.heard: list[pb.JobEvents] = []
        self.opened = threading.Event()
        self.ended = threading.Event()
        self.code: grpc.StatusCode | None = None
        me = pb.Requester(job=job, process_id=process_id, designated_process=0, client="raw")
        self._out.put(pb.JobWatchRequest(job=job))
        self._out.put(pb.JobWatchRequest(requester=me))
        for i in range(0, len(keys), 1000):
            self._out.put(pb.JobWatchRequest(waits=[pb.WaitRequest(key=k, requester=me)
                                                    for k in keys[i:i + 1000]]))
        self._call = rpc.CompileCacheStub(self._channel).WatchJob(
            iter(self._out.get, None), metadata=bearer(token))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import grpc
        try:
            for events in self._call:
                self.opened.set()
                self.heard.append(events)
        except grpc.RpcError as exc:
            self.code = exc.code()
        finally:
            self.ended.set()

    def asked(self) -> list[str]:
        return [k for e in list(self.heard) for k in e.ask]

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()


def test_a_read_only_stream_that_says_it_ranks_first_never_holds_up_a_failover(
        start_coordinator, tokens_file, start_worker, tmp_path):
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    token = tmp_path / "worker.token"
    token.write_text("a-worker")
    honest = start_worker(secured.cfg.listen, "honest", job=JOB, token_file=str(token))
    eventually(lambda: stream_open(honest), "the honest host's stream open", 30)
    reader = RawStream(secured.cfg.listen, "a-read", JOB)
    try:
        # The reader's rank was heard (it named a key after saying it).
        eventually(lambda: secured.state.job_watches.named >= 1, "the reader's rank heard", 30)
        designated = CacheClient(secured.cfg.listen, timeout_s=60, token="a-pub",
                                 identity=Identity(job=JOB, process_id=0, designated_process=0,
                                                   client="designated"))
        me = designated.identity
        got = decided(designated, me, "big")
        assert got.kind == "COMPILE"
        designated.keep_lease("big", got.lease)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(lambda: decided(*process_of(honest, 1), "big"))
            waits_on_streams([honest], 1)
            designated.stop_lease("big", got.lease)  # the designated process dies
            designated.release("big", got.lease, pb.ABANDONED, "killed")
            # The honest host, which may publish, gets the turn; the reader's
            # claim to rank first held nothing (before: nothing until the
            # share-binary timeout, then LOCAL).
            end = waiter.result(timeout=300)
        assert end.kind == "COMPILE", end
        assert secured.state.job_watches.turns == 1
        assert not any(e.turns for e in reader.heard)
    finally:
        reader.close()


def test_job_stream_waits_survive_the_loss_of_the_replica_s_session_lease(coordinator):
    """A burst that keeps a replica's loop past its lease's TTL loses the
    lease its waiter records live on: the waits go on, on a new one."""
    state = coordinator.state
    lost = coordinator.lt.run(state.session.lease())
    coordinator.lt.run(state.etcd.revoke(lost))
    keys = tuple(f"nobody-claims-{i:05d}" for i in range(300))
    stream = RawStream(coordinator.cfg.listen, "", JOB, process_id=1, keys=keys)
    records = state.view.k("w", "")
    try:
        def settled():
            if stream.asked():
                return True
            return len(coordinator.lt.run(state.etcd.get_prefix(records))) >= len(keys)
        eventually(settled, "every key's waiter record written, or a key given up", 60)
        assert stream.asked() == []  # (before: "ask" for each key whose record failed)
        assert len(coordinator.lt.run(state.etcd.get_prefix(records))) == len(keys)
        assert coordinator.lt.run(state.session.lease()) != lost
    finally:
        stream.close()


def test_a_reader_cannot_take_every_stream_of_a_replica(start_coordinator, tokens_file,
                                                         monkeypatch):
    from compilecast.coordinator import jobwatch

    monkeypatch.setattr(jobwatch, "READER_STREAMS", 4)
    monkeypatch.setattr(jobwatch, "TENANT_STREAMS", 6)
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    target = secured.cfg.listen
    opened = []
    try:
        def stream(token: str, job: str = JOB) -> RawStream:
            s = RawStream(target, token, job, process_id=5, keys=())
            opened.append(s)
            eventually(lambda: s.opened.is_set() or s.ended.is_set(), "the stream answered", 30)
            return s

        readers = [stream("a-read") for _ in range(4)]
        assert all(r.opened.is_set() for r in readers)
        refused = stream("a-read")  # past its identity's bound: the true status, not INTERNAL
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The tenant's publishing hosts still get streams, up to the tenant's bound.
        assert all(stream("a-pub").opened.is_set() for _ in range(2))
        over = stream("a-pub", "another-job")
        assert over.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another tenant is untouched by what team-a holds.
        assert stream("b-pub").opened.is_set()
    finally:
        for s in opened:
            s.close()
