"""The fleet's membership under churn, every step interleaved: reloads (run one at a time,
as SIGHUP's handler runs them), admin adds, removals, drains and enables, health checks
that answer late, requests planned on one snapshot and sent after other steps ran, and
requests ending. The operations are tasks on a real event loop; a rule lets the loop run
a few turns, so each await inside an operation is a point where another one can come in.

After every step: no leg goes to a backend whose removal began or that an operator
drained; a request ends on the very backend it started on; a replacement waits only for
a drain that runs; a backend is healthy only if its own address answered; the registry's
in-flight counts and the per-backend gauges on /metrics are the requests open there.
Once every request ended and every operation finished: the fleet is exactly what the
latest wanted state says (names, addresses, owners, operator drains), nothing is pending,
and the gauges read 0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.config.schema import BackendConfig, HealthConfig
from router.fleet import membership
from router.fleet.health import HealthMonitor
from router.fleet.membership import ADMIN, CONFIG, Fleet
from router.fleet.registry import BackendRegistry, BackendState, LegTicket
from router.observability.metrics import RouterMetrics
from support.gated_engines import DOWN, GatedEngines

MODEL = "m"
CONFIG_NAMES = ("c0", "c1")
ADMIN_NAMES = ("a0",)
NAMES = CONFIG_NAMES + ADMIN_NAMES
UP = ("http://up-a:1", "http://up-b:1")
URLS = (*UP, DOWN)


@dataclass
class Request:
    ticket: LegTicket
    state: BackendState  # the backend it started on


def config(name: str, url: str) -> BackendConfig:
    return BackendConfig(name=name, url=url, models=(MODEL,))


class ChurnMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engines = GatedEngines()
        self.registry = BackendRegistry([], HealthConfig())
        self.monitor = HealthMonitor(self.registry, self.engines, HealthConfig())  # type: ignore[arg-type]
        self.metrics = RouterMetrics()
        self.fleet = Fleet(
            self.registry,
            self.monitor,
            on_added=lambda s: self.metrics.bind_backend(s, self.registry.learner, lambda: False),
            on_removed=self.metrics.unbind_backend,
            initial={},
        )
        self.reloads = asyncio.Lock()
        self.tasks: list[asyncio.Task[Any]] = []
        self.planned: list[str] = []  # backends requests were planned on, not sent yet
        self.requests: list[Request] = []
        # The model: name -> (url, owner) the latest wanted state asks for, and the names
        # an operator drained.
        self.want: dict[str, tuple[str, str]] = {}
        self.drained: set[str] = set()
        self.idle_poll = membership._IDLE_POLL_S
        membership._IDLE_POLL_S = 0.0

    def teardown(self) -> None:
        membership._IDLE_POLL_S = self.idle_poll
        try:
            for t in self.tasks:
                t.cancel()
            self.engines.answer(len(self.engines.waiting))
            if self.tasks:
                self.loop.run_until_complete(asyncio.wait(self.tasks))
            self.loop.run_until_complete(self.fleet.close())
        finally:
            self.loop.close()

    def _spawn(self, coro: Any) -> None:
        self.tasks.append(self.loop.create_task(coro))
        self._turns(1)

    def _in_loop(self, step: Any) -> None:
        """A synchronous step taken inside the loop (as a handler takes it: it may start tasks)."""

        async def take() -> None:
            step()

        self.loop.run_until_complete(take())

    def _turns(self, n: int) -> None:
        for _ in range(n):
            self.loop.run_until_complete(asyncio.sleep(0))

    # --- what the sources want --------------------------------------------------------------
    @rule(wanted=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(URLS), max_size=3))
    def sighup(self, wanted: dict[str, str]) -> None:
        self._spawn(self._reload(wanted))

    async def _reload(self, wanted: dict[str, str]) -> None:
        async with self.reloads:
            # From here to reconcile's first await nothing else runs: the model changes
            # at the moment the fleet starts applying this configuration.
            self._wanted_by_config(wanted)
            await self.fleet.reconcile(CONFIG, {n: config(n, u) for n, u in wanted.items()})

    def _wanted_by_config(self, wanted: dict[str, str]) -> None:
        for name, (_, owner) in list(self.want.items()):
            if owner == CONFIG and name not in wanted:
                del self.want[name]
                self.drained.discard(name)
        for name, url in wanted.items():
            if self.want.get(name, ("", CONFIG))[1] != CONFIG:
                continue  # an admin's backend: the name is taken
            if name not in self.registry.states:
                self.drained.discard(name)  # a new backend
            self.want[name] = (url, CONFIG)

    @rule(name=st.sampled_from(NAMES), url=st.sampled_from(URLS))
    def admin_add(self, name: str, url: str) -> None:
        state = self.registry.states.get(name)
        c = config(name, url)
        if state is not None and not (self.fleet.removing(name) and state.config == c):
            return  # 409, as POST /admin/backends answers
        if state is None:
            self.drained.discard(name)
        self.want[name] = (url, ADMIN)
        self._spawn(self.fleet.add(c, ADMIN))

    @rule(name=st.sampled_from(NAMES))
    def admin_delete(self, name: str) -> None:
        if name not in self.registry.states:
            return  # 404
        self.want.pop(name, None)
        self.drained.discard(name)
        self._in_loop(lambda: self.fleet.remove(name))

    @rule(name=st.sampled_from(NAMES), draining=st.booleans())
    def admin_drain(self, name: str, draining: bool) -> None:
        if name not in self.registry.states:
            return  # 404
        if not draining and self.fleet.removing(name):
            return  # 409: being removed
        (self.drained.add if draining else self.drained.discard)(name)
        self._in_loop(lambda: self.fleet.drain(name, draining))

    # --- the engines and the loop -----------------------------------------------------------
    @rule(n=st.integers(1, 4))
    def health_checks_answer(self, n: int) -> None:
        self.engines.answer(n)
        self._turns(3)

    @rule()
    def health_round(self) -> None:
        self._spawn(self.monitor.check_all(with_health=True))

    @rule(n=st.integers(1, 5))
    def loop_runs(self, n: int) -> None:
        self._turns(n)

    # --- requests ---------------------------------------------------------------------------
    @rule(name=st.sampled_from(NAMES))
    def request_planned(self, name: str) -> None:
        """A plan made on this moment's snapshot; the leg is sent after other steps."""
        view = next((b for b in self.registry.snapshot().backends if b.name == name), None)
        if view is not None and view.available:
            self.planned.append(name)

    @precondition(lambda self: self.planned)
    @rule(i=st.integers(0, 10))
    def request_sent(self, i: int) -> None:
        name = self.planned.pop(i % len(self.planned))
        state = self.registry.accepting(name)  # what the dispatcher asks before it sends a leg
        if state is None:
            return  # gone or out of rotation since the plan: the dispatcher tries elsewhere
        assert not self.fleet.removing(name), f"{name}: a leg sent after its removal began"
        assert not state.draining, f"{name}: a leg sent to a drained backend"
        self.requests.append(Request(self.registry.open_leg(name), state))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 10), first_token=st.booleans())
    def request_ends(self, i: int, first_token: bool) -> None:
        r = self.requests.pop(i % len(self.requests))
        assert self.registry.states.get(r.ticket.backend) is r.state, "a request's backend was replaced under it"
        if first_token:
            self.registry.first_token(r.ticket)
        self.registry.close_leg(r.ticket)
        self._turns(2)

    # --- after every step -------------------------------------------------------------------
    @invariant()
    def requests_run_where_they_started_and_are_counted(self) -> None:
        states = self.registry.states
        for r in self.requests:
            assert states.get(r.ticket.backend) is r.state, f"{r.ticket.backend}: replaced with a request on it"
        for name, s in states.items():
            mine = sum(1 for r in self.requests if r.state is s)
            assert s.inflight == mine, f"{name}: {s.inflight} in flight, {mine} open"
            gauge = self.metrics.registry.get_sample_value("cachehit_router_backend_inflight", {"backend": name})
            assert gauge == mine, f"{name}: in-flight gauge {gauge}, {mine} open"
            assert s.queued_tokens >= 0
            assert s.prefilling >= 0
            assert s.decoding >= 0

    @invariant()
    def nothing_pending_without_a_reason(self) -> None:
        fleet, states = self.fleet, self.registry.states
        assert set(fleet._successor) <= set(fleet._removals), "a replacement without a drain"
        assert set(fleet._removals) <= set(states)
        assert set(fleet.owner) == set(states)
        assert set(self.monitor.model_cards) <= set(states)
        for name in fleet._removals:
            assert states[name].draining, f"{name}: removing but in rotation"
        for name, s in states.items():
            if s.healthy:
                assert s.config.url != DOWN, f"{name}: healthy though its address refuses"
            if name in fleet.drained:
                assert s.draining, f"{name}: drained by the operator but in rotation"
        exposed = {labels[0] for labels in self.metrics.inflight._metrics} | {
            labels[0] for labels in self.metrics.draining._metrics
        }
        assert exposed <= set(states), f"series of departed backends: {exposed - set(states)}"

    # --- the end: everything finishes --------------------------------------------------------
    def settle(self) -> None:
        for r in self.requests:
            self.registry.close_leg(r.ticket)
        self.requests.clear()
        self.planned.clear()
        for _ in range(200):
            self.engines.answer(len(self.engines.waiting))
            self._turns(5)
            if all(t.done() for t in self.tasks) and all(t.done() for t in self.fleet._tasks):
                break
        for t in self.tasks:
            assert t.done(), f"{t!r} never finished"
            t.result()

    def check_settled(self) -> None:
        fleet, states = self.fleet, self.registry.states
        assert not fleet._removals, f"still removing: {set(fleet._removals)}"
        assert not fleet._successor, f"replacements left behind: {fleet._successor}"
        got = {n: (s.config.url, fleet.owner[n]) for n, s in states.items()}
        assert got == self.want, f"fleet {got}, wanted {self.want}"
        for name, s in states.items():
            assert s.draining == (name in self.drained), f"{name}: draining {s.draining}"
            assert s.inflight == 0
            assert s.healthy == (s.config.url != DOWN), f"{name} at {s.config.url}: healthy {s.healthy}"
            for gauge in ("cachehit_router_backend_inflight", "cachehit_router_backend_queued_prefill_tokens"):
                assert self.metrics.registry.get_sample_value(gauge, {"backend": name}) == 0, gauge

    @rule()
    def everything_finishes(self) -> None:
        self.settle()
        self.check_settled()


ChurnMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestChurnMachine = ChurnMachine.TestCase
