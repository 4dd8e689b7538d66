"""The request pipeline: one client answer from its first leg to its last, resumes included.

The planners decide (router/routing/planning.py), router/dispatch/placement.py finds the leg that answers
next (race, fallback, retries), the legs do I/O (router/dispatch/race.py, router/engine/client.py);
this module sequences them for one client answer:

1. first leg: `LegPlacer.acquire` (a probe race, a fallback, or one backend directly;
   a failure before the answer's first token is retried on another backend);
2. pump: the leg's chunks go through the `ResponseShaper` to the client; the leg's end is
   a `LegOutcome`;
3. resume: a leg that ends in `cache_threshold` after producing tokens (preempted, cache
   gone) or breaks after the first token is continued with a completion request (prompt
   ids + generated ids, remaining budget) that goes through step 1 again, at most
   `routing.max_resumes` times.
Every stage writes what happened into the request's record through its `RequestContext`
(router/dispatch/context.py); the metrics are written from that record when the request
ends. Errors the client must see are raised as `RouterError`; `emitted` on the shaper
tells the caller whether they can still become an HTTP status or must travel as a stream
event.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from router import errors
from router.admission.spec import RequestSpec
from router.answer.chunk_bytes import unary_answer_problem
from router.answer.shaper import ResponseShaper
from router.config.schema import Config
from router.dispatch.client_errors import client_error
from router.dispatch.context import Leg, LegOutcome, RequestContext, fallback_direct
from router.dispatch.placement import LegPlacer
from router.dispatch.prompt_index import PromptIndex
from router.dispatch.pump import DirectWriter, Emit, EmitRaw, pump, pump_raw
from router.dispatch.resume import resume_reason
from router.engine.client import UpstreamClient
from router.engine.errors import PROTOCOL, TOTAL_TIMEOUT, UpstreamError
from router.engine.wire import (
    CACHE_THRESHOLD,
    CHAT_PATH,
    COMPLETIONS_PATH,
    one_token_probe,
    resume_leg_body,
    unary_leg_body,
)
from router.fleet.adapters import is_adapter
from router.fleet.registry import BackendRegistry
from router.names import Route, RouteReason
from router.observability import tracing
from router.observability.record import RequestRecord
from router.routing.planning import RouteQuery, Strategy

log = logging.getLogger("cachehit_router.dispatch")


def route_query(spec: RequestSpec, adapter: bool = False, tenant: str = "") -> RouteQuery:
    """`adapter`: the model the request names is a LoRA adapter (its cache is its own)."""
    return RouteQuery(
        spec.model,
        spec.routing_text,
        salt=hash(spec.request_id) & 0xFFFF,
        prompt_tokens=None if spec.prompt_token_ids is None else len(spec.prompt_token_ids),
        token_ids=spec.prompt_token_ids,
        tenant=tenant,
        adapter=spec.model if adapter else None,
    )


def request_path(spec: RequestSpec) -> str:
    return CHAT_PATH if spec.endpoint == "chat" else COMPLETIONS_PATH


class Dispatcher:
    def __init__(
        self,
        config: Config,
        registry: BackendRegistry,
        client: UpstreamClient,
        strategy: Strategy,
        prompt_index: PromptIndex | None = None,
    ):
        self.config = config
        self.routing = config.routing
        self.timeouts = config.timeouts
        self.registry = registry
        self.client = client
        self.strategy = strategy
        self.placer = LegPlacer(config, registry, client, strategy, prompt_index)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, held: asyncio.get_running_loop() costs a getpid() each call."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _context(self, spec: RequestSpec, rec: RequestRecord, body: dict[str, Any]) -> RequestContext:
        loop = self.loop
        started = rec.dispatch_started = loop.time()
        return RequestContext(
            route_query(spec, is_adapter(self.registry, spec.model), rec.tenant),
            request_path(spec),
            body,
            started,
            started + self.timeouts.total_s,
            rec,
            loop,
        )

    # --- the answer ------------------------------------------------------------------------
    async def serve(
        self,
        spec: RequestSpec,
        shaper: ResponseShaper,
        emit: Emit,
        rec: RequestRecord,
        emit_raw: EmitRaw | None = None,
        direct: DirectWriter | None = None,
    ) -> None:
        first = ctx = self._context(spec, rec, spec.body)
        leg = await self.placer.acquire(ctx)
        answer = shaper.answer
        shaper.begin_leg(is_resume=False)
        while True:
            outcome = await (
                pump(ctx, leg, shaper, emit, self._token_gap)
                if emit_raw is None
                else pump_raw(ctx, leg, shaper, emit_raw, self._token_gap, direct)
            )
            if outcome.error is None and answer.finish_reason is None:
                # [DONE] without a finish: a broken engine (vLLM always ends a leg with a
                # finish_reason). The leg failed: retried elsewhere before the answer's first
                # token, resumed after it, and counted against the engine either way.
                detail = "the stream ended ([DONE]) without a finish_reason"
                outcome = LegOutcome(UpstreamError(leg.backend, PROTOCOL, detail))
            error = self._leg_ended(ctx, leg, outcome, answer.leg_tokens)
            if error is not None and answer.finish_reason not in (None, CACHE_THRESHOLD):
                # The engine finished the answer, then the connection broke before [DONE]:
                # nothing is missing, and a resume would generate past the real end.
                error = None
            answer_tokens = len(answer.generated_token_ids)
            if error is not None and error.kind == TOTAL_TIMEOUT:
                # The request's own deadline passed: no other leg could finish it in time.
                raise client_error(error, self.timeouts)
            reason = resume_reason(answer.finish_reason, answer.leg_tokens, error, answer_tokens)
            if reason is None and error is None:
                return
            if reason is None:
                assert error is not None  # neither a reason nor an error returned above
                # Failed before the answer's first token: the client's own request is sent
                # again elsewhere (nothing of the answer exists yet).
                if ctx.record_retry(error.backend) > self.routing.max_retries:
                    raise client_error(error, self.timeouts)
                ctx.tried.add(error.backend)
                ctx = replace(first, tried=ctx.tried)
                leg = await self.placer.acquire_after(ctx, error)
                shaper.begin_leg(is_resume=False)
                continue
            if len(rec.resumes) >= self.routing.max_resumes:
                raise errors.RouterError(
                    502,
                    f"The answer was interrupted {len(rec.resumes) + 1} times "
                    f"(last: {reason} on backend {leg.backend!r}); giving up after "
                    f"routing.max_resumes = {self.routing.max_resumes} resumes.",
                )
            if spec.max_tokens is not None and answer_tokens >= spec.max_tokens:
                if error is not None and error.kind == PROTOCOL:
                    # The engine went past the budget (or sent garbage at it): a broken
                    # answer, not a success; nothing past the budget reached the client.
                    raise client_error(error, self.timeouts)
                # Interrupted right at the budget: nothing is missing, end as the engine did.
                await emit(shaper.release_held())
                return
            prompt_ids = answer.prompt_token_ids
            if prompt_ids is None or not answer.token_ids_complete:
                raise errors.RouterError(
                    502,
                    f"Cannot resume the answer after {reason} on backend {leg.backend!r}: "
                    "the engine did not return the token ids it needs.",
                )
            ctx.record_resume(reason)
            tracing.mark_resuming()
            log.info(
                "request %s: resuming after %s on %s (%d tokens so far)",
                spec.request_id,
                reason,
                leg.backend,
                answer_tokens,
            )
            body = resume_leg_body(spec.body, spec.endpoint, prompt_ids, answer.generated_token_ids, spec.max_tokens)
            # Prefix-affinity text grows the way the prompt was given (token ids: "id," each).
            grown = (
                "".join(f"{i}," for i in answer.generated_token_ids)
                if spec.prompt_token_ids is not None
                else answer.generated_text
            )
            query = RouteQuery(
                spec.model,
                spec.routing_text + grown,
                first.query.salt,
                len(prompt_ids) + answer_tokens,
                token_ids=(*prompt_ids, *answer.generated_token_ids),
                tenant=first.query.tenant,
                adapter=first.query.adapter,
            )
            # A resume starts a new leg: only the engine that just failed is kept out. One
            # that failed an earlier leg may be healthy again (the breaker and the health
            # checks say whether it is available), and with it out too a long answer on a
            # small cluster could run out of engines; max_resumes bounds the ping-pong.
            ctx = replace(
                first,
                query=query,
                path=COMPLETIONS_PATH,
                body=body,
                tried={error.backend} if error is not None else set(),
            )
            leg = await self.placer.acquire_after(ctx, error)
            shaper.begin_leg(is_resume=True)

    def _token_gap(self, backend: str, gap_s: float) -> None:
        """A long wait for a streamed answer's next piece, judged against one engine step
        (router/fleet/stalls.py)."""
        state = self.registry.states.get(backend)
        if state is not None:
            speed = self.registry.learner.speed(backend)
            step = speed.intercept_s + speed.per_decode_s * state.scraped_decoding
            self.registry.stalls.token_gap(backend, gap_s, step, self.registry.clock(), speed.samples)

    def _leg_ended(self, ctx: RequestContext, leg: Leg, outcome: LegOutcome, tokens: int) -> UpstreamError | None:
        """The engine's health and the cost model learn how the leg ended (`tokens`: what
        it generated); its error, if any."""
        if outcome.error is not None:
            self.placer.note_failure(ctx, outcome.error)
            return outcome.error
        self.registry.record_success(leg.backend)
        if leg.ticket is None:
            return None
        self.registry.learn_decode(leg.ticket, tokens)
        if outcome.prompt_tokens is None:
            return None
        # A finished leg is one sample for the cost model (router/routing/speed_learner.py).
        learner = self.registry.learner
        if leg.route == Route.PD:
            # Its prompt arrived over NIXL: the time to its first token is the transfer's, if
            # nothing was queued ahead of it there. A decode leg that waited behind prefills
            # measures that queue: taught as the transfer, one such wait made every later
            # split look seconds slow, so none was placed and the fit never heard otherwise.
            t = leg.ticket
            if t.first_token_at is not None and t.nothing_ahead:
                learner.observe_transfer(outcome.prompt_tokens, t.first_token_at - t.sent_at)
            return None
        cached = outcome.cached_tokens or 0
        self.registry.learn_first_token(leg.ticket, outcome.prompt_tokens - cached, cached)
        learner.observe_prompt(leg.text_chars, outcome.prompt_tokens)
        return None

    # --- direct routing for non-streaming clients -----------------------------------------
    def passes_through(self, spec: RequestSpec) -> bool:
        """Direct strategies answer non-streaming clients by plain forwarding: there is no
        race to read and nothing reaches the client before the engine's whole answer, so a
        failure is retried whole elsewhere instead of resumed."""
        return not spec.stream and self.strategy.name != "probe"

    async def serve_unary(self, spec: RequestSpec, rec: RequestRecord) -> bytes:
        """The engine's own non-streaming answer, forwarded byte for byte."""
        loop = self.loop
        ctx = self._context(spec, rec, unary_leg_body(spec.body, return_token_ids=spec.return_token_ids))
        last_error: UpstreamError | None = None
        for attempt in range(self.routing.max_retries + 1):
            if attempt and last_error is not None:
                ctx.record_retry(last_error.backend)
            # The index's figures too (kv_events reads them for a forwarded request as well).
            plan, _ = await self.placer.plan(ctx)
            if plan.direct is None:
                break
            name = plan.direct
            state = self.registry.accepting(name)
            if state is None:  # removed or drained since the snapshot (the plan may wait for tokens)
                ctx.tried.add(name)
                continue
            cfg = state.config
            ticket = self.registry.open_leg(name, plan.prefill_tokens)
            ctx.record_predicted(loop.time(), plan.predicted_ttft_s)
            # A forwarded answer shows no first token: its prefill leaves the engine's queue
            # when the cost model predicted it would.
            timer = (
                loop.call_later(plan.predicted_ttft_s, self.registry.first_token, ticket)
                if plan.predicted_ttft_s is not None
                else None
            )
            raw: bytes | None = None
            try:
                raw = await self.client.post_raw(
                    name, cfg.url, ctx.path, ctx.body, api_key=cfg.api_key, total_deadline=ctx.deadline
                )
            except UpstreamError as e:
                self.placer.note_failure(ctx, e)
                if e.client_fault:
                    raise client_error(e, self.timeouts) from None
                last_error = e
                ctx.tried.add(name)
            finally:
                if timer is not None:
                    timer.cancel()
                self.registry.close_leg(ticket)
            if raw is None:
                continue
            problem = unary_answer_problem(raw, spec.max_tokens)
            if problem is not None:  # a broken engine's answer is not a success: elsewhere
                last_error = UpstreamError(name, PROTOCOL, problem)
                self.placer.note_failure(ctx, last_error)
                ctx.tried.add(name)
                continue
            self.registry.record_success(name)
            self.strategy.on_routed(ctx.query, name)
            ctx.record_leg(Route.DIRECT, name)
            ctx.record_placement(RouteReason.DIRECT, fallback_direct(plan))
            ctx.record_first_token(loop.time())
            return raw
        if last_error is not None:
            raise client_error(last_error, self.timeouts)
        raise errors.no_backend(ctx.query.model)

    # --- where a request answered whole goes ----------------------------------------------
    async def place_whole(
        self, spec: RequestSpec, rec: RequestRecord, exclude: frozenset[str]
    ) -> tuple[str, int] | None:
        """(engine, prompt tokens it will prefill) for a request one engine answers whole
        (n > 1, batches, echo, prompt_logprobs: router/server/forward.py). When the strategy races,
        the race is run on a one-token probe of the (first) prompt and its winner, which
        holds the cache and now also the rest of the prompt, serves the whole request;
        the probe's token is dropped. Nobody accepting: the fallback's decode engine (a
        prefill/decode split does not apply: the engine computes the prompt itself)."""
        loop = self.loop
        if not rec.dispatch_started:
            rec.dispatch_started = loop.time()
        now = loop.time()
        ctx = RequestContext(
            route_query(spec, is_adapter(self.registry, spec.model), rec.tenant),
            request_path(spec),
            one_token_probe(spec.body),
            rec.dispatch_started,
            now + self.timeouts.total_s,
            rec,
            loop,
            set(exclude),
        )
        query = ctx.query
        plan = self.strategy.plan(query, self.registry.snapshot(), exclude)
        if plan.empty:
            return None
        ctx.record_route(Route.DIRECT)
        if not plan.probes:
            assert plan.direct is not None
            self.strategy.on_routed(query, plan.direct)
            return plan.direct, plan.prefill_tokens
        race = await self.placer.race(ctx, plan)
        winner = race.winner
        if winner is not None:
            self.placer.learn_race_won(query, race)
            if winner.stream is not None:
                winner.stream.abort()  # its token is not the answer; the prompt is cached now
            self.strategy.on_routed(query, winner.backend)
            ctx.record_route(Route.PROBE_HIT)
            return winner.backend, 0
        client_err = race.result.client_error
        if client_err is not None:
            raise client_error(client_err, self.timeouts)
        fallback = self.placer.fallback_after_race(query, race, exclude | frozenset(race.failed))
        name = fallback.decode if fallback is not None else plan.cold
        if name is None:
            return None
        self.strategy.on_routed(query, name)
        return name, round(race.result.prompt_tokens or query.tokens(self.registry.snapshot()))
