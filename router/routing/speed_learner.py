"""Learning the cost model's numbers online from what the router observes.

The cost model (router/routing/costmodel.py) needs each engine's speed, the KV transfer's speed,
how many characters a prompt token is, and what a probe rejection costs. None of these is
configured per workload: each starts at a prior and follows the measurements:

- engine speed: every leg that produced a first token with nothing queued ahead of it is
  one sample, (tokens it lacked, decoding sequences then) -> seconds to its first token
  (router/fleet/legs.py says why a queued leg is not); a prompt of several prefill chunks
  counts with it the tokens of prompts sent behind it that shared its last step. A
  per-engine recursive least-squares fit with exponential forgetting (`OnlineLinear`,
  router/routing/online_fit.py), robust to outliers (residuals clipped at a few times
  their running size: a preemption or a stall must not teach the model that every token
  is slow).
  Engines of a fleet are usually alike, so every sample also feeds one fleet-wide fit; an
  engine with fewer than `OWN_FIT_SAMPLES` samples of its own is predicted by the fleet's
  (an engine judged by the prior while its peers are measured would be wrongly skipped or
  wrongly chosen), and its own fit starts from the fleet's; its per-token cost stays within
  `OWN_FIT_SPREAD` of the fleet's. An engine configured with its
  own speed (`[[backends]] prefill_tokens_per_s`: other hardware) starts from that instead.
  The fleet fit starts at the routing prior.
- transfer: decode legs that pulled their KV, (prompt tokens) -> seconds to first token.
- decode step (`ItlSpeed`): every leg that produced more than one token is a sample,
  (mean decoding sequences over its life) -> its mean gap between tokens, less the stall
  of the prefills its engine computed meanwhile (their tokens times the engine's per-token
  prefill cost, over the leg's gaps: `b` explains those). Fitted per engine like the
  speed, pooled over the fleet until an engine has `OWN_FIT_SAMPLES` of its own.
- characters per token and the mean prompt length: from the engines' usage reports.
- what a held token costs (`EngineSpeed.held_per_token_s`): an engine with a CPU tier
  (vLLM's OffloadingConnector) loads part of its hits from host memory before the request
  runs. Its scraped counters say how long those loads took (`vllm:kv_offload_load_time`)
  and how many hit tokens came from each tier (`vllm:prompt_tokens_cached_by_source`:
  device, host); between two scrapes, load seconds / host tokens is the cost of a CPU hit
  token and host / (device + host) the share of hits it applies to, both averaged over
  recent scrapes. A GPU-only engine's held tokens cost nothing.
- what a race is worth: the share of a prompt's prefill time racing saved over going
  straight to the cold choice (`race_saving_share`, judged after each race with what the
  engines reported), and what waiting for the verdicts cost when nobody accepted
  (`race_wait_s`). The probe strategy races when the one outweighs the other.

Learning is per router replica: replicas learn the same engines from their own samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.config.schema import RoutingConfig
from router.routing.costmodel import MIN_PER_TOKEN_S, EngineSpeed, ItlSpeed, TransferSpeed
from router.routing.online_fit import OnlineLinear

# Samples an engine needs before its own fit replaces the fleet's: three coefficients from
# samples that scatter by hundreds of milliseconds under load need a couple of dozen.
OWN_FIT_SAMPLES = 20
# How far an engine's own per-token cost may stray from the fleet's (engines of one fleet
# differ by a hardware generation or two, ~2-3x). A fit past it is the model's error, not
# the engine's: one first token that came far sooner than the queue ahead implied (a
# scheduler that interleaves prefills) once drove an engine's cost to ~0, so it looked idle
# whatever its queue and drew every request until its own late first tokens corrected it.
OWN_FIT_SPREAD = 4.0


@dataclass(frozen=True)
class SpeedPrior:
    """Where every engine's fit starts (routing.prior_* keys)."""

    intercept_s: float = 0.02
    per_token_s: float = 1e-4
    per_decode_s: float = 1e-4
    transfer_intercept_s: float = 0.01
    transfer_per_token_s: float = 1e-5
    step_s: float = 0.01
    per_seq_s: float = 1e-4


def speed_prior(routing: RoutingConfig) -> SpeedPrior:
    """The prior of the configuration's routing.prior_* keys."""
    return SpeedPrior(
        per_token_s=1.0 / routing.prior_prefill_tokens_per_s,
        transfer_per_token_s=1.0 / routing.prior_kv_transfer_tokens_per_s,
    )


def _ewma(old: float, new: float, alpha: float) -> float:
    return old + alpha * (new - old)


def _running_alpha(samples: int, floor: float) -> float:
    """Weight of the next sample: a plain mean with the prior as one sample while samples
    are few (a prior is a guess worth one observation), then a moving average."""
    return max(1.0 / (samples + 2), floor)


