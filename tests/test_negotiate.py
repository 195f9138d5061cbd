"""The routes one end may take (compilecast/negotiate.py)."""

from __future__ import annotations

import asyncio

import pytest

from compilecast import negotiate
from compilecast.deadline import Deadline
from compilecast.errors import Unavailable
from compilecast.negotiate import MAX_FAILURES, Route, RouteFailed, Routes, Way, acarry, carry
from compilecast.retry import Retry
from compilecast.v1 import cache_pb2 as pb


def ways(*routes: Route) -> tuple[Way, ...]:
    return tuple(Way(r) for r in routes)


def is_open(ladder, route: Route, where: str = "") -> bool:
    return ladder.open(Way(route), where)


def test_an_end_takes_only_the_routes_offered_to_it():
    routes = Routes([Route.DATA_PLANE, Route.DATA_WAIT], env={})
    assert routes.on(Route.DATA_PLANE) and routes.on(Route.DATA_WAIT)
    assert not routes.on(Route.LOCAL_FILE) and not routes.on(Route.HANDOFF)
    assert routes.taken() == ["data_plane", "data_wait"]


def test_an_operator_switches_a_route_off_by_its_variable():
    routes = Routes([Route.DATA_PLANE, Route.HANDOFF], env={"COMPILECAST_HANDOFF": "0",
                                                           "COMPILECAST_DATA_PLANE": "1"})
    assert routes.on(Route.DATA_PLANE) and not routes.on(Route.HANDOFF)


def test_a_route_that_failed_stays_off():
    routes = Routes([Route.DATA_PLANE, Route.DATA_WAIT], env={})
    assert routes.off(Route.DATA_PLANE, "cannot connect")
    assert not routes.on(Route.DATA_PLANE) and routes.on(Route.DATA_WAIT)
    assert not routes.off(Route.DATA_PLANE, "again")  # it was off already


def test_a_route_off_toward_one_peer_stays_on_toward_the_others():
    routes = Routes([Route.RELAY_PLANE], env={})
    assert routes.off(Route.RELAY_PLANE, "refused", where="10.0.0.1:7642")
    assert not routes.on(Route.RELAY_PLANE, "10.0.0.1:7642")
    assert routes.on(Route.RELAY_PLANE, "10.0.0.2:7642") and routes.on(Route.RELAY_PLANE)


def through(fails: dict[Route, RouteFailed]):
    """A transfer's attempt: the first route left that does not fail, else
    "grpc"; the routes offered each time are recorded."""
    offered: list[list[Route]] = []

    def attempt(ladder):
        left = [r for r in (Route.LOCAL_FILE, Route.DATA_PLANE) if is_open(ladder, r)]
        offered.append(left)
        for route in left:
            if route in fails:
                raise fails.pop(route)
            return route.name
        return "grpc"
    return attempt, offered


def test_a_failure_of_one_transfer_sends_it_down_its_ladder_and_leaves_the_route_on():
    routes = Routes([Route.LOCAL_FILE, Route.DATA_PLANE], env={})
    attempt, offered = through({Route.LOCAL_FILE: RouteFailed(Route.LOCAL_FILE, "moved")})
    ladder = routes.ladder(ways(Route.LOCAL_FILE, Route.DATA_PLANE), key="k")
    assert carry(ladder, attempt) == "DATA_PLANE"
    assert offered == [[Route.LOCAL_FILE, Route.DATA_PLANE], [Route.DATA_PLANE]]
    assert routes.on(Route.LOCAL_FILE)  # the next transfer tries it again
    assert [f.why for f in ladder.failures] == ["moved"]


def test_a_lasting_failure_switches_the_route_off_for_the_end():
    routes = Routes([Route.LOCAL_FILE, Route.DATA_PLANE], env={})
    fails = {Route.LOCAL_FILE: RouteFailed(Route.LOCAL_FILE, "not this host", lasting=True),
             Route.DATA_PLANE: RouteFailed(Route.DATA_PLANE, "cut")}
    attempt, offered = through(fails)
    assert carry(routes.ladder(ways(Route.LOCAL_FILE, Route.DATA_PLANE)), attempt) == "grpc"
    assert offered[-1] == []
    assert not routes.on(Route.LOCAL_FILE) and routes.on(Route.DATA_PLANE)
    later = routes.ladder(ways(Route.LOCAL_FILE, Route.DATA_PLANE))
    assert not is_open(later, Route.LOCAL_FILE) and is_open(later, Route.DATA_PLANE)


def test_a_lasting_failure_toward_one_place_leaves_the_route_on_elsewhere():
    routes = Routes([Route.RELAY_PLANE], env={})
    ladder = routes.ladder(ways(Route.RELAY_PLANE))
    ladder.failed(RouteFailed(Route.RELAY_PLANE, "refused", lasting=True, where="peer-a"))
    assert not is_open(ladder, Route.RELAY_PLANE, "peer-a") and is_open(ladder, Route.RELAY_PLANE, "peer-b")
    assert not routes.on(Route.RELAY_PLANE, "peer-a") and routes.on(Route.RELAY_PLANE)


