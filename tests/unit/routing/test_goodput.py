"""Goodput's choice (router/routing/goodput.py): the placement that keeps the most requests,
new and running, within both SLOs, worked out by hand from the cost model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.routing import costmodel, goodput
from router.routing.costmodel import ItlSpeed
from support.snapshots import SPEED, view

SLO = goodput.Slo(ttft_s=2.0, itl_s=0.1, chunk_tokens=8192)
STEP = ItlSpeed(step_s=0.01, per_seq_s=1e-4)


def test_a_prefill_on_a_busy_decoder_pushes_its_running_sequences_past_the_itl_slo() -> None:
    d = replace(view("d", decoding=10), itl=STEP)
    # 1,000 tokens at 100 us each: 100 ms more on each of d's next steps.
    p = goodput.direct(d, 1000, 0.2, SLO)
    assert costmodel.prefill_stall_s(SPEED, 1000, 8192) == 1000 * SPEED.per_token_s
    assert STEP.seconds(10) <= SLO.itl_s < STEP.seconds(11) + 0.1
    assert (p.stalled, p.itl_s, p.lost(SLO)) == (10, STEP.seconds(11), 10)
    # A short prompt's stall keeps every step within the SLO: nobody is pushed.
    assert goodput.direct(d, 100, 0.02, SLO).lost(SLO) == 0


def test_chunked_prefill_bounds_the_stall_of_each_step() -> None:
    d = replace(view("d", decoding=10), itl=STEP)
    assert costmodel.prefill_stall_s(SPEED, 5000, 512) == 512 * SPEED.per_token_s
    assert goodput.direct(replace(d, chunk_tokens=512), 5000, 0.6, SLO).stalled == 0


def test_sequences_already_past_the_slo_are_not_counted_again() -> None:
    slow = replace(view("d", decoding=10), itl=ItlSpeed(step_s=0.2, per_seq_s=0.0))
    assert goodput.direct(slow, 1000, 0.2, SLO).stalled == 0


def test_sequences_a_stalling_prefill_already_pushed_cost_nothing_more() -> None:
    # 10 decoding, 6 of them beside an earlier stalling prefill: this stall loses the other 4.
    d = replace(view("d", decoding=10), itl=STEP, stalled=6)
    assert goodput.direct(d, 1000, 0.2, SLO).stalled == 4
    assert goodput.direct(replace(d, stalled=10), 1000, 0.2, SLO).lost(SLO) == 0


def test_a_prefill_stalls_exactly_when_a_direct_placement_pushes_sequences() -> None:
    # With 10 decoding, a step takes 11.1 ms with the new sequence: 889 tokens more fill the SLO.
    for tokens, stalls in [(1000, True), (900, True), (880, False), (100, False), (0, False)]:
        d = replace(view("d", decoding=10), itl=STEP)
        assert goodput.prefill_stalls(SPEED, STEP, 10, tokens, SLO, 8192) == stalls
        assert (goodput.direct(d, tokens, 0.2, SLO).stalled > 0) == stalls
    # Nobody decoding: the prefill stalls whoever starts decoding beside it.
    assert goodput.prefill_stalls(SPEED, STEP, 0, 1000, SLO, 8192)
    assert not goodput.prefill_stalls(SPEED, STEP, 0, 1000, SLO, 512)  # 51 ms more a step: within


def test_a_prefill_ahead_of_splits_awaiting_their_kv_loses_those_it_makes_late() -> None:
    # Queue through in 10 ms + 10 x 1 ms; splits with 0.05, 0.5 and 5 s left of their SLO.
    d = replace(view("d", decoding=10), itl=STEP, kv_awaited_s=(0.05, 0.5, 5.0))
    queue_s = costmodel.ttft(SPEED, 0, 10, 0)
    assert queue_s < 0.05
    # Done in 0.2 s: the split with 0.05 s left is late; 0.5 and 5 s are not.
    assert goodput.pushed_past_ttft(d, 0.2) == 1
    assert goodput.pushed_past_ttft(d, 1.0) == 2
    assert goodput.direct(d, 100, 1.0, SLO).lost(SLO) == 2  # 100 tokens stall nobody
    # A split the queue already there makes late is lost anyway.
    late = replace(d, kv_awaited_s=(queue_s / 2,))
    assert goodput.pushed_past_ttft(late, 1.0) == 0


def test_the_split_stalls_nobody_and_wins_while_its_ttft_meets_the_slo() -> None:
    d = replace(view("d", decoding=10), itl=STEP)
    prod = replace(view("p", decodes=False, prefills=True), itl=STEP)
    on_d = goodput.direct(d, 1000, 0.2, SLO)
    split = goodput.split(prod, d, 1000, 0.3, SLO)
    assert split.lost(SLO) == 0
    assert goodput.best([on_d, split], SLO) is split
    # A split past the TTFT SLO loses its own request for certain and lengthens the
    # producer's queue for every later one: it is no candidate.
    late = replace(split, ttft_s=3.0)
    assert late.lost(SLO) == 1 < on_d.lost(SLO)
    assert goodput.worth_splitting(split, SLO)
    assert not goodput.worth_splitting(late, SLO)


def test_a_prefill_only_producer_has_no_sequences_to_stall() -> None:
    # Its running requests are other prompts' prefills: one token each, no gaps to lengthen.
    prod = replace(view("p", decodes=False, prefills=True, decoding=3), itl=STEP)
    d = replace(view("d"), itl=STEP)
    assert goodput.split(prod, d, 1000, 0.3, SLO).lost(SLO) == 0
    # An engine that both prefills for splits and decodes: its sequences count.
    both = replace(prod, decodes=True)
    assert goodput.split(both, d, 1000, 0.3, SLO).lost(SLO) == 3


def test_ties_go_to_the_least_predicted_ttft() -> None:
    idle = replace(view("d"), itl=STEP)
    prod = view("p", decodes=False, prefills=True)
    on_d = goodput.direct(idle, 1000, 0.11, SLO)
    split = goodput.split(prod, idle, 1000, 0.13, SLO)
    assert on_d.lost(SLO) == split.lost(SLO) == 0
    assert goodput.best([split, on_d], SLO) is on_d


def test_a_request_whose_own_itl_misses_the_slo_counts_as_lost() -> None:
    crowded = replace(view("d", decoding=100), itl=ItlSpeed(step_s=0.05, per_seq_s=1e-3))
    p = goodput.direct(crowded, 10, 0.05, SLO)
    assert p.itl_s > SLO.itl_s
    assert p.lost(SLO) == 1


def test_a_request_that_misses_anyway_waits_at_most_the_stretch_over_its_soonest_start() -> None:
    # The sacrifice: its sequences are past the ITL SLO already, so it loses nothing more.
    stalled = replace(view("s", decoding=8), itl=STEP, stalled=8)
    # Within the ITL SLO, and a prefill there pushes its eight sequences past it.
    fresh = replace(view("f", decoding=8), itl=STEP)
    late_on_stalled = goodput.direct(stalled, 8000, 9.0, SLO)
    late_on_fresh = goodput.direct(fresh, 8000, 3.0, SLO)
    assert (late_on_stalled.lost(SLO), late_on_fresh.lost(SLO)) == (1, 9)
    assert goodput.best([late_on_fresh, late_on_stalled], SLO) is late_on_stalled  # unbounded: the triage
    bounded = replace(SLO, ttft_stretch=2.0)
    assert goodput.best([late_on_fresh, late_on_stalled], bounded) is late_on_fresh  # 9 s > 2 x 3 s
    nearer = goodput.direct(stalled, 8000, 5.9, SLO)
    assert goodput.best([late_on_fresh, nearer], bounded) is nearer  # within 2 x 3 s: the triage stands
    # A placement within the TTFT SLO is never out of bounds, however soon another starts.
    on_time = goodput.direct(stalled, 8000, 1.9, SLO)
    soonest = goodput.direct(fresh, 8000, 0.5, SLO)
    assert (on_time.lost(SLO), soonest.lost(SLO)) == (0, 8)
    assert goodput.best([soonest, on_time], bounded) is on_time


def test_producers_are_to_spare_while_two_are_idle() -> None:
    idle = [view(f"p{i}", decodes=False, prefills=True) for i in range(3)]
    assert goodput.spare_producers(idle) == {"p0", "p1", "p2"}
    queued = replace(idle[0], queued_tokens=100.0)
    prefilling = replace(idle[1], prefilling=1)
    assert goodput.spare_producers([queued, *idle[1:]]) == {"p1", "p2"}
    assert goodput.spare_producers([queued, prefilling, idle[2]]) == frozenset()  # the last idle one is kept
    assert goodput.spare_producers(idle[:1]) == frozenset()
    # With the prompt work placed lately: only while the producers could prefill it alone
    # (three measured at SPEED's 10,000 tokens/s; unmeasured, a producer counts nothing).
    assert goodput.prefill_capacity(idle) == 0.0
    assert goodput.spare_producers(idle, 1.0) == frozenset()
    idle = [replace(p, speed=replace(SPEED, samples=3)) for p in idle]
    assert goodput.prefill_capacity(idle) == pytest.approx(30_000.0)
    assert goodput.spare_producers(idle, 29_000.0) == {"p0", "p1", "p2"}
    assert goodput.spare_producers(idle, 31_000.0) == frozenset()
    # Decoders that prefill too are never to spare: what is sent there next would be stalled.
    both = [view(f"b{i}", prefills=True) for i in range(2)]
    assert goodput.spare_producers([*both, idle[0]]) == frozenset()


def test_a_split_late_anyway_is_weighed_only_on_a_producer_to_spare() -> None:
    prod = view("p", decodes=False, prefills=True)
    late = goodput.split(prod, replace(view("d"), itl=STEP), 30_000, 3.5, SLO)
    assert late.misses(SLO)
    assert not goodput.worth_splitting(late, SLO)
    assert goodput.worth_splitting(late, SLO, frozenset({"p"}))
    assert not goodput.worth_splitting(late, SLO, frozenset({"other"}))


def test_a_direct_placement_delays_each_sequence_beside_it_by_its_whole_prefill() -> None:
    d = replace(view("d", decoding=4), itl=STEP)
    # 1,000 tokens at 100 us each, over as many steps as the chunk makes: 0.1 s for each of 4.
    for chunk in (8192, 256):
        assert goodput.direct(replace(d, chunk_tokens=chunk), 1000, 0.2, SLO).delay_s == pytest.approx(0.4)
    assert goodput.direct(replace(d, decoding=0), 1000, 0.2, SLO).delay_s == 0


def test_an_idle_producer_takes_a_tie_when_the_split_delays_the_fleet_less() -> None:
    chosen = goodput.Placement("d", None, ttft_s=0.1, itl_s=0.01, stalled=0, delay_s=0.4)
    soon = goodput.Placement("d", "p", ttft_s=0.3, itl_s=0.01, stalled=0)
    late = goodput.Placement("d", "q", ttft_s=0.6, itl_s=0.01, stalled=0)  # 0.5 s later: more than 0.4
    idle = frozenset({"p", "q"})
    assert goodput.on_idle_producer(chosen, [late, soon], idle, SLO) == soon
    assert goodput.on_idle_producer(chosen, [late], idle, SLO) is None
    # Only idle producers; never a split that loses more, or misses its own SLO.
    assert goodput.on_idle_producer(chosen, [soon], frozenset({"q"}), SLO) is None
    assert goodput.on_idle_producer(chosen, [replace(soon, stalled=1)], idle, SLO) is None
    missing = replace(chosen, ttft_s=1.9, delay_s=5.0)
    assert goodput.on_idle_producer(missing, [replace(soon, ttft_s=2.5)], idle, SLO) is None
    # Nothing to trade: nobody decodes beside the direct placement, or it is a split already.
    assert goodput.on_idle_producer(replace(chosen, delay_s=0.0), [soon], idle, SLO) is None
    assert goodput.on_idle_producer(soon, [soon], idle, SLO) is None
