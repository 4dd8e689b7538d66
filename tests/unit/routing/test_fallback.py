"""Where a prompt nobody accepted is computed (router/routing/fallback.py): one decoder or a
prefill/decode split, whichever the cost model predicts sooner."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from router.names import SplitMode
from router.routing.costmodel import ItlSpeed, pd_ttft, ttft
from router.routing.fallback import FallbackPlan, plan_fallback
from router.routing.planning import RouteQuery
from support.snapshots import SPEED, Q, R, snap, view


def _planned(plan: FallbackPlan | None) -> FallbackPlan:
    assert plan is not None  # there is a decoder
    return plan


def test_fallback_splits_when_prefill_decode_is_predicted_faster() -> None:
    # d0 is busy (2,000 queued), d1 busier: the producer prefills in parallel with d1's queue.
    s = snap(
        view("d0", queued=2000),
        view("d1", queued=2500),
        view("p0", decodes=False, prefills=True, queued=500),
        view("p1", decodes=False, prefills=True),
    )
    fb = plan_fallback(Q, s, R, prompt_tokens=1000)
    assert fb is not None
    direct = SPEED.ttft(3000, 0)
    split = pd_ttft(SPEED, 0, 0, 1000, SPEED, 2000, 0, s.transfer, 1000)
    assert split < direct
    assert (fb.prefill, fb.decode, fb.route, fb.prefill_tokens) == ("p1", "d0", "pd", 1000)
    assert fb.decode_threshold == R.decode_guard_threshold
    assert fb.predicted_ttft_s == split


def test_fallback_computes_on_an_idle_decoder_rather_than_split() -> None:
    # Idle decoder: computing the prompt there beats prefill + transfer (same speed).
    s = snap(view("d0"), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=1000)
    assert fb is not None
    assert (fb.prefill, fb.decode, fb.route, fb.predicted_ttft_s) == (None, "d0", "direct", SPEED.ttft(1000, 0))
    # A producer with a queue never helps an idle decoder.
    s = snap(view("d0", queued=500), view("p0", decodes=False, prefills=True, queued=5000))
    assert _planned(plan_fallback(Q, s, R, prompt_tokens=1000)).prefill is None


def test_split_always_takes_the_fastest_pair_over_an_idle_decoder() -> None:
    always = replace(R, split=SplitMode.ALWAYS)
    s = snap(
        view("d0"),
        view("d1", queued=5000),
        view("p0", decodes=False, prefills=True),
        view("p1", decodes=False, prefills=True, queued=2000),
    )
    assert _planned(plan_fallback(Q, s, R, 1000)).prefill is None  # the model: d0 computes it sooner
    fb = plan_fallback(Q, s, always, 1000)
    assert fb is not None
    assert (fb.prefill, fb.decode) == ("p0", "d0")
    assert fb.decode_threshold == always.decode_guard_threshold
    # Below the floor nothing is split.
    assert _planned(plan_fallback(RouteQuery("m", "hi", prompt_tokens=10), s, always, 10)).prefill is None


def test_fallback_floor_and_missing_producers() -> None:
    s = snap(view("d0", queued=50_000), view("p0", decodes=False, prefills=True))
    short = plan_fallback(Q, s, R, prompt_tokens=R.min_pd_prompt_tokens - 1)
    assert short is not None
    assert (short.prefill, short.decode, short.decode_threshold, short.route) == (None, "d0", 0.0, "direct")
    assert _planned(plan_fallback(Q, snap(view("d0", queued=50_000)), R, prompt_tokens=10_000)).prefill is None


def test_fallback_never_pairs_a_backend_with_itself() -> None:
    s = snap(view("both", prefills=True, queued=50_000))
    assert _planned(plan_fallback(Q, s, R, prompt_tokens=10_000)).prefill is None


def test_fallback_excludes_failed_backends() -> None:
    s = snap(view("d0"), view("d1", queued=5000), view("p0", decodes=False, prefills=True))
    fb = plan_fallback(Q, s, R, prompt_tokens=10_000, exclude=frozenset({"d0", "p0"}))
    assert fb is not None
    assert (fb.decode, fb.prefill) == ("d1", None)
    assert plan_fallback(Q, s, R, 10, exclude=frozenset({"d0", "d1"})) is None


def test_fallback_decoder_weighs_the_partial_hit_against_the_queue() -> None:
    d = (view("d0"), view("d1", queued=300), view("d2", queued=3000))
    assert _planned(plan_fallback(Q, snap(*d), R, 2000)).decode == "d0"
    # d1 lacks 2,000 - 1,200 = 800 tokens behind 300 queued: 1,100 < d0's 2,000.
    assert _planned(plan_fallback(Q, snap(*d), R, 2000, hits={"d1": 1200})).decode == "d1"
    # A smaller hit does not pay for the queue: 300 + 1,800 > 2,000.
    assert _planned(plan_fallback(Q, snap(*d), R, 2000, hits={"d1": 200})).decode == "d0"
    # Unknown length: estimated from the query (its exact token count here).
    assert _planned(plan_fallback(Q, snap(*d), R, None, hits={"d2": 1000})).decode == "d0"


@given(
    st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 4000)), min_size=1, max_size=5),
    st.lists(st.integers(0, 20_000), max_size=2),
    st.integers(1, 8000),
    st.booleans(),
)
def test_with_nobody_decoding_the_fallback_is_the_least_predicted_time_of_every_option(
    decoders: list[tuple[int, int]], producers: list[int], prompt: int, spare_on: bool
) -> None:
    d = [view(f"d{i}", queued=q) for i, (q, _) in enumerate(decoders)]
    p = [view(f"p{i}", decodes=False, prefills=True, queued=q) for i, q in enumerate(producers)]
    hits = {f"d{i}": min(h, prompt) for i, (_, h) in enumerate(decoders) if h}
    s = snap(*d, *p)
    mode = SplitMode.ALWAYS if spare_on else SplitMode.NEVER
    fb = plan_fallback(Q, s, replace(R, spare_producers=mode), prompt, hits=hits)
    assert fb is not None
    assert fb.predicted_ttft_s is not None
    options = [ttft(b.speed, b.queued_tokens, 0, prompt - hits.get(b.name, 0)) for b in d]
    splits = [
        (pd_ttft(x.speed, x.queued_tokens, 0, prompt, b.speed, b.queued_tokens, 0, s.transfer, prompt), x)
        for x in p
        for b in d
        if prompt >= R.min_pd_prompt_tokens and prompt - hits.get(b.name, 0) >= R.min_pd_prompt_tokens
    ]
    # Nobody decodes, so nobody is stalled: goodput's choice is the least predicted time,
    # among the splits those within the TTFT SLO (a later one only lengthens the producer's
    # queue), or, with routing.spare_producers, through an idle producer while two are idle.
    spare = spare_on and [x.queued_tokens == 0 for x in p].count(True) >= 2
    options += [t for t, x in splits if t <= R.slo_ttft_ms / 1000.0 or (spare and x.queued_tokens == 0)]
    assert abs(fb.predicted_ttft_s - min(options)) < 1e-12
    assert (fb.prefill is not None) == (fb.predicted_ttft_s < min(options[: len(d)]))


def test_split_auto_keeps_prefills_off_a_decoder_whose_sequences_it_would_stall() -> None:
    # d0 decodes 10 sequences at 11 ms a step: a 1,000-token prefill (100 ms) there pushes
    # each past the 100 ms ITL SLO; the split is a little later but stalls nobody.
    s = snap(view("d0", decoding=10), view("p0", decodes=False, prefills=True))
    fb = _planned(plan_fallback(Q, s, R, 1000))
    assert (fb.prefill, fb.decode, fb.reason, fb.lost) == ("p0", "d0", "goodput_split", 0)
    assert fb.alternative.startswith("direct d0 ")
    assert fb.predicted_itl_s is not None
    # Idle decoders: nothing to stall, so the sooner first token decides (direct).
    idle = _planned(plan_fallback(Q, snap(view("d0"), view("p0", decodes=False, prefills=True)), R, 1000))
    assert (idle.prefill, idle.reason) == (None, "goodput_direct")


def test_a_decoder_with_a_small_prefill_chunk_computes_a_prompt_its_sequences_barely_notice() -> None:
    # The same 10 sequences on d0 as above, but its engine prefills 256 tokens a step: the
    # 1,000-token prefill adds ~26 ms to each of four steps, within the ITL SLO. With a queue
    # on the producer the prompt is computed there, sooner than a split.
    d0 = replace(view("d0", decoding=10), chunk_tokens=256)
    small = snap(d0, view("p0", decodes=False, prefills=True, queued=200))
    fb = _planned(plan_fallback(Q, small, R, 1000))
    assert (fb.prefill, fb.decode, fb.reason, fb.lost) == (None, "d0", "goodput_direct", 0)
    assert fb.alternative.startswith("split p0>d0 ")


def test_a_prompt_goes_to_an_idle_producer_where_it_delays_the_decoders_sequences_more() -> None:
    # d0's 10 sequences would each wait ~104 ms more over the prefill's four steps (none past
    # the ITL SLO: goodput's count ties); the split through the idle p0 is later for the
    # request by less than that sum, so it goes there.
    d0 = replace(view("d0", decoding=10), chunk_tokens=256)
    fb = _planned(plan_fallback(Q, snap(d0, view("p0", decodes=False, prefills=True)), R, 1000))
    assert (fb.prefill, fb.decode, fb.reason, fb.lost) == ("p0", "d0", "idle_producer", 0)
    assert fb.alternative.startswith("direct d0 ")
    # One sequence: it would wait the prefill's ~100 ms, more than the split's first token
    # is later (the transfer, ~14 ms). Nothing decoding: nobody waits, the sooner first token.
    for decoding, split in ((1, "p0"), (0, None)):
        d = replace(view("d0", decoding=decoding), chunk_tokens=256)
        assert _planned(plan_fallback(Q, snap(d, view("p0", decodes=False, prefills=True)), R, 1000)).prefill == split
    # A decoder that also prefills is no idle producer: its own sequences would wait.
    both = view("b0", decodes=True, prefills=True)
    assert _planned(plan_fallback(Q, snap(d0, both), R, 1000)).reason != "idle_producer"


def test_split_never_computes_on_a_decoder() -> None:
    s = snap(view("d0", decoding=10), view("p0", decodes=False, prefills=True))
    fb = _planned(plan_fallback(Q, s, replace(R, split=SplitMode.NEVER), 1000))
    assert (fb.prefill, fb.reason, fb.lost) == (None, "split_never", 10)


def test_each_direct_placement_says_why_no_split_was_weighed() -> None:
    prod = view("p0", decodes=False, prefills=True)
    assert _planned(plan_fallback(Q, snap(view("d0")), R, 1000)).reason == "no_producer"
    short = _planned(plan_fallback(Q, snap(view("d0"), prod), R, R.min_pd_prompt_tokens - 1))
    assert short.reason == "below_split_floor"
    always = _planned(plan_fallback(Q, snap(view("d0"), prod), replace(R, split=SplitMode.ALWAYS), 1000))
    assert (always.reason, always.prefill) == ("split_always", "p0")


def test_split_auto_never_queues_a_split_past_the_ttft_slo() -> None:
    # The producer's queue (30,000 tokens: 3 s) puts the split past the 2 s SLO: the prompt
    # is computed on the decoder even though its sequences are stalled.
    s = snap(view("d0", decoding=10), view("p0", decodes=False, prefills=True, queued=30_000))
    fb = _planned(plan_fallback(Q, s, R, 1000))
    assert (fb.prefill, fb.reason, fb.lost) == (None, "goodput_direct", 10)
    assert "split p0>d0" in fb.alternative


def test_a_prompt_late_wherever_it_goes_takes_a_producer_to_spare_over_the_triage() -> None:
    # 30,000 tokens: 3 s of prefill anywhere, past the 2 s TTFT SLO. d0's sequences are past
    # the ITL SLO already (the triage's sacrifice, with 20,000 tokens queued), d1's would be
    # pushed past it. With routing.spare_producers on: with one producer, or one of two busy,
    # the split is no candidate and the prompt joins d0's queue; with two idle producers one
    # is to spare, and the split loses only the request itself, sooner.
    sacrificed = replace(view("d0", decoding=10, queued=20_000), stalled=10.0)
    fresh = view("d1", decoding=10)
    idle_p = [view(f"p{i}", decodes=False, prefills=True, speed=replace(SPEED, samples=3)) for i in range(2)]
    on = replace(R, spare_producers=SplitMode.ALWAYS)
    one = _planned(plan_fallback(Q, snap(sacrificed, fresh, idle_p[0]), on, 30_000))
    assert (one.prefill, one.decode, one.reason, one.lost) == (None, "d0", "goodput_direct", 1)
    busy = replace(idle_p[1], queued_tokens=5_000.0)
    assert _planned(plan_fallback(Q, snap(sacrificed, fresh, idle_p[0], busy), on, 30_000)).prefill is None
    fb = _planned(plan_fallback(Q, snap(sacrificed, fresh, *idle_p), on, 30_000))
    assert (fb.prefill, fb.reason, fb.lost) == ("p0", "spare_producer", 1)
    assert fb.predicted_ttft_s is not None
    assert one.predicted_ttft_s is not None
    assert fb.predicted_ttft_s < one.predicted_ttft_s
    assert "direct d0" in fb.alternative
    # "never": the triage's count alone decides. "auto" (the default): while the prompt work
    # placed lately is within the producers' measured speed (two at 10,000 tokens/s here).
    never = replace(R, spare_producers=SplitMode.NEVER)
    assert _planned(plan_fallback(Q, snap(sacrificed, fresh, *idle_p), never, 30_000)).prefill is None
    within = replace(snap(sacrificed, fresh, *idle_p), prompt_tokens_per_s=19_000.0)
    assert _planned(plan_fallback(Q, within, R, 30_000)).reason == "spare_producer"
    beyond = replace(within, prompt_tokens_per_s=21_000.0)
    assert _planned(plan_fallback(Q, beyond, R, 30_000)).prefill is None


def test_a_prompt_whose_split_is_in_flight_follows_it_through_its_producer() -> None:
    # The producer's queue (15,000 tokens: 1.5 s) holds the prefill of a request sharing
    # this 8,000-token prompt. Counted as new there, the split is past the 2 s TTFT SLO and
    # d0 computes it, stalling its 10 sequences; the producer will hold it by the time this
    # prefill runs, so the split costs its queue and the transfer only.
    s = snap(view("d0", decoding=10), view("p0", decodes=False, prefills=True, queued=15_000))
    cold = _planned(plan_fallback(Q, s, R, 8000))
    assert (cold.prefill, cold.lost) == (None, 10)
    fb = _planned(plan_fallback(Q, s, R, 8000, hits={"p0": 8000.0}))
    assert (fb.prefill, fb.decode, fb.prefill_tokens, fb.lost) == ("p0", "d0", 0, 0)
    assert fb.predicted_ttft_s == pd_ttft(SPEED, 15_000, 0, 0, SPEED, 0, 0, s.transfer, 8000)


def test_splits_spread_over_consumers_when_the_producer_is_the_slower_side() -> None:
    # Every consumer is ready before the producer's prefill: the TTFTs tie, and the one
    # with a split's decode leg already on its way (its prefill still running) is not taken.
    s = snap(
        replace(view("d0", decoding=10), prefilling=1),
        view("d1", decoding=10),
        view("p0", decodes=False, prefills=True),
    )
    assert _planned(plan_fallback(Q, s, R, 1000)).decode == "d1"
    assert _planned(plan_fallback(Q, snap(*(replace(b, prefilling=0) for b in s.backends)), R, 1000)).decode == "d0"


def test_a_prompt_late_anywhere_goes_where_it_loses_fewest_within_the_stretch() -> None:
    step = ItlSpeed(step_s=0.01, per_seq_s=1e-4)
    # Both decoders are far past the TTFT SLO for an 8,000-token prompt. Its prefill would
    # stall the fresh decoder's 8 sequences; the other decoder's are stalled already.
    stalled = replace(view("stalled", queued=60_000, decoding=8), itl=step, stalled=8)
    fresh = replace(view("fresh", queued=20_000, decoding=8), itl=step)
    s = snap(stalled, fresh)
    assert R.max_ttft_stretch == 0.0  # no bound: the triage
    assert _planned(plan_fallback(Q, s, R, prompt_tokens=8000)).decode == "stalled"
    # 6.8 s there against 2.8 s: more than twice its soonest start.
    fb = _planned(plan_fallback(Q, s, replace(R, max_ttft_stretch=2.0), prompt_tokens=8000))
    assert (fb.decode, fb.predicted_ttft_s) == ("fresh", ttft(SPEED, 20_000, 8, 8000))
    assert fb.lost == 9
