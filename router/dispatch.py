"""Carries one request from plan to its last leg: race, fallback, retries and resume.

The planners decide (planning.py), the race and the legs do I/O (race.py, upstream.py);
this module sequences them for one client answer:

1. first leg: the strategy's plan (a probe race at T, or one backend directly); if every
   probe rejects, `plan_fallback` picks prefill/decode over NIXL or a direct decode at
   T = 0; a failure before the answer's first token is retried on another backend, at most
   `routing.max_retries` times;
2. pump: the leg's chunks go through the `ResponseShaper` to the client;
3. resume: a leg that ends in `cache_threshold` after producing tokens (preempted, cache
   gone) or breaks after the first token is continued with a completion request (prompt
   ids + generated ids, remaining budget) that goes through step 1 again, at most
   `routing.max_resumes` times.
Errors the client must see are raised as `RouterError`; `emitted` on the shaper tells the
caller whether they can still become an HTTP status or must travel as a stream event.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from . import errors, tracing
from .admission import RequestSpec
from .backends import BackendRegistry, LegTicket
from .config import Config
from .disagg import (PrefillProtocolError, decode_leg_body, parse_prefill_response, prefill_leg_body,
                     recompute_after_failed_decode)
from .legs import streamed_leg_body
from .metrics import RequestRecord, RouterMetrics
from .fallback import FallbackPlan, plan_fallback
from .names import Route
from .planning import Plan, RouteQuery, Strategy, predicted_ttft, race_value
from .race import EXPIRED, FAILED, LOST, REJECTED, RaceResult, run_race, usage_cached_tokens, usage_prompt_tokens
from .resume import resume_leg_body, resume_reason
from .shaping import MalformedChunk, ResponseShaper
from .upstream import (PROTOCOL, CONNECT, CONNECT_TIMEOUT, FIRST_TOKEN_TIMEOUT, IDLE_TIMEOUT, TOTAL_TIMEOUT,
                       UpstreamClient, UpstreamError, UpstreamStream)

log = logging.getLogger("cachehit_router.dispatch")

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

Emit = Callable[[list[dict]], Awaitable[None]]


@dataclass
class Leg:
    backend: str
    stream: UpstreamStream
    buffered: list[dict]
    route: str
    ticket: LegTicket | None = None
    text_chars: int = 0  # the routed text's length when the prompt is text (chars per token)
    # The leg's usage (its last chunk), for the cost model's speed sample.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


# What a probe for a request answered whole must not carry: one choice of one prompt and
# one token, nothing the race's stream reader does not expect.
_WHOLE_ONLY = ("n", "best_of", "use_beam_search", "echo", "prompt_logprobs", "logprobs", "top_logprobs",
               "max_completion_tokens", "min_tokens")


def one_token_probe(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in _WHOLE_ONLY}
    out["max_tokens"] = 1
    prompt = out.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        out["prompt"] = prompt[0]  # a batch races on its first prompt
    return out


def route_query(spec: RequestSpec) -> RouteQuery:
    return RouteQuery(spec.model, spec.routing_text, salt=hash(spec.request_id) & 0xFFFF,
                      prompt_tokens=None if spec.prompt_token_ids is None else len(spec.prompt_token_ids))


class Dispatcher:
    def __init__(self, config: Config, registry: BackendRegistry, client: UpstreamClient,
                 strategy: Strategy, metrics: RouterMetrics):
        self.config = config
        self.routing = config.routing
        self.timeouts = config.timeouts
        self.registry = registry
        self.client = client
        self.strategy = strategy
        self.metrics = metrics

    # --- the answer ------------------------------------------------------------------------
    async def serve(self, spec: RequestSpec, shaper: ResponseShaper, emit: Emit, rec: RequestRecord) -> None:
        loop = asyncio.get_running_loop()
        started = rec.dispatch_started = loop.time()
        deadline = started + self.timeouts.total_s
        query = route_query(spec)
        path = CHAT_PATH if spec.endpoint == "chat" else COMPLETIONS_PATH
        exclude: set[str] = set()
        leg = await self._acquire_leg(query, path, spec.body, rec, exclude, deadline)
        shaper.begin_leg(is_resume=False)
        while True:
            error: UpstreamError | None = None
            try:
                await self._pump(leg, shaper, emit, rec, started)
            except UpstreamError as e:
                error = e
                self._note_failure(e)
            if error is not None and shaper.finish_reason not in (None, "cache_threshold"):
                # The engine finished the answer, then the connection broke before [DONE]:
                # nothing is missing, and a resume would generate past the real end.
                error = None
            answer_tokens = len(shaper.generated_token_ids)
            if error is not None and error.kind == TOTAL_TIMEOUT:
                # The request's own deadline passed: no other leg could finish it in time.
                raise self._client_error(error)
            reason = resume_reason(shaper.finish_reason, shaper.leg_tokens, error, answer_tokens)
            if reason is None and error is None:
                return
            if reason is None:
                # Failed before the answer's first token: retry the request elsewhere.
                rec.retries += 1
                self.metrics.retries.labels(error.backend).inc()
                if rec.retries > self.routing.max_retries:
                    raise self._client_error(error)
                exclude.add(error.backend)
                leg = await self._acquire_after(error, query, path, spec.body, rec, exclude, deadline)
                shaper.begin_leg(is_resume=False)
                continue
            if len(rec.resumes) >= self.routing.max_resumes:
                raise errors.RouterError(
                    502, f"The answer was interrupted {len(rec.resumes) + 1} times "
                         f"(last: {reason} on backend {leg.backend!r}); giving up after "
                         f"routing.max_resumes = {self.routing.max_resumes} resumes.")
            if spec.max_tokens is not None and answer_tokens >= spec.max_tokens:
                # Interrupted right at the budget: nothing is missing, end as the engine did.
                await emit(shaper.release_held())
                return
            prompt_ids = shaper.prompt_token_ids
            if prompt_ids is None or not shaper.token_ids_complete:
                raise errors.RouterError(
                    502, f"Cannot resume the answer after {reason} on backend {leg.backend!r}: "
                         "the engine did not return the token ids it needs.")
            rec.resumes.append(reason)
            tracing.mark_resuming()
            log.info("request %s: resuming after %s on %s (%d tokens so far)",
                     spec.request_id, reason, leg.backend, answer_tokens)
            body = resume_leg_body(spec.body, spec.endpoint, prompt_ids, shaper.generated_token_ids,
                                   spec.max_tokens)
            # Prefix-affinity text grows the way the prompt was given (token ids: "id," each).
            grown = ("".join(f"{i}," for i in shaper.generated_token_ids)
                     if spec.prompt_token_ids is not None else shaper.generated_text)
            resume_query = RouteQuery(spec.model, spec.routing_text + grown, query.salt,
                                      len(prompt_ids) + answer_tokens)
            # A resume starts a new leg: only the engine that just failed is kept out. One
            # that failed an earlier leg may be healthy again (the breaker and the health
            # checks say whether it is available), and with it out too a long answer on a
            # small cluster could run out of engines; max_resumes bounds the ping-pong.
            exclude = {error.backend} if error is not None else set()
            leg = await self._acquire_after(error, resume_query, COMPLETIONS_PATH, body, rec, exclude,
                                            deadline)
            shaper.begin_leg(is_resume=True)

    # --- direct routing for non-streaming clients -----------------------------------------
    def passes_through(self, spec: RequestSpec) -> bool:
        """Direct strategies answer non-streaming clients by plain forwarding: there is no
        race to read and nothing reaches the client before the engine's whole answer, so a
        failure is retried whole elsewhere instead of resumed."""
        return not spec.stream and self.strategy.name != "probe"

    async def serve_unary(self, spec: RequestSpec, rec: RequestRecord) -> bytes:
        """The engine's own non-streaming answer, forwarded byte for byte."""
        loop = asyncio.get_running_loop()
        started = rec.dispatch_started = loop.time()
        deadline = started + self.timeouts.total_s
        query = route_query(spec)
        path = CHAT_PATH if spec.endpoint == "chat" else COMPLETIONS_PATH
        # Explicit T = 0: an engine-wide default threshold must not reject a routed request.
        body = {**spec.body, "stream": False, "cache_hit_threshold": 0.0}
        exclude: set[str] = set()
        last_error: UpstreamError | None = None
        for attempt in range(self.routing.max_retries + 1):
            if attempt and last_error is not None:
                self.metrics.retries.labels(last_error.backend).inc()
            plan = self.strategy.plan(query, self.registry.snapshot(), frozenset(exclude))
            if plan.direct is None:
                break
            name = plan.direct
            state = self.registry.states.get(name)
            if state is None:  # removed from the fleet since the snapshot
                exclude.add(name)
                continue
            cfg = state.config
            ticket = self.registry.open_leg(name, plan.prefill_tokens)
            self._predicted(rec, loop.time(), plan.predicted_ttft_s)
            # A forwarded answer shows no first token: its prefill leaves the engine's queue
            # when the cost model predicted it would.
            timer = (loop.call_later(plan.predicted_ttft_s, self.registry.first_token, ticket)
                     if plan.predicted_ttft_s is not None else None)
            try:
                raw = await self.client.post_raw(name, cfg.url, path, body, api_key=cfg.api_key,
                                                 total_deadline=deadline)
            except UpstreamError as e:
                self._note_failure(e)
                if e.client_fault:
                    raise self._client_error(e) from None
                last_error = e
                exclude.add(name)
                continue
            finally:
                if timer is not None:
                    timer.cancel()
                self.registry.close_leg(ticket)
            self.registry.record_success(name)
            self.strategy.on_routed(query, name)
            rec.route, rec.winner = Route.DIRECT, name
            rec.legs.append(f"{Route.DIRECT}:{name}")
            rec.retries = attempt
            rec.ttft_s = loop.time() - started
            return raw
        if last_error is not None:
            raise self._client_error(last_error)
        raise errors.no_backend(query.model)

    # --- where a request answered whole goes ----------------------------------------------
    async def place_whole(self, spec: RequestSpec, rec: RequestRecord,
                          exclude: frozenset[str]) -> tuple[str, int] | None:
        """(engine, prompt tokens it will prefill) for a request one engine answers whole
        (n > 1, batches, echo, prompt_logprobs: router/forward.py). When the strategy races,
        the race is run on a one-token probe of the (first) prompt and its winner, which
        holds the cache and now also the rest of the prompt, serves the whole request;
        the probe's token is dropped. Nobody accepting: the fallback's decode engine (a
        prefill/decode split does not apply: the engine computes the prompt itself)."""
        loop = asyncio.get_running_loop()
        if not rec.dispatch_started:
            rec.dispatch_started = loop.time()
        query = route_query(spec)
        plan = self.strategy.plan(query, self.registry.snapshot(), exclude)
        if plan.empty:
            return None
        rec.route = Route.DIRECT
        if not plan.probes:
            assert plan.direct is not None
            self.strategy.on_routed(query, plan.direct)
            return plan.direct, plan.prefill_tokens
        path = CHAT_PATH if spec.endpoint == "chat" else COMPLETIONS_PATH
        tickets: dict[str, LegTicket] = {}
        sent = loop.time()
        with tracing.span("probe_race", **{"cachehit.probes": len(plan.probes)}):
            result = await run_race(
                plan.probes, self._opener(path, streamed_leg_body(one_token_probe(spec.body), plan.threshold),
                                          sent + self.timeouts.total_s, 0, tickets),
                plan.deadline_s, plan.deadline_per_prompt_token_s)
        self._account_race(result, rec)
        winner = result.winner
        if winner is not None:
            self._race_finished(query, plan, result, None)
            if winner.stream is not None:
                winner.stream.abort()  # its token is not the answer; the prompt is cached now
            self.strategy.on_routed(query, winner.backend)
            rec.route = Route.PROBE_HIT
            return winner.backend, 0
        client_err = result.client_error
        if client_err is not None:
            raise self._client_error(client_err)
        failed = frozenset(o.backend for o in result.by_verdict(FAILED))
        fallback = self._race_finished(query, plan, result, exclude | failed, loop.time() - sent)
        name = fallback.decode if fallback is not None else plan.cold
        if name is None:
            return None
        self.strategy.on_routed(query, name)
        return name, round(result.prompt_tokens or query.tokens(self.registry.snapshot()))

    async def _pump(self, leg: Leg, shaper: ResponseShaper, emit: Emit, rec: RequestRecord,
                    started: float) -> None:
        stream = leg.stream
        loop = asyncio.get_running_loop()
        try:
            chunks = leg.buffered or await stream.next_chunks()
            leg.buffered = []
            while chunks:
                # Everything already received goes to the client in one write.
                batch: list[dict] = []
                bad: MalformedChunk | None = None
                for chunk in chunks:
                    if chunk.get("usage"):
                        leg.prompt_tokens = usage_prompt_tokens(chunk)
                        leg.cached_tokens = usage_cached_tokens(chunk)
                    try:
                        batch += shaper.shape(chunk)
                    except MalformedChunk as e:
                        bad = e
                        break
                    if rec.ttft_s is None and shaper.first_token_seen:
                        rec.ttft_s = loop.time() - started
                if batch:
                    await emit(batch)
                if bad is not None:
                    raise UpstreamError(leg.backend, PROTOCOL, f"unreadable chunk: {bad}") from None
                chunks = await stream.next_chunks()
        except BaseException:
            stream.abort()
            raise
        stream.finish()
        self.registry.record_success(leg.backend)
        self._learn(leg)

    def _learn(self, leg: Leg) -> None:
        """A finished leg is one sample for the cost model (router/speed_learner.py)."""
        if leg.ticket is None or leg.prompt_tokens is None:
            return
        learner = self.registry.learner
        if leg.route == Route.PD:
            # Its prompt arrived over NIXL: the time to its first token is the transfer's.
            t = leg.ticket
            if t.first_token_at is not None:
                learner.observe_transfer(leg.prompt_tokens, t.first_token_at - t.sent_at)
            return
        self.registry.learn_first_token(leg.ticket, leg.prompt_tokens - (leg.cached_tokens or 0),
                                        leg.cached_tokens or 0)
        learner.observe_prompt(leg.text_chars, leg.prompt_tokens)

    async def _acquire_after(self, error: UpstreamError | None, *args) -> Leg:
        """`_acquire_leg` for a retry or a resume: when no backend is left to try, the
        client hears about the failure that made the router look (e.g. the idle timeout),
        not a generic 503."""
        try:
            return await self._acquire_leg(*args)
        except errors.RouterError as e:
            if error is not None and e.status == 503:
                raise self._client_error(error) from None
            raise

    # --- getting an accepted leg -------------------------------------------------------------
    async def _acquire_leg(self, query: RouteQuery, path: str, body: dict, rec: RequestRecord,
                           exclude: set[str], deadline: float) -> Leg:
        last_error: UpstreamError | None = None
        loop = asyncio.get_running_loop()
        for attempt in range(self.routing.max_retries + 1):
            if attempt:
                rec.retries += 1
                self.metrics.retries.labels(last_error.backend if last_error else "unknown").inc()
            snap = self.registry.snapshot()
            plan = self.strategy.plan(query, snap, frozenset(exclude))
            if plan.empty:
                break
            if plan.probes:
                tickets: dict[str, LegTicket] = {}
                sent = loop.time()
                with tracing.span("probe_race", **{"cachehit.probes": len(plan.probes)}):
                    result = await run_race(
                        plan.probes, self._opener(path, streamed_leg_body(body, plan.threshold), deadline,
                                                  0, tickets),
                        plan.deadline_s, plan.deadline_per_prompt_token_s)
                self._account_race(result, rec)
                if result.winner is not None:
                    self._race_finished(query, plan, result, None)
                    self._predicted(rec, sent, dict(zip(plan.probes, plan.probe_ttft_s)).get(result.winner.backend))
                    if plan.scratch_ttft_s is not None and rec.scratch_ttft_s is None:
                        rec.scratch_ttft_s = sent - rec.dispatch_started + plan.scratch_ttft_s
                    return self._won(query, result, Route.PROBE_HIT, rec, tickets)
                client_err = result.client_error
                if client_err is not None:
                    raise self._client_error(client_err)
                for o in result.by_verdict(FAILED):
                    exclude.add(o.backend)
                    last_error = o.error
                fallback = self._race_finished(query, plan, result, frozenset(exclude), loop.time() - sent)
            elif plan.skipped_race:
                # Not worth a race: computed where the fallback's model says (which may be
                # a split), with what the strategy expects each engine to hold.
                n = query.tokens(snap)
                fallback = plan_fallback(query, snap, self.routing, n, frozenset(exclude),
                                         self.strategy.expected_hits(query, n))
            else:
                assert plan.direct is not None
                fallback = FallbackPlan(decode=plan.direct, prefill=None, decode_threshold=0.0,
                                        prefill_tokens=plan.prefill_tokens, predicted_ttft_s=plan.predicted_ttft_s)
            if fallback is None:
                break
            leg, err = await self._run_fallback(fallback, query, path, body, rec, exclude, deadline)
            if leg is not None:
                return leg
            last_error = err or last_error
        if last_error is not None:
            raise self._client_error(last_error)
        raise errors.no_backend(query.model)

    def _race_finished(self, query: RouteQuery, plan: Plan, result: RaceResult,
                       exclude: frozenset[str] | None, waited_s: float | None = None) -> FallbackPlan | None:
        """After a race: what it was worth (for the decision to race), and when nobody
        accepted (`exclude` given), where the prompt is computed.

        What each engine holds: its rejection's report, which is the truth, unless the
        engine may still be computing this prompt (the router sent it there recently and
        has a leg there before its first token: then what the prefix memory expects, if
        more); engines that did not report: the memory."""
        snap = self.registry.snapshot()
        n = result.prompt_tokens or query.tokens(snap)  # every probe silent: estimated
        expected = self.strategy.expected_hits(query, n)
        reported = {o.backend: float(o.hit_tokens or 0) for o in result.by_verdict(REJECTED)}
        learner = self.registry.learner
        if exclude is None:
            assert result.winner is not None
            learner.observe_race(race_value(plan, snap, n, expected, result.winner.backend, None, reported), None,
                                 plan.placed)
            return None
        decoders = [b for b in snap.backends if b.decodes]
        recent = 2.0 * max((predicted_ttft(b, n) for b in decoders), default=0.0)
        in_flight = self.strategy.expected_hits(query, n, sent_within_s=recent)
        hits = {name: held for name, held in expected.items() if name not in reported}
        for name, held in reported.items():
            view = snap.get(name)
            hits[name] = max(held, in_flight.get(name, 0.0)) if view is not None and view.prefilling else held
        # An engine silent past the deadline is stopped or far behind: it computes the
        # prompt only if no other engine can.
        silent = {o.backend for o in result.by_verdict(EXPIRED)}
        fallback = (plan_fallback(query, snap, self.routing, n, exclude | silent, hits)
                    or plan_fallback(query, snap, self.routing, n, exclude, hits))
        learner.observe_race(race_value(plan, snap, n, expected, None,
                                        fallback.predicted_ttft_s if fallback else None, reported), waited_s,
                             plan.placed)
        return fallback

    @staticmethod
    def _predicted(rec: RequestRecord, sent: float, predicted_s: float | None) -> None:
        """The cost model's prediction of the answer's time to first token, for the log:
        the time the request had spent when its first-token leg was sent, plus the model's
        prediction for that leg."""
        if predicted_s is not None and rec.predicted_ttft_s is None:
            rec.predicted_ttft_s = sent - rec.dispatch_started + predicted_s

    async def _run_fallback(self, fb: FallbackPlan, query: RouteQuery, path: str, body: dict,
                            rec: RequestRecord, exclude: set[str],
                            deadline: float) -> tuple[Leg | None, UpstreamError | None]:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        kv_params = None
        if fb.prefill is not None:
            try:
                kv_params = await self._prefill(fb.prefill, path, body, deadline, fb.prefill_tokens)
                rec.prefill = fb.prefill
            except UpstreamError as e:
                self._note_failure(e)
                if e.client_fault:
                    raise self._client_error(e) from None
                exclude.add(fb.prefill)
                log.warning("prefill on %s failed (%s); computing the prompt on %s instead",
                            fb.prefill, e, fb.decode)
            except PrefillProtocolError as e:
                log.warning("prefill on %s: %s; computing the prompt on %s instead", fb.prefill, e, fb.decode)
        if kv_params is not None:
            leg_body, route, tokens = decode_leg_body(body, kv_params, fb.decode_threshold), Route.PD, 0
        else:
            leg_body, route, tokens = streamed_leg_body(body, 0.0), Route.DIRECT, fb.prefill_tokens
        # Noted now, not at the first token: a request sharing this prompt's prefix that
        # arrives while the decoder computes it should follow it there.
        self.strategy.on_routed(query, fb.decode)
        tickets: dict[str, LegTicket] = {}
        result = await self._single(fb.decode, path, leg_body, rec, deadline, tokens, tickets)
        failed = result.by_verdict(FAILED)
        if result.winner is None and kv_params is not None and (
                result.by_verdict(REJECTED)
                or (failed and recompute_after_failed_decode(failed[0].error))):
            # The guard threshold refused the decode leg, or the engine failed it: the
            # transferred cache did not arrive (lease expired, pull failed). Compute the
            # prompt there instead.
            log.warning("decode on %s with the cache from %s did not start (%s); computing the "
                        "prompt on %s", fb.decode, fb.prefill,
                        failed[0].error if failed else "guard threshold", fb.decode)
            route = Route.DIRECT
            result = await self._single(fb.decode, path, streamed_leg_body(body, 0.0), rec, deadline,
                                        fb.prefill_tokens, tickets)
        if result.winner is not None:
            self._predicted(rec, sent, fb.predicted_ttft_s)
            return self._won(query, result, route, rec, tickets), None
        client_err = result.client_error
        if client_err is not None:
            raise self._client_error(client_err)
        exclude.add(fb.decode)
        failed = result.by_verdict(FAILED)
        return None, failed[0].error if failed else None

    async def _single(self, backend: str, path: str, body: dict, rec: RequestRecord,
                      deadline: float, tokens: int, tickets: dict[str, LegTicket]) -> RaceResult:
        # A one-engine race: same verdict logic; the leg's own first-token timeout bounds it.
        result = await run_race((backend,), self._opener(path, body, deadline, tokens, tickets),
                                self.timeouts.first_token_s + 1.0)
        self._account_race(result, rec, probing=False)
        return result

    async def _prefill(self, backend: str, path: str, body: dict, deadline: float, tokens: int) -> dict:
        state = self._state(backend)
        ticket = self.registry.open_leg(backend, tokens)
        try:
            resp = await self.client.post_json(backend, state.config.url, path, prefill_leg_body(body),
                                               api_key=state.config.api_key, total_deadline=deadline)
            # One token was asked for: the answer's arrival is the prefill's first token.
            self.registry.first_token(ticket)
        finally:
            self.registry.close_leg(ticket)
        self.registry.record_success(backend)
        prompt = usage_prompt_tokens(resp)
        if prompt is not None:
            held = usage_cached_tokens(resp) or 0
            self.registry.learn_first_token(ticket, prompt - held, held)
        return parse_prefill_response(resp)

    def _won(self, query: RouteQuery, result: RaceResult, route: str, rec: RequestRecord,
             tickets: dict[str, LegTicket]) -> Leg:
        w = result.winner
        assert w is not None and w.stream is not None
        ticket = tickets.get(w.backend)
        if ticket is not None:
            self.registry.first_token(ticket)
        if route == Route.PROBE_HIT:  # a fallback was noted when it was sent (_run_fallback)
            self.strategy.on_routed(query, w.backend)
        if not rec.route:  # route and winner describe where the answer was first placed
            rec.route = route
            rec.winner = w.backend
        rec.legs.append(f"{route}:{w.backend}")
        return Leg(w.backend, w.stream, w.buffered, route, ticket,
                   len(query.text) if query.prompt_tokens is None else 0)

    # --- bookkeeping ---------------------------------------------------------------------------
    def _opener(self, path: str, body: dict, deadline: float, tokens: int,
                tickets: dict[str, LegTicket]):
        """Opens one streamed leg per backend; each holds a LegTicket (its place in the
        engine's load) until the stream closes, kept in `tickets` by backend."""
        async def open_leg(name: str) -> UpstreamStream:
            cfg = self._state(name).config
            ticket = tickets[name] = self.registry.open_leg(name, tokens)
            try:
                return await self.client.open_stream(name, cfg.url, path, body, api_key=cfg.api_key,
                                                     total_deadline=deadline,
                                                     on_close=lambda: self.registry.close_leg(ticket))
            except BaseException:
                self.registry.close_leg(ticket)
                raise
        return open_leg

    def _state(self, name: str):
        """A planned backend's state; one removed from the fleet since the plan was made
        (its drain finished meanwhile) fails like an engine that is gone."""
        state = self.registry.states.get(name)
        if state is None:
            raise UpstreamError(name, CONNECT, "removed from the fleet")
        return state

    def _account_race(self, result: RaceResult, rec: RequestRecord, probing: bool = True) -> None:
        m = self.metrics
        for o in result.outcomes:
            if probing:
                rec.probes += 1
            m.probe_latency.labels(o.verdict).observe(o.latency_s)
            if o.verdict == REJECTED:
                rec.rejections += 1
                if o.hit_tokens is not None:
                    rec.rejected_hits[o.backend] = o.hit_tokens
                m.probe_rejections.labels(o.backend).inc()
            elif o.verdict == LOST:
                rec.losers += 1
                rec.loser_tokens += o.tokens_seen
                m.probe_losers.labels(o.backend).inc()
                m.probe_loser_tokens.labels(o.backend).inc(o.tokens_seen)
            elif o.verdict == EXPIRED:
                rec.expired += 1
                m.probe_deadline_expiries.labels(o.backend).inc()
            elif o.verdict == FAILED and o.error is not None:
                self._note_failure(o.error)
        if result.prompt_tokens is not None and rec.prompt_tokens is None:
            rec.prompt_tokens = result.prompt_tokens

    def _note_failure(self, e: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(e.backend, e.kind).inc()
        if e.backend_fault:
            self.registry.record_failure(e.backend, f"{e.kind}: {e.detail}")

    def _client_error(self, e: UpstreamError) -> errors.RouterError:
        if e.client_fault:
            return errors.from_upstream_body(e.status or 400, e.body or b"")
        if e.kind == FIRST_TOKEN_TIMEOUT:
            return errors.upstream_timeout(e.backend, "first token", self.timeouts.first_token_s)
        if e.kind == IDLE_TIMEOUT:
            return errors.upstream_timeout(e.backend, "next chunk", self.timeouts.idle_s)
        if e.kind == TOTAL_TIMEOUT:
            return errors.upstream_timeout(e.backend, "whole answer", self.timeouts.total_s)
        if e.kind == CONNECT_TIMEOUT:
            return errors.upstream_timeout(e.backend, "connection", self.timeouts.connect_s)
        if e.kind == CONNECT:
            return errors.RouterError(502, f"Cannot reach upstream engine {e.backend!r}: {e.detail}")
        return errors.upstream_failed(e.backend, f"{e.kind}: {e.detail}")
