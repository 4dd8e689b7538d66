"""The probe race (router/dispatch/race.py) over scripted engines: who wins, what every probe
answered, what happens to the streams nobody reads, and the deadline."""

from __future__ import annotations

import asyncio

from router.dispatch.race import run_race
from router.engine.errors import BROKEN, CONNECT, FIRST_TOKEN_TIMEOUT, UpstreamError
from router.names import Verdict
from support.fake_upstream import HANG, FakeUpstream, Pause, rejection, token
from support.polling import eventually


async def test_the_first_acceptor_wins_and_the_others_are_stopped() -> None:
    up = FakeUpstream(
        {
            "fast": [[token("Hi", [7]), token("!", [8], finish="stop")]],
            "slow": [[Pause(0.2), token("Hi", [7])]],
            "silent": [[HANG]],
        }
    )
    result = await run_race(("fast", "slow", "silent"), up.opener(), 5.0)
    assert result.winner is not None
    assert result.winner.backend == "fast"
    assert result.winner.verdict == Verdict.ACCEPTED
    # The winner keeps its open stream and the chunks the race read.
    assert result.winner.buffered == [token("Hi", [7])]
    winner_stream, *others = up.streams
    assert not winner_stream.closed
    assert {o.backend: o.verdict for o in result.outcomes} == {
        "fast": Verdict.ACCEPTED,
        "slow": Verdict.LOST,
        "silent": Verdict.LOST,
    }
    assert all(s.aborted for s in others)
    assert sorted(result.dropped()) == ["silent", "slow"]  # they may have begun computing


async def test_two_acceptors_in_one_wake_up_one_wins_the_other_is_closed() -> None:
    up = FakeUpstream({"a": [[token("x", [1])]], "b": [[token("y", [2])]]})
    result = await run_race(("a", "b"), up.opener(), 5.0)
    loser = next(o for o in result.outcomes if o is not result.winner)
    assert loser.verdict == Verdict.LOST
    assert loser.stream is None
    assert loser.tokens_seen == 1  # read before it lost: tokens generated for nothing
    assert [s.aborted for s in up.streams if s.backend == loser.backend] == [True]
    assert result.winner is not None
    assert [s.closed for s in up.streams if s.backend == result.winner.backend] == [False]


async def test_all_reject_every_verdict_is_reported() -> None:
    up = FakeUpstream({"d0": [rejection(100, 0)], "d1": [rejection(100, 64)], "d2": [rejection(100, 20)]})
    result = await run_race(("d0", "d1", "d2"), up.opener(), 5.0)
    assert result.winner is None
    assert sorted((o.backend, o.verdict) for o in result.outcomes) == [
        ("d0", Verdict.REJECTED),
        ("d1", Verdict.REJECTED),
        ("d2", Verdict.REJECTED),
    ]
    assert result.prompt_tokens == 100
    assert result.hits == {"d1": 64, "d2": 20}
    # A rejection's connection is read to [DONE] and handed back, not dropped.
    assert all(s.finished and not s.aborted for s in up.streams)


async def test_an_upstream_error_in_one_probe_does_not_lose_the_race_for_the_others() -> None:
    up = FakeUpstream(
        {
            "refused": [UpstreamError("refused", CONNECT, "connection refused")],
            "broken": [[UpstreamError("broken", BROKEN, "stream ended without [DONE]")]],
            "ok": [[Pause(0.05), token("Hi", [7])]],
        }
    )
    result = await run_race(("refused", "broken", "ok"), up.opener(), 5.0)
    assert result.winner is not None
    assert result.winner.backend == "ok"
    verdicts = {o.backend: o for o in result.outcomes}
    assert verdicts["refused"].verdict == Verdict.FAILED
    refused, broken = verdicts["refused"].error, verdicts["broken"].error
    assert refused is not None
    assert refused.kind == CONNECT
    assert verdicts["broken"].verdict == Verdict.FAILED
    assert broken is not None
    assert broken.kind == BROKEN
    assert result.client_error is None
    broken_stream = next(s for s in up.streams if s.backend == "broken")
    assert broken_stream.aborted


async def test_silent_engines_expire_at_the_deadline() -> None:
    up = FakeUpstream({"d0": [rejection(100, 0)], "d1": [[HANG]]})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await run_race(("d0", "d1"), up.opener(), 0.1)
    assert 0.1 <= loop.time() - t0 < 1.0
    assert result.winner is None
    assert {o.backend: o.verdict for o in result.outcomes} == {"d0": Verdict.REJECTED, "d1": Verdict.EXPIRED}
    assert next(s for s in up.streams if s.backend == "d1").aborted
    assert result.dropped() == ["d1"]  # a rejection computed nothing


