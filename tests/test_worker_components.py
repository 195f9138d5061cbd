"""The worker's components, each built alone from what its constructor
names (worker/daemon/wiring.py builds them together): a real host cache on
disk and real metrics; hand-written fakes only at our own interfaces (the
coordinator link's calls, a source of answers, a job's manifests)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from compilecast import validate
from compilecast.errors import Status
from compilecast.negotiate import Route
from compilecast.serving import Background
from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon.answers import Answers
from compilecast.worker.daemon.decisions import Deciders, HostDecisions, Upstream
from compilecast.worker.daemon.hits import HostHits
from compilecast.worker.daemon.hostcache import HostCache, HostCacheSource, HostCopies
from compilecast.worker.daemon.manifests import ManifestSource, StreamSource
from compilecast.worker.daemon.metrics import WorkerMetrics
from compilecast.worker.daemon.revocations import Revocations
from compilecast.worker.daemon.upstream import CoordinatorLink, Relayed
from compilecast.worker.daemon.waits import HostWaits
from compilecast.worker.daemon.wiring import WorkerParts, WorkerSettings

DATA = b"an executable" * 100


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry) -> WorkerMetrics:
    return WorkerMetrics(registry)


@pytest.fixture
def cache(tmp_path) -> HostCache:
    return HostCache(tmp_path / "hostcache", max_bytes=1 << 30)


def stored(cache: HostCache, ns: str, key: str, seconds: float = 30.0) -> pb.ArtifactInfo:
    """`key` in the host cache under namespace `ns`, its bytes stored."""
    digest = cache.store.put_bytes(DATA)
    info = pb.ArtifactInfo(key=key, digest=digest, size=len(DATA),
                           compile_time_seconds=seconds)
    cache.record(ns, info)
    return info


class FakeUp:
    """The link's calls upstream, answered by `answer(method, request)`."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, method: str):
        async def call(request, **_):
            self.calls.append((method, request))
            return self.answer(method, request)
        return call


class FakeLink:
    def __init__(self, answer=lambda method, request: None, token: str = "") -> None:
        self.up = FakeUp(answer)
        self.token = token
        self.rpc_timeout_s = 5.0
        self.address = "coordinator:1"
        self.namespaces: dict[tuple, str] = {}

    def namespace(self, md: tuple) -> str:
        return self.namespaces.get(md, "host")


class FakeManifests:
    """A host's jobs: `entries` answered from their manifests, `streamed`
    the jobs whose stream is open."""

    def __init__(self, entries: dict[str, pb.ArtifactInfo] | None = None,
                 streamed: frozenset[str] = frozenset()) -> None:
        self.entries = entries or {}
        self.streamed = streamed
        self.learned: list[tuple[str, str]] = []
        self.revoked: set[str] = set()

    def learn(self, ns: str, md: tuple, job: str) -> None:
        self.learned.append((ns, job))

    def answer(self, ns: str, key: str) -> pb.ArtifactInfo | None:
        return self.entries.get(key)

    def stream(self, ns: str, requester: pb.Requester):
        return object() if requester.job in self.streamed else None

    def revoke(self, digests: set[str]) -> None:
        self.revoked |= digests


def request(key: str, job: str = "", pid: int = 1) -> pb.AcquireRequest:
    return pb.AcquireRequest(key=key, requester=pb.Requester(
        job=job, process_id=pid, designated_process=0 if job else pid))


# -- the sources of an answer --------------------------------------------------------------

def test_the_host_cache_answers_what_it_holds_and_counts_it_saved(cache, metrics, registry):
    info = stored(cache, "host", "k1", seconds=2 * 86_400.0)
    hits = HostHits(FakeLink(), metrics)
    answers: list = [None, None]
    run(HostCacheSource(cache, hits).answer("host", (), [request("k1"), request("k2")],
                                            answers))
    assert answers[0].decision == pb.HIT and answers[0].artifact.digest == info.digest
    assert answers[1] is None  # not held: the next source's
    assert hits.unreported == [1, validate.MAX_SECONDS_PER_HIT]  # a day's at most
    assert registry.get_sample_value("compilecast_worker_lookups_total",
                                     {"result": "host_hit"}) == 1


