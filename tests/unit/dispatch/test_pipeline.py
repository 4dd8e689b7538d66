"""The Dispatcher (router/dispatch/pipeline.py, router/dispatch/placement.py) over scripted engines.

The upstream client is faked at its interface (support/fake_upstream.py); the planner is a
fixed one (race every decode engine not kept out, or send to the first), so what is checked
is the pipeline: probe hit, fallback after a race nobody won (direct or prefill/decode, as
`plan_fallback` decides), retries before the first token, resume after a broken leg, and
the request's record and metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import orjson
import pytest

from router.admission.spec import parse_request
from router.answer.shaper import ResponseShaper
from router.config.parse import parse_config
from router.dispatch.pipeline import Dispatcher
from router.engine.errors import BROKEN, CONNECT, FIRST_TOKEN_TIMEOUT, UpstreamError
from router.errors import RouterError
from router.fleet.registry import BackendRegistry
from router.observability.metrics import RouterMetrics
from router.observability.record import RequestRecord
from router.routing.planning import Plan, RouteQuery
from router.routing.snapshot import ClusterSnapshot
from support.fake_upstream import FakeUpstream, Pause, answer, rejection, token
from support.metrics import registry_metrics

if TYPE_CHECKING:
    from router.engine.client import UpstreamClient

PROMPT_IDS = [11, 12, 13]


class FixedPlanner:
    """Races every decode engine not kept out; `direct`: sends to the first of them."""

    name = "probe"
    reads_index = False

    def __init__(self, direct: bool = False) -> None:
        self.direct = direct
        self.routed: list[str] = []

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        names = tuple(b.name for b in snap.decoders(query.model) if b.name not in exclude)
        if not names:
            return Plan()
        if self.direct:
            return Plan(direct=names[0], prefill_tokens=len(PROMPT_IDS), predicted_ttft_s=0.01)
        return Plan(
            probes=names,
            threshold=0.5,
            deadline_s=1.0,
            probe_ttft_s=tuple(0.01 for _ in names),
            cold=names[0],
            cold_ttft_s=0.01,
        )

    def on_routed(self, query: RouteQuery, backend: str) -> None:
        self.routed.append(backend)

    def expected_hits(
        self, query: RouteQuery, prompt_tokens: float | None, sent_since: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        return {}


class Harness:
    def __init__(
        self, up: FakeUpstream, backends: dict[str, str], planner: FixedPlanner, routing: dict[str, Any]
    ) -> None:
        config = parse_config(
            {
                "backends": [
                    {"name": n, "url": f"http://{n}.test", "role": role, "models": ["m"]}
                    for n, role in backends.items()
                ],
                "routing": routing,
            }
        )
        self.registry = BackendRegistry(config.all_backends(), config.health)
        for state in self.registry.states.values():
            state.healthy = True
        self.metrics = RouterMetrics()
        self.up = up
        self.planner = planner
        # FakeUpstream has UpstreamClient's interface (support/fake_upstream.py).
        self.dispatcher = Dispatcher(config, self.registry, cast("UpstreamClient", up), planner)
        self.emitted: list[dict[str, Any]] = []

    async def serve(self, max_tokens: int = 16) -> RequestRecord:
        spec = parse_request(
            "completions", orjson.dumps({"model": "m", "prompt": PROMPT_IDS, "max_tokens": max_tokens, "stream": True})
        )
        shaper = ResponseShaper(spec)
        rec = RequestRecord(request_id=spec.request_id, endpoint="completions", model="m", stream=True)

        async def emit(chunks: list[dict[str, Any]]) -> None:
            self.emitted += chunks

        try:
            await self.dispatcher.serve(spec, shaper, emit, rec)
            self.emitted += shaper.final_chunks()
        finally:
            self.metrics.record(rec)
        return rec

    def metric(self, name: str, **labels: str) -> float:
        return registry_metrics(self.metrics.registry).value(name, **labels)

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.emitted if c.get("choices"))

    @property
    def in_flight(self) -> dict[str, int]:
        return {n: s.inflight for n, s in self.registry.states.items()}


def harness(
    scripts: dict[str, Any],
    backends: dict[str, str] | None = None,
    planner: FixedPlanner | None = None,
    **routing: Any,
) -> Harness:
    return Harness(
        FakeUpstream(scripts), backends or {"d0": "decode", "d1": "decode"}, planner or FixedPlanner(), routing
    )


async def test_a_probe_hit_answers_from_the_acceptor() -> None:
    h = harness({"d0": [rejection(3, 0)], "d1": [answer(PROMPT_IDS, [("Hello", 1), (" world", 2)], cached=3)]})
    rec = await h.serve()
    assert h.text == "Hello world"
    assert (rec.route, rec.winner, rec.legs) == ("probe_hit", "d1", ["probe_hit:d1"])
    assert (rec.probes, rec.rejections, rec.rejected_hits) == (2, 1, {"d0": 0})
    # Both probes carried the threshold; the acceptor's stream was the answer: no other leg.
    assert [c.body["cache_hit_threshold"] for c in h.up.calls] == [0.5, 0.5]
    assert h.planner.routed == ["d1"]
    assert h.metric("cachehit_router_probe_rejections_total", backend="d0") == 1
    assert h.metric("cachehit_router_probe_verdict_seconds_count") == 2
    assert h.in_flight == {"d0": 0, "d1": 0}


async def test_all_reject_the_prompt_is_computed_on_the_engine_holding_most_of_it() -> None:
    h = harness({"d0": [rejection(300, 0)], "d1": [rejection(300, 120), answer(PROMPT_IDS, [("Hi", 1)], cached=120)]})
    rec = await h.serve()
    assert h.text == "Hi"
    assert (rec.route, rec.winner, rec.prefill) == ("direct", "d1", "")
    assert rec.rejected_hits == {"d0": 0, "d1": 120}
    fallback_leg = h.up.legs_to("d1")[-1]
    assert fallback_leg.body["cache_hit_threshold"] == 0.0
    assert "kv_transfer_params" not in fallback_leg.body
    assert rec.probes == 2
    assert rec.rejections == 2
    assert h.in_flight == {"d0": 0, "d1": 0}


async def test_all_reject_prefill_then_decode_when_the_fallback_plans_a_split() -> None:
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    h = harness(
        {
            "d0": [rejection(300, 0), answer(PROMPT_IDS, [("Hi", 1)])],
            "p0": [{"kv_transfer_params": kv, "usage": {"prompt_tokens": 300, "completion_tokens": 1}}],
        },
        backends={"d0": "decode", "p0": "prefill"},
        split="always",
        min_pd_prompt_tokens=1,
        decode_guard_threshold=0.1,
    )
    rec = await h.serve()
    assert h.text == "Hi"
    assert (rec.route, rec.winner, rec.prefill, rec.legs) == ("pd", "d0", "p0", ["pd:d0"])
    prefill = h.up.legs_to("p0")[0]
    assert prefill.body["max_tokens"] == 1
    assert prefill.body["stream"] is False
    decode = h.up.legs_to("d0")[-1]
    assert decode.body["kv_transfer_params"] == kv
    assert decode.body["cache_hit_threshold"] == 0.1
    assert h.in_flight == {"d0": 0, "p0": 0}


async def test_a_split_teaches_the_transfer_time_only_when_nothing_was_queued_ahead_on_its_decoder() -> None:
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2]}

    def split_harness() -> Harness:
        return harness(
            {
                "d0": [rejection(300, 0), answer(PROMPT_IDS, [("Hi", 1)])],
                "p0": [{"kv_transfer_params": kv, "usage": {"prompt_tokens": 300, "completion_tokens": 1}}],
            },
            backends={"d0": "decode", "p0": "prefill"},
            split="always",
            min_pd_prompt_tokens=1,
        )

    h = split_harness()
    assert (await h.serve()).route == "pd"
    assert h.registry.learner.transfer().samples == 1
    # A prompt queued on the decoder ahead of the decode leg: its wait is that queue's.
    h = split_harness()
    ahead = h.registry.open_leg("d0", 500)
    assert (await h.serve()).route == "pd"
    assert h.registry.learner.transfer().samples == 0
    h.registry.close_leg(ahead)


async def test_a_failed_prefill_computes_the_prompt_on_the_decoder() -> None:
    h = harness(
        {
            "d0": [rejection(300, 0), answer(PROMPT_IDS, [("Hi", 1)])],
            "p0": [UpstreamError("p0", CONNECT, "connection refused")],
        },
        backends={"d0": "decode", "p0": "prefill"},
        split="always",
        min_pd_prompt_tokens=1,
    )
    rec = await h.serve()
    assert h.text == "Hi"
    assert (rec.route, rec.prefill) == ("direct", "")
    assert "kv_transfer_params" not in h.up.legs_to("d0")[-1].body
    assert h.metric("cachehit_router_upstream_errors_total", backend="p0", kind="connect") == 1


async def test_an_error_before_the_first_byte_retries_on_another_engine() -> None:
    for failure in (
        [UpstreamError("d0", CONNECT, "connection refused")],
        [[UpstreamError("d0", FIRST_TOKEN_TIMEOUT, "no data from the engine in time")]],
    ):
        h = harness({"d0": failure, "d1": [answer(PROMPT_IDS, [("Hi", 1)])]}, planner=FixedPlanner(direct=True))
        rec = await h.serve()
        assert h.text == "Hi"
        assert (rec.route, rec.winner, rec.retries) == ("direct", "d1", 1)
        assert h.metric("cachehit_router_retries_total", backend="d0") == 1
        assert h.registry.states["d0"].consecutive_failures == 1
        assert h.in_flight == {"d0": 0, "d1": 0}


class KeepsNothingOut(FixedPlanner):
    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        return Plan(direct="d0", predicted_ttft_s=0.01)


async def test_retries_stop_at_max_retries_with_the_last_failure() -> None:
    down = UpstreamError("d0", CONNECT, "connection refused")
    # The planner keeps nothing out here: only d0 exists, so every attempt goes there.
    planner = KeepsNothingOut(direct=True)
    h = harness({"d0": [down, down, down]}, backends={"d0": "decode"}, planner=planner, max_retries=1)
    with pytest.raises(RouterError) as failed:
        await h.serve()
    assert failed.value.status == 502
    assert "d0" in failed.value.message
    assert len(h.up.calls) == 2
    assert h.metric("cachehit_router_retries_total", backend="d0") == 1


async def test_a_broken_decode_resumes_elsewhere_and_the_client_sees_one_answer() -> None:
    h = harness(
        {
            "d0": [
                [
                    token("Hello", [1], prompt_ids=PROMPT_IDS),
                    token(" wor", [2]),
                    UpstreamError("d0", BROKEN, "connection lost"),
                ]
            ],
            "d1": [rejection(3, 0), answer([*PROMPT_IDS, 1, 2], [("ld", 3), ("!", 4)])],
        }
    )
    rec = await h.serve(max_tokens=10)
    assert h.text == "Hello world!"
    assert len({c["id"] for c in h.emitted}) == 1
    assert [c["choices"][0]["finish_reason"] for c in h.emitted if c.get("choices")][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] in (None, "stop") for c in h.emitted if c.get("choices"))
    # The continuation: a completion of prompt + generated ids with the remaining budget,
    # raced without the engine that broke.
    resume = h.up.legs_to("d1")[-1]
    assert resume.path == "/v1/completions"
    assert resume.body["prompt"] == [*PROMPT_IDS, 1, 2]
    assert resume.body["max_tokens"] == 8
    assert rec.resumes == ["failure"]
    assert (rec.route, rec.winner, rec.legs) == ("probe_hit", "d0", ["probe_hit:d0", "probe_hit:d1"])
    assert h.metric("cachehit_router_resumes_total", reason="failure") == 1
    assert h.metric("cachehit_router_upstream_errors_total", backend="d0", kind="broken") == 1
    assert h.in_flight == {"d0": 0, "d1": 0}


class DrainsWhilePlanning(FixedPlanner):
    """d0 is taken out of rotation (an operator's drain, a removal beginning) between the
    snapshot the plan is made on and the moment its legs are sent."""

    def __init__(self, registry: BackendRegistry | None = None, direct: bool = False) -> None:
        super().__init__(direct)
        self.registry = registry

    def plan(self, query: RouteQuery, snap: ClusterSnapshot, exclude: frozenset[str] = frozenset()) -> Plan:
        assert self.registry is not None
        self.registry.set_draining("d0", True)
        return super().plan(query, snap, exclude)


async def test_no_leg_goes_to_a_backend_drained_after_its_plan_was_made() -> None:
    """Regression: a leg planned on a snapshot taken just before a drain (or a removal)
    began was still sent to that backend."""
    for direct in (True, False):
        planner = DrainsWhilePlanning(direct=direct)
        h = harness({"d0": [answer(PROMPT_IDS, [("No", 1)])], "d1": [answer(PROMPT_IDS, [("Hi", 1)])]}, planner=planner)
        planner.registry = h.registry
        rec = await h.serve()
        assert h.text == "Hi"
        assert rec.winner == "d1"
        assert h.up.legs_to("d0") == []
        assert h.in_flight == {"d0": 0, "d1": 0}


async def test_long_waits_between_tokens_mark_the_engine_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gaps in a streamed answer far longer than an engine step are stalls
    (router/fleet/stalls.py); here "far" is scaled down so that the test waits little."""
    from router.dispatch import pump
    from router.fleet import stalls

    monkeypatch.setattr(pump, "STALL_LATE_S", 0.05)
    monkeypatch.setattr(stalls, "STALL_LATE_S", 0.05)
    monkeypatch.setattr(stalls, "MIN_SAMPLES", 0)  # no speed measured yet in this harness
    words = answer(PROMPT_IDS, [("a", 1), ("b", 2), ("c", 3)])
    script = [words[0], Pause(0.2), words[1], Pause(0.2), *words[2:]]
    h = harness({"d0": [script]}, planner=FixedPlanner(direct=True))
    await h.serve()
    assert h.text == "abc"
    assert h.registry.stalls.slow("d0", h.registry.clock())
    assert not h.registry.stalls.slow("d1", h.registry.clock())


async def test_a_split_is_remembered_on_its_producer_until_its_decode_leg_starts() -> None:
    # While the prefill runs, the decoder holds nothing of the prompt: a request sharing its
    # prefix must follow it to the producer, and the decoder's place in the load is taken.
    kv = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1]}
    planner = FixedPlanner()
    h = harness(
        {
            "d0": [rejection(300, 0), answer(PROMPT_IDS, [("Hi", 1)])],
            "p0": [{"kv_transfer_params": kv, "usage": {"prompt_tokens": 300, "completion_tokens": 1}}],
        },
        backends={"d0": "decode", "p0": "prefill"},
        planner=planner,
        split="always",
        min_pd_prompt_tokens=1,
    )
    seen: list[tuple[list[str], int]] = []
    post_json = h.up.post_json

    async def during_prefill(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append((list(planner.routed), h.registry.states["d0"].prefilling))
        return await post_json(*args, **kwargs)

    h.up.post_json = during_prefill  # type: ignore[method-assign]
    rec = await h.serve()
    assert (rec.route, rec.prefill, rec.winner) == ("pd", "p0", "d0")
    assert seen == [(["p0"], 1)]
    assert planner.routed == ["p0", "d0"]
    assert h.in_flight == {"d0": 0, "p0": 0}