@dataclass
class SpeedLearner:
    """Every learned number of the cost model, for one router replica."""

    prior: SpeedPrior = field(default_factory=SpeedPrior)
    # Per-engine prior seconds per prompt token ([[backends]] prefill_tokens_per_s).
    engine_per_token_s: dict[str, float] = field(default_factory=dict)
    chars_per_token: float = 4.0
    mean_prompt_tokens: float = 1024.0
    race_wait_s: float = 0.005
    # Optimistic start: races are assumed worth half the prompt until measured.
    race_saving_share: float = 0.5
    # The same for prompts the router's prefix memory places nowhere: cold, or sent by
    # other replicas. Only the engines can find those, so the two are measured apart.
    race_saving_share_unplaced: float = 0.5
    _races: int = 0  # races observed (race_saving_share)
    _races_unplaced: int = 0
    _waits: int = 0  # races nobody won (race_wait_s)
    _engines: dict[str, OnlineLinear] = field(default_factory=dict)
    _fleet: OnlineLinear | None = None
    _transfer: OnlineLinear | None = None
    _steps: dict[str, OnlineLinear] = field(default_factory=dict)
    _fleet_step: OnlineLinear | None = None
    # Per engine: last scraped (device hits, host hits, load seconds) and the learned
    # (share of hits from the CPU tier, seconds per CPU-hit token).
    _tier_counters: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    _tier_cost: dict[str, tuple[float, float]] = field(default_factory=dict)
    # `speed()`'s answers until the next sample: read several times a request, learned from
    # a couple of times (each answer built anew was ~3 us).
    _speeds: dict[str, EngineSpeed] = field(default_factory=dict)

    def _new_fit(self, start: tuple[float, float, float]) -> OnlineLinear:
        p = self.prior
        # A coefficient may be off by ~10x its prior before the data settles it.
        return OnlineLinear(start, (10 * p.intercept_s + 0.1, 10 * p.per_token_s, 10 * p.per_decode_s))

    def _fleet_fit(self) -> OnlineLinear:
        if self._fleet is None:
            p = self.prior
            self._fleet = self._new_fit((p.intercept_s, p.per_token_s, p.per_decode_s))
        return self._fleet

    def _engine(self, name: str) -> OnlineLinear:
        fit = self._engines.get(name)
        if fit is None:
            own = self.engine_per_token_s.get(name)
            if own is not None:
                p = self.prior
                fit = OnlineLinear(
                    (p.intercept_s, own, p.per_decode_s), (10 * p.intercept_s + 0.1, 10 * own, 10 * p.per_decode_s)
                )
            else:
                a, b, c = self._fleet_fit().theta
                fit = self._new_fit((a, b, c))
            self._engines[name] = fit
        return fit

    def _transfer_fit(self) -> OnlineLinear:
        if self._transfer is None:
            p = self.prior
            self._transfer = OnlineLinear(
                (p.transfer_intercept_s, p.transfer_per_token_s),
                (10 * p.transfer_intercept_s + 0.1, 10 * p.transfer_per_token_s),
            )
        return self._transfer

    def _step_fit(self, name: str | None) -> OnlineLinear:
        """The decode-step fit of `name` (None: the fleet's), started at the fleet's."""
        if self._fleet_step is None:
            p = self.prior
            self._fleet_step = OnlineLinear((p.step_s, p.per_seq_s), (10 * p.step_s + 0.05, 10 * p.per_seq_s))
        if name is None:
            return self._fleet_step
        fit = self._steps.get(name)
        if fit is None:
            p = self.prior
            fit = self._steps[name] = OnlineLinear(
                tuple(self._fleet_step.theta), (10 * p.step_s + 0.05, 10 * p.per_seq_s)
            )
        return fit

    # --- samples ------------------------------------------------------------------------
    def observe_decode(self, engine: str, decoding: float, gaps: int, seconds: float, prefilled: float) -> None:
        """A leg's `gaps` gaps between tokens took `seconds` while about `decoding`
        sequences decoded there and the engine prefilled `prefilled` tokens."""
        if gaps <= 0 or seconds < 0.0:
            return
        stall = max(self.speed(engine).per_token_s, MIN_PER_TOKEN_S) * max(prefilled, 0.0)
        gap = max(seconds - stall, 0.0) / gaps
        x = (1.0, max(float(decoding), 1.0))
        self._step_fit(engine).observe(x, gap)
        self._step_fit(None).observe(x, gap)

    def observe_first_token(self, engine: str, prefill_tokens: float, decoding: float, seconds: float) -> None:
        if seconds >= 0.0 and prefill_tokens >= 0.0:
            self._speeds.clear()  # the fleet's fit moves every engine's without its own
            x = (1.0, float(prefill_tokens), float(decoding))
            self._engine(engine).observe(x, seconds)
            if engine not in self.engine_per_token_s:
                self._fleet_fit().observe(x, seconds)

    def observe_transfer(self, tokens: float, seconds: float) -> None:
        if seconds >= 0.0 and tokens > 0:
            self._transfer_fit().observe((1.0, float(tokens)), seconds)

    def observe_cache_tiers(self, engine: str, device_hits: float, host_hits: float, load_s: float) -> None:
        """One scrape of an engine's cumulative hit counters by tier and CPU-tier load time."""
        last = self._tier_counters.get(engine)
        self._tier_counters[engine] = (device_hits, host_hits, load_s)
        if last is None:
            return
        d_dev, d_host, d_load = device_hits - last[0], host_hits - last[1], load_s - last[2]
        if d_dev < 0 or d_host < 0 or d_load < 0:
            return  # counters went back: the engine restarted; the new values are the base
        if d_dev + d_host <= 0:
            return
        # The first measurement sets each figure; later ones move it by a fifth.
        share_now = d_host / (d_dev + d_host)
        self._speeds.pop(engine, None)
        known = self._tier_cost.get(engine)
        share = share_now if known is None else _ewma(known[0], share_now, 0.2)
        per_token = 0.0 if known is None else known[1]
        if d_host > 0 and d_load > 0:
            per_token = d_load / d_host if per_token == 0.0 else _ewma(per_token, d_load / d_host, 0.2)
        self._tier_cost[engine] = (share, per_token)

    def held_per_token_s(self, engine: str) -> float:
        share, per_token = self._tier_cost.get(engine, (0.0, 0.0))
        return share * per_token

    def observe_prompt(self, text_chars: int, prompt_tokens: int) -> None:
        if prompt_tokens > 0:
            self.mean_prompt_tokens = _ewma(self.mean_prompt_tokens, prompt_tokens, 0.05)
            if text_chars > 0:
                self.chars_per_token = _ewma(self.chars_per_token, text_chars / prompt_tokens, 0.05)

    def observe_race(self, saving_share: float, waited_s: float | None, placed: bool = True) -> None:
        """One race: the share of the prompt's prefill time it saved, and (when nobody
        accepted) how long the verdicts took. `placed`: the prefix memory expected the
        prompt on some engine."""
        share = min(max(saving_share, 0.0), 1.0)
        if placed:
            alpha = _running_alpha(self._races, 0.05)
            self._races += 1
            self.race_saving_share = _ewma(self.race_saving_share, share, alpha)
        else:
            alpha = _running_alpha(self._races_unplaced, 0.05)
            self._races_unplaced += 1
            self.race_saving_share_unplaced = _ewma(self.race_saving_share_unplaced, share, alpha)
        if waited_s is not None and waited_s >= 0.0:
            alpha = _running_alpha(self._waits, 0.05)
            self._waits += 1
            self.race_wait_s = _ewma(self.race_wait_s, waited_s, alpha)

    # --- what the planners read --------------------------------------------------------
    def speed(self, engine: str) -> EngineSpeed:
        known = self._speeds.get(engine)
        if known is None:
            known = self._speeds[engine] = self._speed(engine)
        return known

    def _speed(self, engine: str) -> EngineSpeed:
        fit = self._engines.get(engine)
        own_prior = engine in self.engine_per_token_s
        held = self.held_per_token_s(engine)
        if fit is None and own_prior:
            p = self.prior
            return EngineSpeed(p.intercept_s, self.engine_per_token_s[engine], p.per_decode_s, 0, held)
        if fit is None or (fit.samples < OWN_FIT_SAMPLES and not own_prior):
            a, b, c = self._fleet_fit().theta
            return EngineSpeed(a, b, c, 0 if fit is None else fit.samples, held)
        a, b, c = fit.theta
        if not own_prior:  # an engine configured as other hardware is judged on its own
            fleet = max(self._fleet_fit().theta[1], MIN_PER_TOKEN_S)
            b = min(max(b, fleet / OWN_FIT_SPREAD), fleet * OWN_FIT_SPREAD)
        return EngineSpeed(a, b, c, fit.samples, held)

    def itl(self, engine: str) -> ItlSpeed:
        fit = self._steps.get(engine)
        if fit is None or fit.samples < OWN_FIT_SAMPLES:
            e, c = self._step_fit(None).theta
            return ItlSpeed(e, c, 0 if fit is None else fit.samples)
        e, c = fit.theta
        return ItlSpeed(e, c, fit.samples)

    def transfer(self) -> TransferSpeed:
        if self._transfer is None:
            return TransferSpeed(self.prior.transfer_intercept_s, self.prior.transfer_per_token_s, 0)
        a, b = self._transfer.theta
        return TransferSpeed(a, b, self._transfer.samples)

    def add_engine(self, engine: str, prefill_tokens_per_s: float = 0.0) -> None:
        """An engine joined the fleet, with its configured speed if any (other hardware)."""
        if prefill_tokens_per_s > 0:
            self.engine_per_token_s[engine] = 1.0 / prefill_tokens_per_s
        self._speeds.pop(engine, None)

    def forget_engine(self, engine: str) -> None:
        """The engine left the fleet: one added again under its name may be another machine."""
        self.engine_per_token_s.pop(engine, None)
        self._engines.pop(engine, None)
        self._speeds.pop(engine, None)
        self._steps.pop(engine, None)
        self._tier_counters.pop(engine, None)
        self._tier_cost.pop(engine, None)