def test_the_last_rungs_error_is_the_transfers():
    routes = Routes([Route.DATA_PLANE], env={})

    def attempt(ladder):
        if is_open(ladder, Route.DATA_PLANE):
            raise RouteFailed(Route.DATA_PLANE, "cut")
        raise ValueError("refused over gRPC")
    with pytest.raises(ValueError, match="refused over gRPC"):
        carry(routes.ladder(ways(Route.DATA_PLANE)), attempt)


def test_a_transfer_cut_off_is_tried_again_on_its_ladder_within_its_deadline():
    """One loop: a route that fails sends the transfer down its ladder; a
    cut-off (the retry policy's error: a worker restarting) is tried again
    after its pause, on the same ladder (the failed route stays off for it),
    and not once no pause fits before the deadline."""
    routes = Routes([Route.LOCAL_FILE, Route.DATA_PLANE], env={})
    policy = Retry("test", (0.5, 0.5), lambda exc: isinstance(exc, Unavailable))
    offered, paused = [], []

    def attempt(ladder):
        offered.append([r for r in (Route.LOCAL_FILE, Route.DATA_PLANE) if is_open(ladder, r)])
        if is_open(ladder, Route.LOCAL_FILE):
            raise RouteFailed(Route.LOCAL_FILE, "moved")
        if len(offered) < 4:
            raise Unavailable("the worker restarts")
        return "DATA_PLANE"
    assert carry(routes.ladder(ways(Route.LOCAL_FILE, Route.DATA_PLANE)), attempt,
                 again=policy, what="a fetch", sleep=paused.append) == "DATA_PLANE"
    assert offered == [[Route.LOCAL_FILE, Route.DATA_PLANE]] + [[Route.DATA_PLANE]] * 3
    assert paused == [0.5, 0.5]

    offered.clear()
    with pytest.raises(Unavailable):  # no pause fits before the deadline: no try again
        carry(routes.ladder(ways(Route.DATA_PLANE)), attempt, again=policy, what="a fetch",
              deadline=Deadline.after_s(0.2), sleep=paused.append)
    assert len(offered) == 1


def test_an_asynchronous_transfer_takes_the_same_ladder():
    routes = Routes([Route.BUCKET_URL, Route.DATA_PLANE], env={})

    async def attempt(ladder):
        if is_open(ladder, Route.BUCKET_URL):
            raise RouteFailed(Route.BUCKET_URL, "403", lasting=True)
        return is_open(ladder, Route.DATA_PLANE)
    assert asyncio.run(acarry(routes.ladder(ways(Route.BUCKET_URL, Route.DATA_PLANE)), attempt))
    assert not routes.on(Route.BUCKET_URL)


def test_a_transfer_whose_routes_keep_failing_toward_places_ends_on_the_stream():
    """Failures toward places leave the route on for the transfer; past
    MAX_FAILURES of them it takes the gRPC stream, however they fail."""
    routes = Routes([Route.RELAY_PLANE], env={})
    tries: list[int] = []

    def attempt(ladder):
        tries.append(1)
        if is_open(ladder, Route.RELAY_PLANE, f"peer-{len(tries)}"):
            raise RouteFailed(Route.RELAY_PLANE, "cut", where=f"peer-{len(tries)}")
        return "grpc"
    assert carry(routes.ladder(ways(Route.RELAY_PLANE)), attempt) == "grpc"
    assert len(tries) == MAX_FAILURES + 1 and routes.on(Route.RELAY_PLANE)


def test_one_table_builds_the_offer_and_the_dispatch_of_the_answer(monkeypatch):
    routes = Routes([Route.LOCAL_FILE, Route.GROWING_FILE, Route.DATA_PLANE, Route.DATA_WAIT],
                    env={})
    ladder = routes.ladder(negotiate.PROCESS_FETCH)
    offered = ladder.offer(pb.FetchRequest(key="k"))
    assert offered.accept_local_file and offered.accept_growing_file
    assert offered.accept_data_ticket and not offered.accept_url
    # The answer names the way the server took, among those offered.
    by_file = pb.FetchChunk(artifact=pb.ArtifactInfo(digest="d"), local_path="/cache/d")
    assert ladder.taken(by_file, offered).route is Route.LOCAL_FILE
    by_ticket = pb.FetchChunk(data_ticket=pb.DataTicket(token=b"t"))
    assert ladder.taken(by_ticket, offered).route is Route.DATA_PLANE
    assert ladder.taken(pb.FetchChunk(data=b"x"), offered) is None
    # A way gone down the ladder is neither offered nor taken from an answer.
    ladder.failed(RouteFailed(Route.LOCAL_FILE, "unreadable"))
    offered = ladder.offer(pb.FetchRequest(key="k"))
    assert not offered.accept_local_file and not offered.accept_growing_file
    assert ladder.taken(by_file, offered) is None
    # A way that needs another is offered only with it (a data wait needs the data plane).
    wait = routes.ladder(negotiate.WAIT)
    assert wait.offer(pb.WaitRequest(key="k")).accept_data_wait
    wait.failed(RouteFailed(Route.DATA_PLANE, "refused"))
    assert not wait.offer(pb.WaitRequest(key="k")).accept_data_wait


