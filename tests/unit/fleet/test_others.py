"""Traffic this router did not send, from scrapes (router/fleet/others.py)."""

from __future__ import annotations

import pytest

from router.fleet.others import MEAN_WEIGHT, OTHERS_SEEN_S, OthersLoad


def test_a_scrape_less_the_routers_own_legs_is_others_waiting_first_then_running() -> None:
    o = OthersLoad()
    # 3 waiting and 5 running; the router's own legs: 1 prefilling, 2 decoding.
    o.observe(running=5.0, waiting=3.0, own_prefilling=1.0, own_decoding=2.0, now=10.0)
    assert (o.waiting, o.running) == (2.0, 3.0)
    assert o.seen(10.0 + OTHERS_SEEN_S)
    assert not o.seen(10.0 + OTHERS_SEEN_S + 1.0)


def test_the_routers_own_legs_alone_are_nobody_elses() -> None:
    o = OthersLoad()
    o.observe(running=2.0, waiting=1.0, own_prefilling=1.0, own_decoding=2.0, now=0.0)
    assert (o.waiting, o.running, o.running_mean) == (0.0, 0.0, 0.0)
    assert not o.seen(0.0)
    assert o.decoding(0.0) == 0.0


def test_where_others_run_their_decoding_is_at_least_the_mean_of_recent_scrapes() -> None:
    o = OthersLoad()
    o.observe(running=1.0, waiting=0.0, own_prefilling=0.0, own_decoding=0.0, now=0.0)
    o.observe(running=1.0, waiting=0.0, own_prefilling=0.0, own_decoding=0.0, now=0.5)
    mean = MEAN_WEIGHT + (1.0 - MEAN_WEIGHT) * MEAN_WEIGHT
    assert o.running_mean == pytest.approx(mean)
    assert o.decoding(0.5) == 1.0  # the last scrape saw one: that one
    # The next scrape sees none: a sequence another replica starts meanwhile is unseen
    # until the one after, so the mean stands in for them.
    o.observe(running=0.0, waiting=0.0, own_prefilling=0.0, own_decoding=0.0, now=1.0)
    assert o.running == 0.0
    assert o.decoding(1.0) == pytest.approx(mean * (1.0 - MEAN_WEIGHT))
    # Once the engine has served nobody else's traffic for a while, the last scrape alone.
    assert o.decoding(0.5 + OTHERS_SEEN_S + 1.0) == 0.0
