"""The routes one end may take (compilecast/negotiate.py)."""

from __future__ import annotations

import asyncio

import pytest

from compilecast.negotiate import MAX_FAILURES, Route, RouteFailed, Routes, acarry, carry


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
        left = [r for r in (Route.LOCAL_FILE, Route.DATA_PLANE) if ladder.has(r)]
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
    ladder = routes.ladder((Route.LOCAL_FILE, Route.DATA_PLANE), key="k")
    assert carry(ladder, attempt) == "DATA_PLANE"
    assert offered == [[Route.LOCAL_FILE, Route.DATA_PLANE], [Route.DATA_PLANE]]
    assert routes.on(Route.LOCAL_FILE)  # the next transfer tries it again
    assert [f.why for f in ladder.failures] == ["moved"]


def test_a_lasting_failure_switches_the_route_off_for_the_end():
    routes = Routes([Route.LOCAL_FILE, Route.DATA_PLANE], env={})
    fails = {Route.LOCAL_FILE: RouteFailed(Route.LOCAL_FILE, "not this host", lasting=True),
             Route.DATA_PLANE: RouteFailed(Route.DATA_PLANE, "cut")}
    attempt, offered = through(fails)
    assert carry(routes.ladder((Route.LOCAL_FILE, Route.DATA_PLANE)), attempt) == "grpc"
    assert offered[-1] == []
    assert not routes.on(Route.LOCAL_FILE) and routes.on(Route.DATA_PLANE)
    later = routes.ladder((Route.LOCAL_FILE, Route.DATA_PLANE))
    assert not later.has(Route.LOCAL_FILE) and later.has(Route.DATA_PLANE)


def test_a_lasting_failure_toward_one_place_leaves_the_route_on_elsewhere():
    routes = Routes([Route.RELAY_PLANE], env={})
    ladder = routes.ladder((Route.RELAY_PLANE,))
    ladder.failed(RouteFailed(Route.RELAY_PLANE, "refused", lasting=True, where="peer-a"))
    assert not ladder.has(Route.RELAY_PLANE, "peer-a") and ladder.has(Route.RELAY_PLANE, "peer-b")
    assert not routes.on(Route.RELAY_PLANE, "peer-a") and routes.on(Route.RELAY_PLANE)


def test_the_last_rungs_error_is_the_transfers():
    routes = Routes([Route.DATA_PLANE], env={})

    def attempt(ladder):
        if ladder.has(Route.DATA_PLANE):
            raise RouteFailed(Route.DATA_PLANE, "cut")
        raise ValueError("refused over gRPC")
    with pytest.raises(ValueError, match="refused over gRPC"):
        carry(routes.ladder((Route.DATA_PLANE,)), attempt)


def test_an_asynchronous_transfer_takes_the_same_ladder():
    routes = Routes([Route.BUCKET_URL, Route.DATA_PLANE], env={})

    async def attempt(ladder):
        if ladder.has(Route.BUCKET_URL):
            raise RouteFailed(Route.BUCKET_URL, "403", lasting=True)
        return ladder.has(Route.DATA_PLANE)
    assert asyncio.run(acarry(routes.ladder((Route.BUCKET_URL, Route.DATA_PLANE)), attempt))
    assert not routes.on(Route.BUCKET_URL)


def test_a_transfer_whose_routes_keep_failing_toward_places_ends_on_the_stream():
    """Failures toward places leave the route on for the transfer; past
    MAX_FAILURES of them it takes the gRPC stream, however they fail."""
    routes = Routes([Route.RELAY_PLANE], env={})
    tries: list[int] = []

    def attempt(ladder):
        tries.append(1)
        if ladder.has(Route.RELAY_PLANE, f"peer-{len(tries)}"):
            raise RouteFailed(Route.RELAY_PLANE, "cut", where=f"peer-{len(tries)}")
        return "grpc"
    assert carry(routes.ladder((Route.RELAY_PLANE,)), attempt) == "grpc"
    assert len(tries) == MAX_FAILURES + 1 and routes.on(Route.RELAY_PLANE)