def test_an_upload_suits_big_publishes_only(monkeypatch):
    routes = Routes([Route.UPLOAD_TICKET, Route.HANDOFF], env={})
    ladder = routes.ladder(negotiate.PROCESS_PUBLISH)
    assert ladder.first(negotiate.UPLOAD_FROM - 1) is None
    assert ladder.first(negotiate.UPLOAD_FROM).route is Route.HANDOFF
    monkeypatch.setattr(negotiate, "UPLOAD_FROM", 0)
    assert ladder.first(0) is None and ladder.first(1).route is Route.HANDOFF
    without_tickets = Routes([Route.HANDOFF], env={}).ladder(negotiate.PROCESS_PUBLISH)
    assert without_tickets.first(1 << 30) is None  # (the upload's ticket is needed too)


class Kept(negotiate.RouteEnd):
    """A route's end as a test drives it: it says whether it suits (while
    `room` holds the bytes), and takes what it is handed."""

    def __init__(self, room: int = 1 << 40) -> None:
        self.room = room
        self.took: list[object] = []

    def suits(self, size: int) -> bool:
        return size <= self.room

    def take(self, answer: object) -> object:
        self.took.append(answer)
        return answer


def kept(route: Route, room: int = 1 << 40, also: tuple[Route, ...] = ()) -> Kept:
    """A Kept end of `route` (and of the routes it brings along, `also`)."""
    kind = type(f"Kept{route.name}", (Kept,), {"route": route, "also": also})
    return kind(room)


def test_an_end_s_routes_are_those_of_the_route_ends_it_built():
    plane = kept(Route.DATA_PLANE, also=(Route.DATA_WAIT,))
    routes = Routes.of([kept(Route.UPLOAD_TICKET), None, plane],
                       env={"COMPILECAST_DATA_WAITS": "0"})
    assert routes.taken() == ["data_plane", "upload_ticket"]  # the waits switched off
    assert plane.failed("cut", where="peer").route is Route.DATA_PLANE
    failure = plane.failed("refused", lasting=True)
    assert failure.lasting and failure.why == "refused" and failure.where == ""


def test_the_way_a_far_end_took_finds_the_route_end_that_takes_it():
    local, plane = kept(Route.LOCAL_FILE), kept(Route.DATA_PLANE, also=(Route.DATA_WAIT,))
    takers = negotiate.Ends([local, None, plane])
    routes = Routes.of([local, plane], env={})
    ladder = routes.ladder(negotiate.PROCESS_FETCH)
    offered = ladder.offer(pb.FetchRequest(key="k"))
    answer = pb.FetchChunk(artifact=pb.ArtifactInfo(digest="d"), local_path="/cache/d")
    way = ladder.taken(answer, offered)
    assert way is not None and takers.of(way).take(answer.local_path) == "/cache/d"
    assert local.took == ["/cache/d"] and plane.took == []
    # A way of a route an end brings along finds that end (a data wait: the data plane's).
    wait = routes.ladder(negotiate.WAIT)
    event = pb.WaitEvent(data_ticket=pb.DataTicket(token=b"t"))
    way = wait.taken(event, wait.offer(pb.WaitRequest(key="k")))
    assert way is not None and takers.of(way) is plane


def test_a_publish_takes_the_first_sender_whose_way_and_end_both_suit():
    big = negotiate.UPLOAD_FROM
    handoff, plane = kept(Route.HANDOFF, room=big), kept(Route.DATA_PLANE)
    senders = negotiate.Ends([handoff, plane])
    ladder = Routes.of([kept(Route.UPLOAD_TICKET), handoff, plane],
                       env={}).ladder(negotiate.PROCESS_PUBLISH)
    assert senders.first(ladder, big - 1) is None  # the ways: uploads suit big publishes only
    assert senders.first(ladder, big) is handoff
    assert senders.first(ladder, big + 1) is plane  # the handoff's end: no room for it
    ladder.failed(plane.failed("cut"))
    assert senders.first(ladder, big + 1) is None and senders.first(ladder, big) is handoff


def test_a_far_end_answers_by_a_way_only_when_offered_and_on_there():
    routes = Routes([Route.LOCAL_FILE], env={})
    offered = pb.FetchRequest(key="k", accept_local_file=True, accept_growing_file=True)
    assert routes.answers(offered, negotiate.HOST_FILE)
    assert not routes.answers(offered, negotiate.GROWING_HOST_FILE)  # off here
    assert not routes.answers(pb.FetchRequest(key="k"), negotiate.HOST_FILE)  # not offered
    routes.off(Route.LOCAL_FILE, "gone")
    assert not routes.answers(offered, negotiate.HOST_FILE)
