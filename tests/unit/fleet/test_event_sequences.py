"""Others' sequences on an engine from its KV events (router/fleet/event_sequences.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config.schema import BackendConfig, HealthConfig
from router.fleet.event_sequences import (
    GRACE_S,
    PRIOR_BLOCK_S,
    REPAY_S,
    RETAIN_S,
    WINDOW_BLOCKS,
    EventSequences,
    fleet_rates,
    follow_sequences,
    unseen_prefills,
)
from router.fleet.others import OTHERS_SEEN_S
from router.fleet.registry import BackendRegistry
from support.snapshots import registry_view

_hashes = itertools.count(1_000_000)


def grow(seqs: EventSequences, chain: list[int], now: float, blocks: int = 1) -> None:
    """The engine stored `blocks` more blocks (new hashes) of the sequence whose blocks are `chain`."""
    parent = chain[-1] if chain else None
    new = [next(_hashes) for _ in range(blocks)]
    chain.extend(new)
    seqs.stored(parent, new, now)


def test_a_prompt_the_router_did_not_send_is_others_sequence_while_it_grows() -> None:
    seqs = EventSequences()
    chain: list[int] = [7]  # a prompt whose first block another prompt already stored
    grow(seqs, chain, 0.0, blocks=4)
    assert seqs.began_others == 1
    assert seqs.others_running(0.0) == 1
    assert seqs.others_seen(0.0)
    window = WINDOW_BLOCKS * PRIOR_BLOCK_S
    grow(seqs, chain, 0.9 * window)  # a decoded block, within the window
    assert seqs.others_running(1.8 * window) == 1
    # It stopped growing (finished): no longer running after a window, still seen.
    assert seqs.others_running(2.0 * window) == 0
    assert seqs.others_seen(2.0 * window)
    assert not seqs.others_seen(0.9 * window + OTHERS_SEEN_S + 1.0)


def test_the_routers_own_legs_begin_chains_of_their_own() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)  # a leg sent to prefill
    seqs.owe(0.0)
    a: list[int] = []
    b: list[int] = [3]
    grow(seqs, a, 0.1, blocks=8)
    grow(seqs, b, 0.1, blocks=2)
    grow(seqs, a, 0.2)
    assert (seqs.began_others, seqs.others_running(0.2)) == (0, 0)
    c: list[int] = []
    grow(seqs, c, 0.3, blocks=2)  # a third: no credit left
    assert (seqs.began_others, seqs.others_running(0.3)) == (1, 1)


def test_a_credit_at_the_first_token_claims_the_beginning_its_event_announced_first() -> None:
    seqs = EventSequences()
    chain: list[int] = []
    grow(seqs, chain, 1.0, blocks=3)  # the probe's acceptor stored its blocks...
    assert seqs.others_running(1.0) == 1
    seqs.owe(1.0 + REPAY_S / 2, at_first_token=True)  # ... and its first token came after
    assert (seqs.began_others, seqs.others_running(1.0 + REPAY_S / 2)) == (0, 0)
    grow(seqs, chain, 1.1 + REPAY_S / 2)  # its decoded blocks stay the router's
    assert seqs.others_running(1.1 + REPAY_S / 2) == 0


def test_a_credit_claims_no_beginning_older_than_the_repay_time_and_stays_for_the_next() -> None:
    seqs = EventSequences()
    grow(seqs, [], 0.0, blocks=2)
    seqs.owe(REPAY_S + 0.1, at_first_token=True)
    assert seqs.began_others == 1
    grow(seqs, [], REPAY_S + 0.2, blocks=2)  # the leg's own chain, when it comes
    assert seqs.began_others == 1


def test_a_leg_that_ends_before_its_blocks_leaves_its_credit_for_the_grace_time() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)
    seqs.settle(1.0)  # ended; its blocks' event still on its way
    grow(seqs, [], 1.0 + GRACE_S / 2, blocks=2)
    assert seqs.began_others == 0
    seqs.owe(2.0)
    seqs.settle(2.0)
    assert seqs.owed(2.0) == 1
    assert seqs.owed(2.0 + GRACE_S + 0.1) == 0
    grow(seqs, [], 2.0 + GRACE_S + 0.1, blocks=2)  # too late to be that leg's
    assert seqs.began_others == 1


def test_a_leg_whose_chain_began_leaves_no_credit_when_it_ends() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)
    grow(seqs, [], 0.1, blocks=2)
    seqs.settle(0.2)
    grow(seqs, [], 0.3, blocks=2)
    assert seqs.began_others == 1


def test_the_window_follows_the_measured_time_between_decoded_blocks() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)
    chain: list[int] = []
    grow(seqs, chain, 0.0, blocks=10)  # the prompt: many blocks at once, no sample
    assert seqs.block_samples == 0
    t = 0.0
    for _ in range(60):
        t += 0.1
        grow(seqs, chain, t)
    assert seqs.block_s == pytest.approx(0.1, rel=0.01)
    assert seqs.window_s == pytest.approx(WINDOW_BLOCKS * 0.1, rel=0.01)
    other: list[int] = []
    grow(seqs, other, t, blocks=2)
    assert seqs.others_running(t + 0.15) == 1
    assert seqs.others_running(t + 0.25) == 0


def test_others_chain_taken_up_again_after_the_window_is_a_new_beginning() -> None:
    seqs = EventSequences()
    chain: list[int] = []
    grow(seqs, chain, 0.0, blocks=2)  # another replica's turn of a conversation
    later = 10.0
    seqs.owe(later)  # the next turn, through this router
    grow(seqs, chain, later, blocks=2)
    assert seqs.began_others == 1
    assert seqs.others_running(later) == 0


def test_the_routers_own_chain_that_grows_late_stays_its_own() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)
    chain: list[int] = []
    grow(seqs, chain, 0.0, blocks=2)
    grow(seqs, chain, RETAIN_S / 2)  # slow, past any window, but remembered
    assert seqs.began_others == 0


def test_a_cleared_cache_ends_every_chain() -> None:
    seqs = EventSequences()
    grow(seqs, [], 0.0, blocks=2)
    seqs.cleared()
    assert seqs.others_running(0.0) == 0


def test_a_live_batch_counts_gpu_blocks_of_the_first_group_only() -> None:
    seqs = EventSequences()

    def stored(parent: int | None, hashes: list[int], medium: str | None = "GPU", group: int | None = 0) -> object:
        return SimpleNamespace(
            kind="stored", block_hashes=hashes, parent_block_hash=parent, medium=medium, group_idx=group, block_size=16
        )

    events = [
        stored(None, [1, 2]),
        stored(None, [5], medium="CPU"),  # a CPU tier's copy
        stored(None, [6], group=1),  # another KV-cache group of the same sequence
        stored(2, [3]),  # the first chain grows
        SimpleNamespace(kind="removed", block_hashes=[1], medium="GPU", group_idx=0),
    ]
    follow_sequences(seqs, events, 0.0)
    assert (seqs.began_others, seqs.others_running(0.0)) == (1, 1)
    follow_sequences(seqs, [SimpleNamespace(kind="cleared")], 0.0)
    assert seqs.others_running(0.0) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.floats(0.0, 0.3), st.integers(1, 4)),
        min_size=1,
        max_size=40,
    )
)
def test_with_one_router_every_chain_its_legs_begin_is_its_own(
    steps: list[tuple[int, float, int]],
) -> None:
    """Any interleaving of this router's legs (each sent, storing its blocks, decoding, and
    ending) counts nothing as others' when every leg's chain begins while it is open."""
    seqs = EventSequences()
    chains: dict[int, list[int]] = {}
    now = 0.0
    for leg, dt, blocks in steps:
        now += dt
        if leg not in chains:
            seqs.owe(now)
            chains[leg] = [leg * 10_000_000]  # after a prefix of its own
        grow(seqs, chains[leg], now, blocks)
    for _ in chains:
        seqs.settle(now)
    assert seqs.began_others == 0
    assert seqs.others_running(now) == 0


def test_others_prompts_still_computing_are_expected_from_the_rate_they_began_at() -> None:
    seqs = EventSequences()
    assert unseen_prefills(seqs.others_rates(0.0), (0.0, 0.0), 0.02, 1e-4) == 0.0  # nobody else seen
    for i in range(10):  # ten prompts of others over 5 s, 2,048 tokens computed each
        seqs.stored(None, list(range(i * 100, i * 100 + 64)), i * 0.5, tokens=2048)
    rate = unseen_prefills(seqs.others_rates(5.0), (0.0, 0.0), 0.02, 1e-4)
    # ~2 a second: ~2 * (20 ms + 2,048 tokens at 0.1 ms) = ~0.45 computing at any moment.
    assert 0.3 < rate < 0.6
    seqs.owe(4.5 + REPAY_S / 2, at_first_token=True)  # the last one was this router's after all
    assert unseen_prefills(seqs.others_rates(4.5 + REPAY_S / 2), (0.0, 0.0), 0.02, 1e-4) < rate
    assert unseen_prefills(seqs.others_rates(4.5 + OTHERS_SEEN_S + 1.0), (0.0, 0.0), 0.02, 1e-4) == 0.0


def test_sequences_the_kv_events_show_beyond_our_own_legs_are_other_replicas() -> None:
    """Between scrapes, a chain of stored blocks that none of this router's legs began is
    another replica's sequence: counted decoding on the engine, which serves others' traffic."""
    now = [0.0]
    r = BackendRegistry(
        [BackendConfig("d0", "http://d0", kv_events_endpoint="tcp://d0:5557")], HealthConfig(), clock=lambda: now[0]
    )
    seqs = r.states["d0"].sequences
    mine = r.open_leg("d0", 500)  # it will store blocks: it owes a chain
    probe = r.open_leg("d0", 0)  # a probe owes one only once taken, at its first token
    seqs.stored(None, list(range(1000, 1004)), now[0])  # mine's prompt
    view = registry_view(r, "d0")
    assert (view.decoding, view.others_seen) == (0.0, False)
    r.first_token(mine)
    r.first_token(probe)  # taken: its chain, whenever it comes, is ours too
    seqs.stored(9, list(range(2000, 2002)), now[0])
    assert registry_view(r, "d0").decoding == 2.0
    seqs.stored(None, list(range(3000, 3004)), now[0], tokens=64)  # nobody's leg here: another replica's
    # ... and, as others begin prompts there, some are expected computing unseen.
    speed = r.learner.speed("d0")
    unseen = unseen_prefills(seqs.others_rates(now[0]), (0.0, 0.0), speed.intercept_s, speed.per_token_s)
    assert unseen == pytest.approx(1.0 * speed.intercept_s + 64 * speed.per_token_s)  # one, over 1 s at least
    view = registry_view(r, "d0")
    assert view.decoding == pytest.approx(3.0 + unseen)
    assert view.others_seen
    r.close_leg(mine)
    r.close_leg(probe)
    assert registry_view(r, "d0").decoding == pytest.approx(1.0 + unseen)
    now[0] = 10.0  # it stopped growing: finished; the rate of others' prompts decays
    view = registry_view(r, "d0")
    assert view.decoding < unseen
    assert view.others_seen
    now[0] = 100.0  # nobody else's traffic for a while: nothing expected
    assert registry_view(r, "d0").decoding == 0.0


def test_without_kv_events_legs_owe_no_chains() -> None:
    r = BackendRegistry([BackendConfig("d0", "http://d0")], HealthConfig(), clock=lambda: 0.0)
    t = r.open_leg("d0", 500)
    r.first_token(t)
    assert not t.owes_chain


def test_a_race_leg_dropped_once_its_engine_took_it_owes_the_chain_it_may_have_begun() -> None:
    now = [0.0]
    r = BackendRegistry(
        [BackendConfig("d0", "http://d0", kv_events_endpoint="tcp://d0:5557")], HealthConfig(), clock=lambda: now[0]
    )
    seqs = r.states["d0"].sequences
    loser = r.open_leg("d0", 0)
    seqs.stored(None, list(range(1000, 1002)), now[0])  # its blocks, before the race dropped it
    assert seqs.began_others == 1
    r.close_leg(loser)
    r.may_have_stored([loser, None])
    assert seqs.began_others == 0
    expired = r.open_leg("d0", 0)
    r.close_leg(expired)
    r.may_have_stored([expired])
    r.may_have_stored([expired])  # owed once
    now[0] = GRACE_S / 2
    seqs.stored(None, list(range(2000, 2002)), now[0])  # its blocks, after the race dropped it
    seqs.stored(None, list(range(3000, 3002)), now[0])  # and somebody else's
    assert seqs.began_others == 1


def test_blocks_stored_again_are_the_same_sequence_computing_again_not_a_beginning() -> None:
    seqs = EventSequences()
    seqs.owe(0.0)
    chain: list[int] = []
    grow(seqs, chain, 0.0, blocks=6)  # this router's prompt
    grow(seqs, chain, 0.1)
    # Preempted, its last blocks evicted; computed again, they are stored again after the
    # prefix it kept: the same hashes.
    seqs.stored(chain[3], chain[4:], 0.5)
    assert seqs.began_others == 0
    assert seqs.others_running(0.5) == 0
    theirs: list[int] = []
    grow(seqs, theirs, 1.0, blocks=3)  # another replica's
    seqs.stored(None, theirs, 1.2)  # computed again: still theirs, still one sequence
    assert (seqs.began_others, seqs.others_running(1.2)) == (1, 1)
    seqs.owe(1.3)  # a leg of this router sent a prompt of the same tokens
    seqs.stored(None, theirs, 1.4)  # after the engine evicted them: this router's now
    assert seqs.others_running(1.4) == 0


def test_an_engine_that_shows_none_of_others_prompts_expects_the_decoders_mean() -> None:
    busy, quiet = EventSequences(), EventSequences()
    for i in range(4):  # others began four 2,048-token prompts on one engine, none on the other
        busy.stored(None, list(range(i * 100, i * 100 + 64)), 0.25 * i, tokens=2048)
    fleet = fleet_rates([busy.others_rates(1.0), quiet.others_rates(1.0)])
    assert fleet == pytest.approx((busy.others_rates(1.0)[0] / 2, busy.others_rates(1.0)[1] / 2))
    assert unseen_prefills(quiet.others_rates(1.0), (0.0, 0.0), 0.02, 1e-4) == 0.0
    expected = unseen_prefills(quiet.others_rates(1.0), fleet, 0.02, 1e-4)
    assert expected == pytest.approx(fleet[0] * 0.02 + fleet[1] * 1e-4)
    assert unseen_prefills(busy.others_rates(1.0), fleet, 0.02, 1e-4) > expected  # its own rate, higher
    assert fleet_rates([]) == (0.0, 0.0)
