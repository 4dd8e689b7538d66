"""The placement stages that need no engine (router/dispatch/placement.py): where the prompt
is computed after a race nobody won, from the rejections' reports and what the router knows
is still being computed."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from router.config.parse import parse_config
from router.dispatch.context import RaceOutcome
from router.dispatch.placement import LegPlacer
from router.dispatch.race import ProbeOutcome, RaceResult
from router.fleet.registry import BackendRegistry, LegTicket
from router.names import Verdict
from router.routing.planning import Plan, RouteQuery
from router.routing.policies.probe import ProbeStrategy

if TYPE_CHECKING:
    from router.engine.client import UpstreamClient

HEAD = " ".join(f"head{i}" for i in range(2000))
PROMPT = HEAD + " " + " ".join(f"tail{i}" for i in range(10))


class Fleet:
    """Two decoders, the probe strategy, and a clock the test moves (the registry's legs and
    the prefix memory's notes read the same instants)."""

    def __init__(self) -> None:
        config = parse_config(
            {"backends": [{"name": n, "url": f"http://{n}.test", "models": ["m"]} for n in ("d0", "d1")]}
        )
        self.now = 100.0
        self.registry = BackendRegistry(config.all_backends(), config.health, clock=lambda: self.now)
        for state in self.registry.states.values():
            state.healthy = True
        self.strategy = ProbeStrategy(config.routing)
        # No leg is opened here: the upstream client is never called.
        self.placer = LegPlacer(config, self.registry, cast("UpstreamClient", None), self.strategy)

    def sent(self, prompt: str, engine: str, tokens: int) -> LegTicket:
        """The router sends `prompt` to `engine` now: noted, then its leg opened."""
        memory = self.strategy.memory
        memory.insert(memory.chunk_hashes(prompt), engine, now=self.now)
        return self.registry.open_leg(engine, tokens)

    def fallback_for(self, prompt: str, prompt_tokens: int) -> tuple[str, int]:
        """Every engine rejected `prompt`, reporting that it holds nothing of it: (where it
        is computed, the prompt tokens computed there)."""
        rejected = [
            ProbeOutcome(n, Verdict.REJECTED, 0.001, prompt_tokens=prompt_tokens, hit_tokens=0) for n in ("d0", "d1")
        ]
        race = RaceOutcome(Plan(probes=("d0", "d1")), RaceResult(None, rejected), {}, self.now, 0.001)
        fb = self.placer.fallback_after_race(RouteQuery("m", prompt), race, frozenset())
        assert fb is not None
        assert fb.prefill is None  # one engine computes it: no producer in this fleet
        return fb.decode, fb.prefill_tokens


def test_a_follower_joins_its_leader_still_computing_however_long_ago_it_was_sent() -> None:
    f = Fleet()
    f.sent(HEAD + " leader", "d0", 2001)
    f.sent(" ".join(f"other{i}" for i in range(2010)), "d1", 2010)
    f.now += 100.0  # the leader's leg still has no first token: the engine is still computing it
    engine, computed = f.fallback_for(PROMPT, 2010)
    assert engine == "d0"
    assert computed < 100  # the head is held there once the leader's prefill is through


def test_an_engine_report_is_the_truth_for_a_prompt_sent_before_its_oldest_unanswered_leg() -> None:
    f = Fleet()
    leader = f.sent(HEAD + " leader", "d0", 2001)
    f.now += 1.0
    f.registry.first_token(leader)  # through: what d0 holds now, its rejection reports
    f.registry.close_leg(leader)
    f.now += 10.0
    f.sent(" ".join(f"unrelated{i}" for i in range(50)), "d0", 50)  # d0 is computing something else
    f.now += 1.0
    engine, computed = f.fallback_for(PROMPT, 2010)
    assert computed == 2010  # d0 said it holds nothing (evicted): nobody is expected to hold it
    assert engine == "d1"  # and d0 has a prompt ahead of it
