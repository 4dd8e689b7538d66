"""The fleet's membership (router/fleet/membership.py) as one state machine: reconciles of a
source's wanted set, admin adds and removals, requests starting and ending on a backend,
and drains ending, in any order, always settle on what the latest wanted state says.

A real `Fleet`, `BackendRegistry` and `HealthMonitor`; the monitor's upstream client answers
in memory (every engine healthy), so no socket is opened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from router.config.schema import BackendConfig, HealthConfig
from router.fleet import membership
from router.fleet.health import HealthMonitor
from router.fleet.membership import ADMIN, CONFIG, Fleet
from router.fleet.registry import BackendRegistry, LegTicket
from support.gated_engines import DOWN, GatedEngines
from support.polling import eventually

MODEL = "m"
NAMES = ("d0", "d1", "d2")
URLS = ("http://a:1", "http://b:1", "http://c:1")


class InMemoryClient:
    """The upstream client's health-check calls, answered by a healthy engine after a few
    turns of the loop (so other tasks run while a check is in flight)."""

    async def get_text(self, url: str, timeout_s: float, api_key: str = "") -> tuple[int, str]:
        for _ in range(3):
            await asyncio.sleep(0)
        if url.endswith("/v1/models"):
            return 200, '{"data": [{"id": "m"}]}'
        return 200, ""

    async def post_json(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"choices": [{"finish_reason": "cache_threshold", "text": ""}]}


def config(name: str, url: str) -> BackendConfig:
    return BackendConfig(name=name, url=url, models=(MODEL,))


def make_fleet() -> Fleet:
    registry = BackendRegistry([], HealthConfig())
    monitor = HealthMonitor(registry, InMemoryClient(), HealthConfig())  # type: ignore[arg-type]
    return Fleet(registry, monitor, on_added=lambda s: None, on_removed=lambda n: None, initial={})


def settled(fleet: Fleet) -> bool:
    """Nothing left to do but wait for requests: every task still running is the drain of
    a backend with a request in flight."""
    waiting = {t for n, t in fleet._removals.items() if fleet.registry.states[n].inflight}
    return all(t.done() or t in waiting for t in fleet._tasks)


async def settle(fleet: Fleet) -> None:
    await eventually(lambda: settled(fleet), 10.0, "the fleet to settle", interval=0.001)


@pytest.fixture(autouse=True)
def fast_idle_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership, "_IDLE_POLL_S", 0.001)


async def test_a_reload_that_flip_flops_during_a_drain_ends_on_the_latest_address() -> None:
    """d0 moves from A to B while a request runs on it, back to A, then to B again: once
    the request ends, d0 is at B (and later moves keep working)."""
    fleet = make_fleet()
    registry = fleet.registry
    a, b = config("d0", URLS[0]), config("d0", URLS[1])
    await fleet.reconcile(CONFIG, {"d0": a})
    ticket = registry.open_leg("d0")
    await fleet.reconcile(CONFIG, {"d0": b})
    assert fleet.removing("d0")
    assert fleet.successor("d0") == b
    await fleet.reconcile(CONFIG, {"d0": a})
    assert not fleet.removing("d0")
    assert fleet.successor("d0") is None
    assert not registry.states["d0"].draining
    await fleet.reconcile(CONFIG, {"d0": b})
    assert fleet.successor("d0") == b
    registry.close_leg(ticket)
    await settle(fleet)
    assert registry.states["d0"].config == b
    assert registry.states["d0"].healthy
    assert fleet.owner == {"d0": CONFIG}
    for wanted in (a, b, a):
        await fleet.reconcile(CONFIG, {"d0": wanted})
        await settle(fleet)
        assert registry.states["d0"].config == wanted
    assert not fleet._removals
    assert not fleet._successor
    await fleet.close()


async def test_an_explicit_removal_drops_a_waiting_replacement() -> None:
    fleet = make_fleet()
    registry = fleet.registry
    await fleet.reconcile(CONFIG, {"d0": config("d0", URLS[0])})
    ticket = registry.open_leg("d0")
    await fleet.reconcile(CONFIG, {"d0": config("d0", URLS[1])})
    fleet.remove("d0")  # the operator's word is the latest
    assert fleet.successor("d0") is None
    registry.close_leg(ticket)
    await settle(fleet)
    assert not registry.states
    assert not fleet.owner
    await fleet.close()


def gated_fleet() -> tuple[Fleet, GatedEngines]:
    engines = GatedEngines()
    registry = BackendRegistry([], HealthConfig())
    monitor = HealthMonitor(registry, engines, HealthConfig())  # type: ignore[arg-type]
    return Fleet(registry, monitor, on_added=lambda s: None, on_removed=lambda n: None, initial={}), engines


async def answering(engines: GatedEngines, step: Awaitable[Any]) -> Any:
    """Run `step`, every health check answering as soon as it is asked."""
    task = asyncio.ensure_future(step)

    def done() -> bool:
        engines.answer(len(engines.waiting))
        return task.done()

    await eventually(done, 10.0, "the step with its health checks", interval=0.001)
    return task.result()


async def answer_all(fleet: Fleet, engines: GatedEngines) -> None:
    def idle() -> bool:
        engines.answer(len(engines.waiting))
        return settled(fleet) and not engines.waiting

    await eventually(idle, 10.0, "every health check to answer", interval=0.001)


async def test_an_operator_drain_holds_across_a_reload_that_flip_flops() -> None:
    """Regression: a reload moving a drained backend away and back put it in rotation."""
    fleet, engines = gated_fleet()
    a, b = config("d0", URLS[0]), config("d0", URLS[1])
    await answering(engines, fleet.reconcile(CONFIG, {"d0": a}))
    ticket = fleet.registry.open_leg("d0")
    fleet.drain("d0", True)
    await fleet.reconcile(CONFIG, {"d0": b})
    await fleet.reconcile(CONFIG, {"d0": a})  # back before the drain ended
    assert fleet.registry.states["d0"].draining
    await fleet.reconcile(CONFIG, {"d0": b})
    fleet.registry.close_leg(ticket)
    await answer_all(fleet, engines)
    assert fleet.registry.states["d0"].config == b
    assert fleet.registry.states["d0"].draining, "the replacement of a drained backend is drained"
    fleet.drain("d0", False)
    assert fleet.registry.accepting("d0") is not None
    await fleet.close()


async def test_an_admin_delete_during_a_reload_is_not_undone_by_it() -> None:
    """Regression: reconcile decided each name after awaiting the previous one's health
    check, so a name the operator deleted meanwhile was added back by the older reload."""
    fleet, engines = gated_fleet()
    await answering(engines, fleet.add(config("a0", URLS[0]), ADMIN))
    reload = asyncio.ensure_future(fleet.reconcile(CONFIG, {"c0": config("c0", URLS[0]), "a0": config("a0", URLS[1])}))
    await eventually(lambda: engines.waiting, what="the reload to check c0")
    fleet.remove("a0")  # DELETE /admin/backends/a0 while the reload waits
    await answering(engines, reload)
    assert set(fleet.registry.states) == {"c0"}
    await fleet.close()


async def test_an_old_address_answering_late_does_not_make_its_replacement_healthy() -> None:
    """Regression: a health check of d0's old address that answered after d0 had moved
    marked the new address (which refuses) healthy."""
    fleet, engines = gated_fleet()
    await answering(engines, fleet.reconcile(CONFIG, {"d0": config("d0", URLS[0])}))
    check = asyncio.ensure_future(fleet.monitor.check_one("d0", with_health=True))
    await eventually(lambda: engines.waiting, what="the check to be asked")
    moving = asyncio.ensure_future(fleet.reconcile(CONFIG, {"d0": config("d0", DOWN)}))
    await eventually(lambda: fleet.registry.states["d0"].config.url == DOWN, what="the move", interval=0.001)
    await answering(engines, asyncio.gather(check, moving))
    assert not fleet.registry.states["d0"].healthy
    await fleet.close()


class FleetMachine(RuleBasedStateMachine):
    """The model: `expected`, name -> (url, owner), what the registry must hold once idle."""

    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fleet = make_fleet()
        self.registry = self.fleet.registry
        self.expected: dict[str, tuple[str, str]] = {}
        self.idle_poll = membership._IDLE_POLL_S
        membership._IDLE_POLL_S = 0.001

    def run(self, coro: Any) -> Any:
        out = self.loop.run_until_complete(coro)
        self.loop.run_until_complete(settle(self.fleet))
        return out

    def teardown(self) -> None:
        membership._IDLE_POLL_S = self.idle_poll
        self.loop.run_until_complete(self.fleet.close())
        self.loop.close()

    # --- what the sources want ----------------------------------------------------------
    def _reconcile(self, wanted: dict[str, str]) -> None:
        for name, (_, owner) in list(self.expected.items()):
            if owner == CONFIG and name not in wanted:
                del self.expected[name]
        for name, url in wanted.items():
            if self.expected.get(name, ("", CONFIG))[1] == CONFIG:
                self.expected[name] = (url, CONFIG)
        self.run(self.fleet.reconcile(CONFIG, {n: config(n, u) for n, u in wanted.items()}))

    @rule(wanted=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(URLS)))
    def reload(self, wanted: dict[str, str]) -> None:
        self._reconcile(wanted)

    @rule(name=st.sampled_from(NAMES), url=st.sampled_from(URLS))
    def admin_add(self, name: str, url: str) -> None:
        c = config(name, url)
        state = self.registry.states.get(name)
        if state is not None and not (self.fleet.removing(name) and state.config == c):
            return  # 409, as the admin API answers
        self.expected[name] = (url, ADMIN)
        self.run(self.fleet.add(c, ADMIN))

    @rule(name=st.sampled_from(NAMES))
    def admin_remove(self, name: str) -> None:
        if name not in self.registry.states:
            return  # 404
        self.expected.pop(name, None)
        self.run(self._remove(name))

    async def _remove(self, name: str) -> None:
        self.fleet.remove(name)  # DELETE /admin/backends/{name} answers at once

    # --- requests ------------------------------------------------------------------------
    @rule(target=tickets, name=st.sampled_from(NAMES))
    def request_starts(self, name: str) -> LegTicket | None:
        # A plan made just before a drain may still open its leg there.
        if name not in self.registry.states:
            return None
        return self.registry.open_leg(name)

    def _end(self, ticket: LegTicket | None) -> None:
        if ticket is None:
            return
        # The backend a request runs on is never forgotten under it.
        assert ticket.backend in self.registry.states
        self.registry.close_leg(ticket)

    @rule(ticket=consumes(tickets))
    def request_ends(self, ticket: LegTicket | None) -> None:
        """Then its drain, if any, completes."""
        self._end(ticket)
        self.run(asyncio.sleep(0))

    @rule(ticket=consumes(tickets), wanted=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(URLS)))
    def request_ends_then_reload_before_the_drain_sees_it(
        self, ticket: LegTicket | None, wanted: dict[str, str]
    ) -> None:
        self._end(ticket)
        self._reconcile(wanted)

    # --- the settled state -------------------------------------------------------------------
    @invariant()
    def registry_is_what_the_latest_wanted_state_says(self) -> None:
        fleet, states = self.fleet, self.registry.states
        for name, state in states.items():
            want = self.expected.get(name)
            url = state.config.url
            if fleet.removing(name):
                assert state.inflight, f"{name}: idle but still being removed"
                assert state.draining
                nxt = fleet.successor(name)
                if want is None:
                    assert nxt is None, f"{name}: a replacement outlived its reason"
                else:
                    assert want[0] != url, f"{name}: draining though wanted as it is"
                    assert nxt == config(name, want[0]), f"{name}: waits for {nxt}, wanted {want}"
                    assert fleet._successor[name][1] == want[1]
            else:
                assert want == (url, fleet.owner[name]), f"{name}: {url} by {fleet.owner[name]}, wanted {want}"
                assert not state.draining
                assert state.healthy
        assert set(self.expected) <= set(states), f"never added: {set(self.expected) - set(states)}"
        assert set(fleet._successor) <= set(fleet._removals)
        assert set(fleet._removals) <= set(states)
        assert set(fleet.owner) == set(states)
        assert set(fleet.monitor.model_cards) <= set(states)


FleetMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestFleetMachine = FleetMachine.TestCase
