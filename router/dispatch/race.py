"""The probe race: ask several engines at once, keep the first that accepts.

Each probe reads its engine's stream until it knows the verdict: the first chunk that
carries text, token ids or a finish reason decides (a chat stream's role-only chunk does
not). `finish_reason == "cache_threshold"` with no tokens is a rejection; anything else is
an acceptance. The first acceptor wins and keeps its open stream plus the chunks read so
far; every other probe is aborted at once (closing the connection makes the engine abort
the request). If nobody has accepted by the deadline, the silent engines are aborted and
count as expired (a rejection for the fallback's purposes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.engine.errors import UpstreamError
from router.engine.stream import UpstreamStream
from router.engine.wire import generated_tokens, is_rejection_chunk, message_usage
from router.names import Verdict


@dataclass
class ProbeOutcome:
    backend: str
    verdict: Verdict
    latency_s: float = 0.0
    stream: UpstreamStream | None = None
    buffered: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int | None = None
    # A rejection's prompt_tokens_details.cached_tokens: how much of the prompt the engine
    # holds (the threshold plugin and the simulator report it; plain vLLM says 0).
    hit_tokens: int | None = None
    error: UpstreamError | None = None

    @property
    def tokens_seen(self) -> int:
        return sum(generated_tokens(c) for c in self.buffered)


@dataclass
class RaceResult:
    winner: ProbeOutcome | None
    outcomes: list[ProbeOutcome]

    def dropped(self) -> list[str]:
        """Engines whose probe was dropped once they may have begun on it (lost, expired)."""
        return [o.backend for o in self.outcomes if o.verdict in (Verdict.LOST, Verdict.EXPIRED)]

    def by_verdict(self, verdict: Verdict) -> list[ProbeOutcome]:
        return [o for o in self.outcomes if o.verdict == verdict]

    @property
    def prompt_tokens(self) -> int | None:
        known = [o.prompt_tokens for o in self.outcomes if o.prompt_tokens is not None]
        return max(known) if known else None

    @property
    def hits(self) -> dict[str, int]:
        """Backend -> prompt tokens it holds, from the rejections that said so."""
        return {o.backend: o.hit_tokens for o in self.outcomes if o.hit_tokens}

    @property
    def client_error(self) -> UpstreamError | None:
        """An engine refused the request itself (4xx): the same request fails everywhere."""
        for o in self.outcomes:
            if o.error is not None and o.error.client_fault:
                return o.error
        return None


OpenProbe = Callable[[str], Awaitable[UpstreamStream]]


async def _probe(backend: str, open_probe: OpenProbe, loop: asyncio.AbstractEventLoop) -> ProbeOutcome:
    t0 = loop.time()
    stream: UpstreamStream | None = None
    try:
        stream = await open_probe(backend)
        buffered: list[dict[str, Any]] = []
        while True:
            chunk = await stream.next_chunk()
            if chunk is None:
                # [DONE] before any verdict: the engine finished without output (e.g. the
                # usage chunk only). That is an answer, so it counts as acceptance.
                stream.finish()
                return ProbeOutcome(backend, Verdict.ACCEPTED, loop.time() - t0, stream, buffered)
            buffered.append(chunk)
            verdict = is_rejection_chunk(chunk)
            if verdict is None:
                continue
            if not verdict:
                return ProbeOutcome(backend, Verdict.ACCEPTED, loop.time() - t0, stream, buffered)
            latency = loop.time() - t0
            # Rejected. The usage chunk follows at once; read it for the prompt length
            # (the fallback needs it), then hand the connection back to the pool.
            usage = message_usage(chunk)
            prompt_tokens, hit_tokens = usage.prompt_tokens, usage.cached_tokens
            for _ in range(4):  # a rejection is followed by the usage chunk and [DONE] only
                more = await stream.next_chunk()
                if more is None:
                    stream.finish()
                    break
                usage = message_usage(more)
                prompt_tokens = prompt_tokens or usage.prompt_tokens
                hit_tokens = hit_tokens if hit_tokens is not None else usage.cached_tokens
            else:
                stream.abort()
            return ProbeOutcome(backend, Verdict.REJECTED, latency, prompt_tokens=prompt_tokens, hit_tokens=hit_tokens)
    except UpstreamError as e:
        if stream is not None:
            stream.abort()
        return ProbeOutcome(backend, Verdict.FAILED, loop.time() - t0, error=e)
    except BaseException:
        # Cancelled (a winner was chosen, the deadline passed, or the client left).
        if stream is not None:
            stream.abort()
        raise


async def run_race(
    backends: Sequence[str], open_probe: OpenProbe, deadline_s: float | None, deadline_per_prompt_token_s: float = 0.0
) -> RaceResult:
    """Race `backends`; see the module docstring. Cancelling the caller aborts every probe.

    `deadline_s` None: a race of one engine bounded by its leg's own timeouts (the stream's
    first-token and idle deadlines), with no timer of the race's own.

    `deadline_per_prompt_token_s`: once a rejection reports the prompt's length, the
    deadline becomes `deadline_s + prompt_tokens * deadline_per_prompt_token_s`, the time
    an accepting engine may still need to prefill what it lacks before its first chunk.
    """
    loop = asyncio.get_running_loop()
    if len(backends) == 1:
        return await _run_one(backends[0], open_probe, loop, deadline_s)
    assert deadline_s is not None, "a race of several engines needs a deadline"
    tasks = {asyncio.ensure_future(_probe(b, open_probe, loop)): b for b in backends}
    try:
        return await _settle(tasks, loop, deadline_s, deadline_per_prompt_token_s)
    except BaseException:
        # The caller was cancelled (its client hung up, the drain ran out). A probe may
        # have accepted without the race having looked at it yet, or the winner may be
        # chosen while the losers are being stopped: nobody will read, finish or abort
        # those streams, and each would hold its backend's in-flight count for good.
        _abort_all(tasks)
        raise


async def _run_one(
    backend: str, open_probe: OpenProbe, loop: asyncio.AbstractEventLoop, deadline_s: float | None
) -> RaceResult:
    """A race of one engine (every leg but a probe race's): the same verdicts, with the
    probe run in the caller's task under the deadline instead of in a task of its own
    settled by asyncio.wait (a task, a future and their callbacks less per request). A
    rejection cannot extend a deadline here: there is nobody else to wait for. Without a
    deadline the leg's own timers bound it (an `asyncio.timeout` costs ~14 us a request)."""
    if deadline_s is None:
        outcome = await _probe(backend, open_probe, loop)
        return RaceResult(outcome if outcome.verdict == Verdict.ACCEPTED else None, [outcome])
    started = loop.time()
    limit = asyncio.timeout_at(started + deadline_s)
    try:
        async with limit:
            outcome = await _probe(backend, open_probe, loop)  # aborts its stream if cancelled
    except TimeoutError:
        if not limit.expired():
            raise
        return RaceResult(None, [ProbeOutcome(backend, Verdict.EXPIRED, loop.time() - started)])
    return RaceResult(outcome if outcome.verdict == Verdict.ACCEPTED else None, [outcome])


def _abort_all(tasks: Iterable[asyncio.Future[ProbeOutcome]]) -> None:
    for t in tasks:
        if not t.done():
            t.cancel()  # the probe aborts its own stream
        elif not t.cancelled() and t.exception() is None:
            stream = t.result().stream
            if stream is not None:
                stream.abort()


async def _settle(
    tasks: dict[asyncio.Task[ProbeOutcome], str],
    loop: asyncio.AbstractEventLoop,
    deadline_s: float,
    deadline_per_prompt_token_s: float,
) -> RaceResult:
    outcomes: list[ProbeOutcome] = []
    winner: ProbeOutcome | None = None
    started = loop.time()
    deadline = started + deadline_s
    extended = False
    pending = set(tasks)
    try:
        while pending and winner is None:
            timeout = deadline - loop.time()
            if timeout <= 0:
                break
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            # Several may finish in one wake-up: the fastest acceptor wins, others lose.
            for t in sorted(done, key=lambda t: t.result().latency_s):
                o = t.result()
                if o.verdict == Verdict.ACCEPTED and winner is None:
                    winner = o
                elif o.verdict == Verdict.ACCEPTED:
                    o.verdict = Verdict.LOST
                    if o.stream is not None:
                        o.stream.abort()
                    o.stream = None
                elif o.verdict == Verdict.REJECTED and o.prompt_tokens and deadline_per_prompt_token_s and not extended:
                    deadline += o.prompt_tokens * deadline_per_prompt_token_s
                    extended = True
                outcomes.append(o)
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            _abort_all(pending)  # one that answered as it was being cancelled
    # Probes that had not answered: lost to the winner, or expired at the deadline.
    for t in pending:
        outcomes.append(ProbeOutcome(tasks[t], Verdict.LOST if winner else Verdict.EXPIRED, loop.time() - started))
    return RaceResult(winner, outcomes)