def test_another_namespace_s_entry_is_no_hit(cache, metrics):
    stored(cache, "job-token-a", "k1")
    answers: list = [None]
    run(HostCacheSource(cache, HostHits(FakeLink(), metrics)).answer(
        "host", (), [request("k1")], answers))
    assert answers == [None]


def test_a_manifest_answers_its_keys_and_names_the_job_on_every_request(metrics):
    info = pb.ArtifactInfo(key="k2", digest="d" * 64, size=1)
    manifests = FakeManifests({"k2": info})
    source = ManifestSource(manifests, HostHits(FakeLink(), metrics), metrics, job="host-job")
    requests = [request("k1", job="train"), request("k2"), request("k3")]
    answers: list = [pb.AcquireResponse(decision=pb.HIT), None, None]
    run(source.answer("host", (), requests, answers))
    assert answers[1].artifact == info and answers[2] is None
    assert [r.manifest_job for r in requests] == ["train", "host-job", "host-job"]
    assert manifests.learned == [("host", "train"), ("host", "host-job"), ("host", "host-job")]


def test_a_job_s_waiting_process_waits_on_the_stream_and_asks_nothing(metrics):
    source = StreamSource(FakeManifests(streamed=frozenset({"train"})), metrics)
    answers: list = [None, None]
    run(source.answer("host", (), [request("k1", job="train"), request("k2", job="other")],
                      answers))
    assert answers[0].decision == pb.WAIT and answers[1] is None


class ScriptedDecider:
    def __init__(self, decide) -> None:
        self.decide = decide


class FakeDeciders:
    def __init__(self, decide) -> None:
        self.decider = ScriptedDecider(decide)

    def of(self, md: tuple) -> ScriptedDecider:
        return self.decider


def test_upstream_answers_the_rest_in_one_message_and_an_unreachable_one_means_local(metrics):
    sent: list[list[str]] = []

    async def decide(requests):
        sent.append([r.key for r in requests])
        return [pb.AcquireResponse(decision=pb.COMPILE) for _ in requests]

    hits = HostHits(FakeLink(), metrics)
    upstream = Upstream(FakeLink(), HostDecisions(), FakeDeciders(decide), hits, metrics)
    answers: list = [pb.AcquireResponse(decision=pb.HIT), None, None]
    run(upstream.answer("host", ("md",), [request("a"), request("b"), request("c")], answers))
    assert sent == [["b", "c"]] and [a.decision for a in answers] == [pb.HIT, pb.COMPILE,
                                                                      pb.COMPILE]

    async def unreachable(requests):
        raise Relayed(Status.UNAVAILABLE, "connection refused")

    down = Upstream(FakeLink(), HostDecisions(), FakeDeciders(unreachable), hits, metrics)
    answers = [None]
    run(down.answer("host", ("md",), [request("d")], answers))
    assert answers[0].decision == pb.COMPILE_LOCALLY and "unreachable" in answers[0].reason


class FixedSource:
    def __init__(self, key: str, answer: pb.AcquireResponse) -> None:
        self.key, self.answer_, self.saw = key, answer, []

    async def answer(self, ns, md, requests, answers) -> None:
        for i, r in enumerate(requests):
            if answers[i] is None:
                self.saw.append(r.key)
                if r.key == self.key:
                    answers[i] = self.answer_


def test_answers_take_each_source_in_order_and_upstream_last(metrics):
    first = FixedSource("a", pb.AcquireResponse(decision=pb.HIT))
    second = FixedSource("a", pb.AcquireResponse(decision=pb.WAIT))  # never sees "a"
    third = FixedSource("b", pb.AcquireResponse(decision=pb.WAIT))
    last = FixedSource("c", pb.AcquireResponse(decision=pb.COMPILE))
    answers = Answers((first, second, third), last, HostWaits(), metrics, jobs=None,
                      share_binary_timeout_ms=0)
    got = run(answers.decide("host", (), [request("a"), request("b"), request("c")]))
    assert [a.decision for a in got] == [pb.HIT, pb.WAIT, pb.COMPILE]
    assert (first.saw, second.saw, third.saw, last.saw) == (["a", "b", "c"], ["b", "c"],
                                                            ["b", "c"], ["c"])