async def test_a_rejection_reporting_the_prompt_length_extends_the_deadline() -> None:
    # 0.05 s floor + 1,000 prompt tokens * 0.2 ms: an acceptor answering at 0.15 s wins.
    up = FakeUpstream({"d0": [rejection(1000, 0)], "d1": [[Pause(0.15), token("Hi", [7])]]})
    result = await run_race(("d0", "d1"), up.opener(), 0.05, deadline_per_prompt_token_s=0.0002)
    assert result.winner is not None
    assert result.winner.backend == "d1"
    # Without the extension the same acceptor is cut off.
    up = FakeUpstream({"d0": [rejection(1000, 0)], "d1": [[Pause(0.15), token("Hi", [7])]]})
    result = await run_race(("d0", "d1"), up.opener(), 0.05)
    assert result.winner is None
    assert {o.backend: o.verdict for o in result.outcomes} == {"d0": Verdict.REJECTED, "d1": Verdict.EXPIRED}


async def test_cancelling_the_race_closes_every_stream() -> None:
    up = FakeUpstream({"d0": [[HANG]], "d1": [[HANG]]})
    race = asyncio.ensure_future(run_race(("d0", "d1"), up.opener(), 5.0))
    await eventually(lambda: len(up.streams) == 2, 5, "both probe streams open")
    race.cancel()
    await asyncio.gather(race, return_exceptions=True)
    assert len(up.streams) == 2
    assert all(s.aborted for s in up.streams)


async def test_a_race_of_one_engine_gives_the_verdicts_of_a_race_of_many() -> None:
    # One engine (every leg but a probe race's) is run in the caller's task, not settled
    # among tasks: the same outcomes.
    up = FakeUpstream({"a": [[token("Hi", [7]), token("!", [8], finish="stop")]], "r": [rejection(100, 40)]})
    accepted = await run_race(("a",), up.opener(), 5.0)
    assert accepted.winner is not None
    assert accepted.winner.buffered == [token("Hi", [7])]
    assert [(o.backend, o.verdict) for o in accepted.outcomes] == [("a", Verdict.ACCEPTED)]
    assert not up.streams[0].closed
    rejected = await run_race(("r",), up.opener(), 5.0)
    assert rejected.winner is None
    assert [(o.backend, o.verdict) for o in rejected.outcomes] == [("r", Verdict.REJECTED)]
    assert rejected.prompt_tokens == 100
    assert rejected.hits == {"r": 40}


async def test_a_race_of_one_silent_engine_expires_and_its_stream_is_aborted() -> None:
    up = FakeUpstream({"s": [[HANG]]})
    result = await run_race(("s",), up.opener(), 0.05)
    assert result.winner is None
    assert [(o.backend, o.verdict) for o in result.outcomes] == [("s", Verdict.EXPIRED)]
    assert up.streams[0].aborted


async def test_cancelling_a_race_of_one_closes_its_stream() -> None:
    up = FakeUpstream({"s": [[HANG]]})
    race = asyncio.ensure_future(run_race(("s",), up.opener(), 5.0))
    await eventually(lambda: len(up.streams) == 1, 5, "the probe stream open")
    race.cancel()
    await asyncio.gather(race, return_exceptions=True)
    assert up.streams[0].aborted


async def test_a_race_of_one_without_a_deadline_is_bounded_by_its_legs_own_timeouts() -> None:
    # A fallback's decode leg: no timer of the race's own; the stream's first-token
    # deadline is what ends a silent engine, and it is reported as that leg's failure.
    up = FakeUpstream(
        {
            "a": [[token("Hi", [7]), token("!", [8], finish="stop")]],
            "r": [rejection(100, 40)],
            "slow": [[UpstreamError("slow", FIRST_TOKEN_TIMEOUT, "no data from the engine in time")]],
        }
    )
    accepted = await run_race(("a",), up.opener(), None)
    assert accepted.winner is not None
    assert [(o.backend, o.verdict) for o in accepted.outcomes] == [("a", Verdict.ACCEPTED)]
    rejected = await run_race(("r",), up.opener(), None)
    assert [(o.backend, o.verdict) for o in rejected.outcomes] == [("r", Verdict.REJECTED)]
    assert rejected.hits == {"r": 40}
    timed_out = await run_race(("slow",), up.opener(), None)
    assert timed_out.winner is None
    (outcome,) = timed_out.outcomes
    assert outcome.verdict == Verdict.FAILED
    assert outcome.error is not None
    assert outcome.error.kind == FIRST_TOKEN_TIMEOUT
    assert up.streams[-1].aborted
