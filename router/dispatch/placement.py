"""Finds the upstream leg that answers a request next: plan, probe race, fallback, retries.

Each stage returns its outcome (router/dispatch/context.py) and the context writes it into
the request's record:

- the strategy's plan (router/routing/planning.py): a probe race at T, one backend directly, or
  (the race not worth it) where the fallback's cost model computes the prompt;
- the race (router/dispatch/race.py): its first acceptor is the leg; when every probe rejects,
  `plan_fallback` (router/routing/fallback.py) picks prefill/decode over NIXL
  (router/dispatch/disagg.py) or a direct decode at T = 0;
- a failure before the first token is retried elsewhere, at most `routing.max_retries` times.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from router import errors
from router.config.schema import Config
from router.dispatch.client_errors import client_error
from router.dispatch.context import FallbackOutcome, Leg, RaceOutcome, RequestContext, fallback_direct
from router.dispatch.disagg import PrefillProtocolError, parse_prefill_response, recompute_after_failed_decode
from router.dispatch.prompt_index import PromptIndex
from router.dispatch.race import RaceResult, run_race
from router.engine.client import UpstreamClient
from router.engine.errors import CONNECT, UpstreamError
from router.engine.stream import UpstreamStream
from router.engine.wire import CHAT_PATH, decode_leg_body, message_usage, prefill_leg_body, streamed_leg_body
from router.fleet.registry import BackendRegistry, BackendState, LegTicket
from router.names import Route, RouteReason, Verdict
from router.observability import tracing
from router.routing.fallback import FallbackPlan, plan_fallback
from router.routing.planning import AsksTheIndexWhenUnsure, Plan, RouteQuery, Strategy, race_value
from router.routing.snapshot import ClusterSnapshot

# A prompt's engine is noted (`on_routed`) just before the leg carrying it opens, in the same step.
NOTED_BEFORE_SENT_S = 0.05

log = logging.getLogger("cachehit_router.dispatch")


class LegPlacer:
    """The stages that place one request's answer legs (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        registry: BackendRegistry,
        client: UpstreamClient,
        strategy: Strategy,
        prompt_index: PromptIndex | None = None,
    ):
        self.routing = config.routing
        self.timeouts = config.timeouts
        self.registry = registry
        self.client = client
        self.strategy = strategy
        # Only for a policy that reads the KV-event index.
        self.prompt_index = prompt_index if strategy.reads_index else None
        # Asked once here, not per request (a runtime protocol check walks its members).
        self.asks_when_unsure = strategy if isinstance(strategy, AsksTheIndexWhenUnsure) else None

    async def plan(self, ctx: RequestContext) -> tuple[Plan, ClusterSnapshot]:
        """The strategy's plan for `ctx` and the snapshot it was made in, the KV-event
        index's figures put on its query first (a policy that reads the index, where it
        says the lookup is worth it), recorded on the request's record."""
        snap = self.registry.snapshot()
        asks = self.asks_when_unsure
        if self.prompt_index is not None and (asks is None or asks.wants_index(ctx.query, snap)):
            ctx.query = await self.prompt_index.annotate(ctx.query, ctx.path == CHAT_PATH, ctx.body, snap, ctx.deadline)
            # The fleet as it is after the lookup: requests placed during it hold their places
            # (planned in the snapshot from before, cold prompts arriving together shared a decoder).
            snap = self.registry.snapshot()
        plan = self.strategy.plan(ctx.query, snap, frozenset(ctx.tried))
        ctx.record_plan(plan)
        return plan, snap

    # --- an accepted leg, retries included ---------------------------------------------
    async def acquire(self, ctx: RequestContext) -> Leg:
        last_error: UpstreamError | None = None
        query = ctx.query
        for attempt in range(self.routing.max_retries + 1):
            if attempt:
                ctx.record_retry(last_error.backend if last_error else "unknown")
            plan, snap = await self.plan(ctx)
            query = ctx.query
            if plan.empty:
                break
            if plan.probes:
                race = await self.race(ctx, plan)
                if race.winner is not None:
                    return self._race_won(ctx, race)
                self._raise_client_error(race.result)
                ctx.tried.update(race.failed)
                last_error = race.last_error or last_error
                fallback = self.fallback_after_race(query, race, frozenset(ctx.tried))
            elif plan.skipped_race:
                # Not worth a race: where the fallback's model says, from the strategy's expected hits.
                n = query.tokens(snap)
                fallback = plan_fallback(
                    query, snap, self.routing, n, frozenset(ctx.tried), self.strategy.expected_hits(query, n)
                )
            else:
                fallback = fallback_direct(plan)
            if fallback is None:
                break
            outcome = await self.run_fallback(ctx, fallback)
            ctx.tried.update(outcome.failed)
            if outcome.leg is not None:
                return outcome.leg
            last_error = outcome.error or last_error
        if last_error is not None:
            raise client_error(last_error, self.timeouts)
        raise errors.no_backend(query.model)

    async def acquire_after(self, ctx: RequestContext, error: UpstreamError | None) -> Leg:
        """`acquire` for a retry or a resume: when no backend is left to try, the client
        hears about the failure that made the router look (e.g. the idle timeout), not a
        generic 503."""
        try:
            return await self.acquire(ctx)
        except errors.RouterError as e:
            if error is not None and e.status == 503:
                raise client_error(error, self.timeouts) from None
            raise

    # --- the race ----------------------------------------------------------------------
    async def race(self, ctx: RequestContext, plan: Plan) -> RaceOutcome:
        """Race `plan.probes` on the context's request at the plan's threshold."""
        loop = ctx.loop
        tickets: dict[str, LegTicket] = {}
        sent = loop.time()
        with tracing.span("probe_race", **{"cachehit.probes": len(plan.probes)}):
            result = await run_race(
                plan.probes,
                self._opener(ctx.path, streamed_leg_body(ctx.body, plan.threshold), ctx.deadline, 0, tickets),
                plan.deadline_s,
                plan.deadline_per_prompt_token_s,
            )
        self._record_race(ctx, result)
        self.registry.may_have_stored(tickets.get(b) for b in result.dropped())  # they may have stored blocks
        return RaceOutcome(plan, result, tickets, sent, loop.time() - sent)

    def _race_won(self, ctx: RequestContext, race: RaceOutcome) -> Leg:
        plan, winner = race.plan, race.winner
        assert winner is not None
        self.learn_race_won(ctx.query, race)
        ctx.record_predicted(race.sent, dict(zip(plan.probes, plan.probe_ttft_s, strict=False)).get(winner.backend))
        ctx.record_placement(RouteReason.PROBE_HIT)
        ctx.record_scratch(race.sent, plan.scratch_ttft_s)
        return self._accepted(ctx, race.result, Route.PROBE_HIT, race.tickets)

    def _race_figures(
        self, query: RouteQuery, result: RaceResult
    ) -> tuple[ClusterSnapshot, float, dict[str, float], dict[str, float]]:
        """The snapshot, the prompt's length, what the strategy expects each engine to hold
        and what the rejections reported holding."""
        snap = self.registry.snapshot()
        n = result.prompt_tokens or query.tokens(snap)  # every probe silent: estimated
        reported = {o.backend: float(o.hit_tokens or 0) for o in result.by_verdict(Verdict.REJECTED)}
        return snap, n, self.strategy.expected_hits(query, n), reported

    def learn_race_won(self, query: RouteQuery, race: RaceOutcome) -> None:
        """What a won race was worth, for the decision to race (router/routing/planning.py)."""
        assert race.winner is not None
        snap, n, expected, reported = self._race_figures(query, race.result)
        self.registry.learner.observe_race(
            race_value(race.plan, snap, n, expected, race.winner.backend, None, reported), None, race.plan.placed
        )

    def fallback_after_race(self, query: RouteQuery, race: RaceOutcome, exclude: frozenset[str]) -> FallbackPlan | None:
        """Nobody accepted: where the prompt is computed, and what the race was worth. What
        each engine holds: its rejection's report, the truth, unless it may still be computing
        this prompt (the router sent it there since its oldest leg there without a first
        token: then what the prefix memory expects, if more; a window of predicted time
        missed leaders on machines slower than predicted); a silent engine: the memory."""
        snap, n, expected, reported = self._race_figures(query, race.result)
        since = {b.name: b.prefilling_since - NOTED_BEFORE_SENT_S for b in snap.backends if b.decodes and b.prefilling}
        in_flight = self.strategy.expected_hits(query, n, sent_since=since)
        hits = {**expected, **{name: max(held, in_flight.get(name, 0.0)) for name, held in reported.items()}}
        # An engine silent past the deadline is stopped or far behind: it computes the
        # prompt only if no other engine can.
        silent = {o.backend for o in race.result.by_verdict(Verdict.EXPIRED)}
        fallback = plan_fallback(query, snap, self.routing, n, exclude | silent, hits) or plan_fallback(
            query, snap, self.routing, n, exclude, hits
        )
        self.registry.learner.observe_race(
            race_value(race.plan, snap, n, expected, None, fallback.predicted_ttft_s if fallback else None, reported),
            race.waited_s,
            race.plan.placed,
        )
        return fallback

    # --- the fallback: prefill/decode or one decoder -----------------------------------
    async def run_fallback(self, ctx: RequestContext, fb: FallbackPlan) -> FallbackOutcome:
        sent = ctx.loop.time()
        failed: list[str] = []
        kv_params = None
        if fb.prefill is not None:
            # Until its decode leg has pulled the KV, the producer is where the prompt is (being)
            # computed: a request sharing its prefix follows it there (sent to the decoder, it
            # would compute the prefix again, ahead of this decode leg in that engine's queue).
            self.strategy.on_routed(ctx.query, fb.prefill)
            # The decoder's place in the load is taken now: splits placed meanwhile see it.
            wait_s = self.routing.slo_ttft_ms / 1000.0 - (ctx.loop.time() - ctx.started)
            held = self.registry.open_leg(fb.decode, kv_wait_s=wait_s) if fb.decode in self.registry.states else None
            try:
                fb, kv_params = await self._split_prefill(ctx, fb, failed)
            finally:  # the decode leg's own place is taken before _single yields
                if held is not None:
                    self.registry.close_leg(held)
        if fb.prefill is None:
            # Noted now, not at the first token: a request sharing this prompt's prefix
            # that arrives while the decoder computes it should follow it there.
            self.strategy.on_routed(ctx.query, fb.decode)
        tickets: dict[str, LegTicket] = {}
        result = await self._single(ctx, fb, kv_params, tickets)
        failures = result.by_verdict(Verdict.FAILED)
        if (
            result.winner is None
            and fb.prefill is not None
            and (result.by_verdict(Verdict.REJECTED) or (failures and recompute_after_failed_decode(failures[0].error)))
        ):
            # The guard threshold refused the decode leg, or the engine failed it: the
            # transferred cache did not arrive (lease expired, pull failed). Compute the
            # prompt there instead.
            log.warning(
                "decode on %s with the cache from %s did not start (%s); computing the prompt on %s",
                fb.decode,
                fb.prefill,
                failures[0].error if failures else "guard threshold",
                fb.decode,
            )
            fb = fb.computed_on_decoder()
            self.strategy.on_routed(ctx.query, fb.decode)
            result = await self._single(ctx, fb, None, tickets)
        if result.winner is not None:
            if fb.prefill is not None:
                self.strategy.on_routed(ctx.query, fb.decode)  # the KV is there now
            ctx.record_predicted(sent, fb.predicted_ttft_s)
            ctx.record_placement(fb.reason, fb)
            return FallbackOutcome(self._accepted(ctx, result, fb.route, tickets), failed=tuple(failed))
        self._raise_client_error(result)
        failures = result.by_verdict(Verdict.FAILED)
        return FallbackOutcome(None, failures[0].error if failures else None, (*failed, fb.decode))

    async def _split_prefill(
        self, ctx: RequestContext, fb: FallbackPlan, failed: list[str]
    ) -> tuple[FallbackPlan, dict[str, Any] | None]:
        """The split's prefill leg: its KV's parameters, or (failed) the prompt on the decoder."""
        assert fb.prefill is not None
        try:
            kv_params = await self._prefill(ctx, fb.prefill, fb.prefill_tokens)
            ctx.record_prefill(fb.prefill)
            return fb, kv_params
        except UpstreamError as e:
            self.note_failure(ctx, e)
            if e.client_fault:
                raise client_error(e, self.timeouts) from None
            failed.append(fb.prefill)
            log.warning("prefill on %s failed (%s); computing the prompt on %s instead", fb.prefill, e, fb.decode)
        except PrefillProtocolError as e:
            log.warning("prefill on %s: %s; computing the prompt on %s instead", fb.prefill, e, fb.decode)
        return fb.computed_on_decoder(), None

    async def _single(
        self, ctx: RequestContext, fb: FallbackPlan, kv_params: dict[str, Any] | None, tickets: dict[str, LegTicket]
    ) -> RaceResult:
        """The fallback's decode leg: a one-engine race (same verdict logic), bounded by its first-token timeout."""
        if fb.prefill is not None:  # a decode leg: it stores the blocks it pulls, a chain of this router's
            assert kv_params is not None
            body, tokens, known, stores = decode_leg_body(ctx.body, kv_params, fb.decode_threshold), 0, None, True
        else:
            body, tokens, stores = streamed_leg_body(ctx.body, fb.decode_threshold), fb.prefill_tokens, None
            known = ctx.query.known_hits(fb.decode, tokens)
        # Its place in the engine's load is taken before this task yields: plans made meanwhile see it.
        reg = self.registry
        held = (
            reg.open_leg(fb.decode, tokens, known_hits=known, stores_blocks=stores) if fb.decode in reg.states else None
        )
        try:
            result = await run_race(
                (fb.decode,),
                self._opener(ctx.path, body, ctx.deadline, tokens, tickets, held),
                None,
            )
        finally:
            if held is not None and tickets.get(fb.decode) is not held:
                self.registry.close_leg(held)  # its leg was never opened
        self._record_race(ctx, result, probing=False)
        return result

    async def _prefill(self, ctx: RequestContext, backend: str, tokens: int) -> dict[str, Any]:
        state = self._state(backend)
        ticket = self.registry.open_leg(backend, tokens)
        try:
            resp = await self.client.post_json(
                backend,
                state.config.url,
                ctx.path,
                prefill_leg_body(ctx.body),
                api_key=state.config.api_key,
                total_deadline=ctx.deadline,
            )
            # One token was asked for: the answer's arrival is the prefill's first token.
            self.registry.first_token(ticket)
        finally:
            self.registry.close_leg(ticket)
        self.registry.record_success(backend)
        usage = message_usage(resp)
        if usage.prompt_tokens is not None:
            held = usage.cached_tokens or 0
            self.registry.learn_first_token(ticket, usage.prompt_tokens - held, held)
        return parse_prefill_response(resp)

    def _accepted(self, ctx: RequestContext, result: RaceResult, route: str, tickets: dict[str, LegTicket]) -> Leg:
        w = result.winner
        assert w is not None
        assert w.stream is not None
        ticket = tickets.get(w.backend)
        if ticket is not None:
            self.registry.first_token(ticket)
        if route == Route.PROBE_HIT:  # a fallback was noted when it was sent (run_fallback)
            self.strategy.on_routed(ctx.query, w.backend)
        ctx.record_leg(route, w.backend)
        return Leg(
            w.backend,
            w.stream,
            w.buffered,
            route,
            ticket,
            len(ctx.query.text) if ctx.query.prompt_tokens is None else 0,
        )

    # --- bookkeeping ---------------------------------------------------------------------
    def _opener(
        self,
        path: str,
        body: dict[str, Any],
        deadline: float,
        tokens: int,
        tickets: dict[str, LegTicket],
        held: LegTicket | None = None,
    ) -> Callable[[str], Awaitable[UpstreamStream]]:
        """Opens one streamed leg per backend; each holds a LegTicket (its place in the
        engine's load) until the stream closes, kept in `tickets` by backend (`held`: the
        ticket already taken for its backend). The body is serialised once for all of them
        (a 4 MiB prompt raced on K engines: one copy, not K)."""
        encoded: list[bytes] = []

        async def open_leg(name: str) -> UpstreamStream:
            cfg = self._state(name).config
            if not encoded:
                encoded.append(orjson.dumps(body))
            own = held if held is not None and held.backend == name and not held.closed else None
            ticket = tickets[name] = own or self.registry.open_leg(name, tokens)
            try:
                return await self.client.open_stream(
                    name,
                    cfg.url,
                    path,
                    body,
                    api_key=cfg.api_key,
                    total_deadline=deadline,
                    on_close=lambda: self.registry.close_leg(ticket),
                    encoded=encoded[0],
                )
            except BaseException:
                self.registry.close_leg(ticket)
                raise

        return open_leg

    def _state(self, name: str) -> BackendState:
        """A planned backend's state; one removed from the fleet or drained since the plan
        was made fails like an engine that is gone: no new leg goes there."""
        state = self.registry.accepting(name)
        if state is None:
            raise UpstreamError(name, CONNECT, "removed from the fleet or drained")
        return state

    def _record_race(self, ctx: RequestContext, result: RaceResult, probing: bool = True) -> None:
        ctx.record_race(result, probing)
        for o in result.by_verdict(Verdict.FAILED):
            if o.error is not None:
                self.note_failure(ctx, o.error)

    def _raise_client_error(self, result: RaceResult) -> None:
        """An engine refused the request itself (4xx): every engine would."""
        if result.client_error is not None:
            raise client_error(result.client_error, self.timeouts)

    def note_failure(self, ctx: RequestContext, e: UpstreamError) -> None:
        ctx.record_failure(e)
        if e.backend_fault:
            self.registry.record_failure(e.backend, f"{e.kind}: {e.detail}")