def test_a_wait_is_bounded_by_the_host_s_share_binary_timeout(metrics):
    answers = Answers((), None, HostWaits(), metrics, jobs=None,
                      share_binary_timeout_ms=60_000)
    assert answers.deadline(pb.WaitRequest(key="k", timeout_ms=0)).length_s == 60.0
    assert answers.deadline(pb.WaitRequest(key="k", timeout_ms=900_000)).length_s == 60.0
    assert answers.deadline(pb.WaitRequest(key="k", timeout_ms=5_000)).length_s == 5.0
    with pytest.raises(Exception, match="key"):
        answers.deadline(pb.WaitRequest(key="../etc"))
    with pytest.raises(Exception, match="timeout_ms"):
        answers.deadline(pb.WaitRequest(key="k", timeout_ms=-1))


# -- hits, revocations, streams ---------------------------------------------------------------

def test_hit_reports_keep_what_failed_and_drop_what_was_refused(metrics, caplog):
    failing = {"code": Status.UNAVAILABLE}

    def answer(method, request):
        raise Relayed(failing["code"], "no")

    hits = HostHits(FakeLink(answer), metrics)
    hits.saved_here(pb.ArtifactInfo(compile_time_seconds=3.0))
    run(hits.report_now())
    assert hits.unreported == [1, 3.0]  # kept for the next report
    failing["code"] = Status.PERMISSION_DENIED
    with caplog.at_level(logging.WARNING):
        run(hits.report_now())
        hits.saved_here(pb.ArtifactInfo(compile_time_seconds=1.0))
        run(hits.report_now())
    assert hits.unreported == [0, 0.0]  # dropped: sent again, refused again
    assert sum("did not count" in r.message for r in caplog.records) == 1  # said once
    status = pb.StatusResponse(hits=5)
    hits.shared(pb.AcquireResponse(decision=pb.COMPILE))
    hits.add_to(status)
    assert (status.hits, status.misses) == (5, 1)


def test_a_revocation_drops_the_entry_and_the_manifests_entry(cache, metrics):
    info = stored(cache, "host", "k1")
    manifests = FakeManifests()
    revocations = Revocations(FakeLink(), cache, manifests, metrics,
                              lambda: [])
    run(revocations.drop("host", "team-a", [info.digest], "purged"))
    assert cache.lookup("host", "k1") is None and not cache.store.has(info.digest)
    assert manifests.revoked == {info.digest}


def test_deciders_keep_one_stream_a_credential_and_retire_the_oldest(monkeypatch):
    from compilecast.worker.daemon import decisions as module

    monkeypatch.setattr(module, "MAX_DECIDERS", 2)

    async def body():
        link = CoordinatorLink("127.0.0.1:1", token="", rpc_timeout_s=1.0)
        d = Deciders(link, Background(logging.getLogger("test")), gap_s=0.0)
        a, b = d.of(("a",)), d.of(("b",))
        assert d.of(("a",)) is a  # the same stream for the same credential
        d.of(("c",))  # past the bound: the least recently used ("b") retires
        assert d.credentials() == [("a",), ("c",)] and b in d.retiring
        await d.close()
        await link.close()

    run(body())


def test_host_copies_make_room_and_count_what_they_could_not_keep(cache, metrics):
    copies = HostCopies(cache, metrics)
    assert copies.uncached == 0 and copies.publishing == {}


