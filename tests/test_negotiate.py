"""The routes one end may take (compilecast/negotiate.py)."""

from __future__ import annotations

from compilecast.negotiate import Route, Routes


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