def test_the_parts_are_built_from_values_alone(cache, metrics):
    settings = WorkerSettings("127.0.0.1:1", rpc_timeout_s=1.0, data_plane=False,
                              local_files=True, job="train", share_binary_timeout_ms=1000)

    async def body():
        parts = WorkerParts(settings, cache, metrics)
        try:
            assert parts.routes.on(Route.LOCAL_FILE) and not parts.routes.on(Route.DATA_PLANE)
            assert parts.answers.share_binary_timeout_ms == 1000
            assert parts.answers.jobs is not None and parts.answers.jobs.job == "train"
            assert parts.revocations.credentials() == []
        finally:
            await parts.close()

    run(body())


async def settled(done) -> None:
    """Until `done()`: the tasks the test started have run their turns."""
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("never settled")


class FakeUpward:
    """What a subtree asks of the stream it hangs from (jobrelay.Upward)."""

    def __init__(self) -> None:
        from compilecast.jobtree import NewsLog

        self.log = NewsLog("e1")
        self.log.add(1, b"")
        self.named: list[str] = []
        self.changes = 0
        self.published: dict[str, pb.ArtifactInfo] = {}

    def known(self, key: str) -> pb.ArtifactInfo | None:
        return self.published.get(key)

    def name(self, requests: list[pb.WaitRequest]) -> None:
        self.named += [r.key for r in requests]

    def changed(self) -> None:
        self.changes += 1


def test_a_subtree_names_a_key_once_answers_its_namers_and_turns_to_the_first_ranked():
    from compilecast.worker.daemon.jobrelay import Subtree

    async def main() -> None:
        up = FakeUpward()
        up.published["old"] = pb.ArtifactInfo(key="old", digest="a" * 64, size=1)
        tree = Subtree("job", up, fanout=2)
        inboxes: list[asyncio.Queue] = [asyncio.Queue() for _ in range(4)]
        senders: list[asyncio.Queue] = [asyncio.Queue() for _ in range(4)]

        async def requests(i: int):
            while (m := await senders[i].get()) is not None:
                yield m

        async def child(i: int, relay: str) -> None:
            first = pb.JobWatchRequest(job="job", relay_address=relay, since_epoch="e1",
                                       since_seq=1, requester=pb.Requester(
                                           job="job", process_id=10 - i, designated_process=0))
            async for m in tree.serve(first, requests(i)):
                await inboxes[i].put(pb.JobEvents.FromString(m) if isinstance(m, bytes) else m)

        tasks = [asyncio.ensure_future(child(i, f"10.0.0.{i}:1" if i < 2 else ""))
                 for i in range(3)]
        opened = [await inboxes[i].get() for i in range(3)]
        assert [o.resumed for o in opened[:2]] == [True, True]
        assert opened[2].relay_from in ("10.0.0.0:1", "10.0.0.1:1")  # full: down the tree
        await settled(lambda: tree.first() is not None and tree.first().process_id == 9)
        assert len(tree.children) == 2
        for i in (0, 1):  # both name k: it goes up once
            senders[i].put_nowait(pb.JobWatchRequest(waits=[pb.WaitRequest(
                key="k", requester=pb.Requester(job="job", process_id=10 - i))]))
        senders[0].put_nowait(pb.JobWatchRequest(waits=[pb.WaitRequest(
            key="old", requester=pb.Requester(job="job", process_id=10))]))
        assert (await inboxes[0].get()).published[0].key == "old"  # known: answered here
        await settled(lambda: up.named)
        assert up.named == ["k"]
        assert tree.turn(pb.KeyTurn(key="k"))
        turned = await inboxes[1].get()  # process 9 ranks before process 10
        assert [t.key for t in turned.turns] == ["k"] and inboxes[0].empty()
        tree.answered(pb.JobEvents(published=[pb.ArtifactInfo(key="k", digest="b" * 64)]))
        assert [(await inboxes[i].get()).published[0].key for i in (0, 1)] == ["k", "k"]
        tree.news(pb.JobEvents(seq=2, claimed=["x"]).SerializeToString(), 2)
        assert [list((await inboxes[i].get()).claimed) for i in (0, 1)] == [["x"], ["x"]]
        for s in senders:
            s.put_nowait(None)
        await asyncio.gather(*tasks)
        assert not tree.children and up.changes > 0

    run(main())
