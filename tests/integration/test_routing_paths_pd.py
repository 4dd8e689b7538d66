"""Routing paths through the router, against simulated engines: prefill/decode splits, the
probe race and its fallbacks, cancelled losers, client disconnects and streamed answers.

Routes are read from the router's own metrics (cachehit_router_requests_total{route}) and
what the engines did from their own state and vLLM-named metrics, never from the router's
word alone.
"""

import logging

import pytest

from support.cluster import MODEL, PD_PREFERRED, MakeCluster, long_prompt
from support.polling import eventually

# Health checks and scrapes far apart: after the router's first, none during the test.
FAR_SCRAPES = {"scrape_interval_s": 60.0, "check_interval_s": 60.0}


async def test_cold_request_goes_prefill_decode_then_warm_repeat_is_a_probe_hit(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=1, per_backend=PD_PREFERRED)
    prompt = long_prompt("warm", 300)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
    status, first = await c.complete(body)
    assert status == 200, first
    assert c.routes() == {"probe_hit": 0, "pd": 1, "direct": 0}
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d0") == 1
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d1") == 1
    # The consumer pulled the prompt over the side channel: external hits on exactly one decoder.
    ext = await c.engine_metrics("vllm:external_prefix_cache_hits_total")
    decoder = max(("d0", "d1"), key=lambda n: ext[n])
    assert ext[decoder] >= 300 - 16
    assert ext[{"d0": "d1", "d1": "d0"}[decoder]] == 0
    assert first["usage"]["completion_tokens"] == 8

    status, second = await c.complete(body)
    assert status == 200
    assert c.routes()["probe_hit"] == 1
    assert c.registry.states[decoder].config.name == decoder
    # Same prompt, same deterministic engine: the same answer, now from the cache.
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300 - 32
    assert await c.wait_idle() == {"d0": 0, "d1": 0, "p0": 0}


async def test_a_request_not_worth_racing_still_splits_when_the_model_says_so(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router.requests")
    c = await make_cluster(decoders=2, prefillers=1, per_backend=PD_PREFERRED)
    # Verdicts measured as slower than any hit could save: no race, and the prompt goes where
    # the fallback's cost model puts it (a split, under these priors), not just to a decoder.
    c.registry.learner.race_wait_s = 1000.0
    status, out = await c.complete({"model": MODEL, "prompt": long_prompt("noprobe", 300), "max_tokens": 6})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 6
    assert c.routes() == {"probe_hit": 0, "pd": 1, "direct": 0}
    for d in ("d0", "d1"):
        assert c.router_metric_or_zero("cachehit_router_probe_rejections_total", backend=d) == 0
    # The log line says why: goodput's split, with the figures that decided it.
    (rec,) = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
    assert rec["route_reason"] == "goodput_split", rec
    assert rec["predicted_lost"] == 0, rec
    assert rec["predicted_itl_ms"] > 0, rec
    assert rec["route_alternative"].startswith("direct "), rec
    assert await c.wait_idle() == {"d0": 0, "d1": 0, "p0": 0}


@pytest.mark.parametrize("spare", ["always", "never"])
async def test_a_request_late_wherever_it_goes_is_split_through_a_producer_to_spare(
    make_cluster: MakeCluster, caplog: pytest.LogCaptureFixture, spare: str
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router.requests")
    # A 1 ms TTFT SLO: every placement misses it. With two idle producers one is to spare
    # ("always"; "auto" waits for a measured producer speed, tests/unit/routing), so the
    # split (it stalls nobody, and its first token comes sooner under these priors) takes
    # it; with "never" a split past the SLO is no candidate and the decoder computes it.
    c = await make_cluster(
        decoders=1,
        prefillers=2,
        per_backend=PD_PREFERRED,
        routing={"slo_ttft_ms": 1.0, "spare_producers": spare},
    )
    status, out = await c.complete({"model": MODEL, "prompt": long_prompt("late", 300), "max_tokens": 6})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 6
    (rec,) = [r.__dict__["request"] for r in caplog.records if r.name == "cachehit_router.requests"]
    ext = await c.engine_metrics("vllm:external_prefix_cache_hits_total")
    if spare == "always":
        assert c.routes() == {"probe_hit": 0, "pd": 1, "direct": 0}
        assert rec["route_reason"] == "spare_producer", rec
        assert rec["predicted_lost"] == 1, rec
        assert rec["prefill"] in ("p0", "p1"), rec
        assert ext["d0"] >= 300 - 16  # the decoder pulled the prompt's KV from the producer
    else:
        assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 1}
        assert rec["route_reason"] == "goodput_direct", rec
        assert ext["d0"] == 0
    assert await c.wait_idle() == {"d0": 0, "p0": 0, "p1": 0}


@pytest.mark.parametrize("stream", [False, True])
async def test_failed_kv_transfer_is_recomputed_on_the_decoder(make_cluster: MakeCluster, stream: bool) -> None:
    # The producer's lease ends before the consumer pulls: with vLLM's default
    # kv_load_failure_policy "fail" the consumer answers an internal error (an error event
    # in a stream); the router computes the prompt on that decoder instead of failing.
    c = await make_cluster(
        decoders=1, prefillers=1, per_backend=PD_PREFERRED, per_engine={"p0": {"kv_lease_duration": 1e-6}}
    )
    body = {"model": MODEL, "prompt": long_prompt("xferfail", 300), "max_tokens": 6}
    if stream:
        status, events = await c.stream({**body, "stream_options": {"include_usage": True}})
        assert status == 200
        assert events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events)
        usage = events[-2]["usage"]
    else:
        status, out = await c.complete(body)
        assert status == 200, out
        usage = out["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] == 300
    assert await c.engine_metric("d0", "vllm:nixl_num_failed_transfers_total") == 1
    assert await c.engine_metric("d0", "vllm:request_success_total") >= 1
    # One prefill on the producer, then the prompt computed on the decoder.
    assert await c.engine_metric("p0", "vllm:prompt_tokens_total") == 300
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 1}
    assert await c.wait_idle() == {"d0": 0, "p0": 0}


async def test_fallback_goes_to_the_engine_holding_the_most_of_the_prompt(make_cluster: MakeCluster) -> None:
    # Each prompt's first 300 of 700 tokens sit on one decoder (43% < T = 0.5): both reject,
    # the holder's rejection says how much it holds, and the prompt is computed there.
    # (Speed 0.2: the 288 tokens held save ~70 ms of prefill, more than a busy machine's
    # noise in the engines' learned speeds. Scrapes far apart: one that caught the head's
    # own request, sent around the router, would count it as another replica's sequence
    # decoding on the holder, and the goodput objective keeps a prefill off such an engine.)
    c = await make_cluster(decoders=2, prefillers=0, routing={"race": "always"}, sim={"speed": 0.2}, health=FAR_SCRAPES)
    for i in range(4):
        holder = f"d{i % 2}"
        head = long_prompt(f"holder{i}", 300)
        async with c.session.post(
            c.engines[holder].url + "/v1/completions", json={"model": MODEL, "prompt": head, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        status, out = await c.complete(
            {"model": MODEL, "prompt": head + " " + long_prompt(f"tail{i}", 400), "max_tokens": 2}
        )
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == 700
        # Whole blocks of the head (16 tokens each) were reused: only the holder had them.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 288, (i, out["usage"])
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 4}
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d0") == 4
    assert c.router_metric("cachehit_router_probe_rejections_total", backend="d1") == 4


async def test_an_engine_report_beats_the_router_memory_of_an_evicted_prompt(make_cluster: MakeCluster) -> None:
    # The router sent P to one engine, which has since evicted it; the other engine holds
    # P's first 40%. Both reject (below T = 0.5) and report what they hold: the router's
    # memory says the first engine holds all of P, but that was long enough ago for the
    # engine's own report (nothing) to be the truth, so P is computed where 40% is cached.
    # (Scrapes far apart, as above: the head sent around the router is not another's sequence.)
    c = await make_cluster(decoders=2, prefillers=0, routing={"race": "always"}, sim={"speed": 0.2}, health=FAR_SCRAPES)
    p = long_prompt("evicted", 1000)
    status, out = await c.complete({"model": MODEL, "prompt": p, "max_tokens": 2})
    assert status == 200, out
    generated = await c.engine_metrics("vllm:generation_tokens_total")
    first = next(n for n, v in generated.items() if v > 0)
    other = "d1" if first == "d0" else "d0"
    async with c.session.post(c.engines[first].url + "/reset_prefix_cache") as r:
        assert r.status == 200
    head = " ".join(p.split(" ")[:400])
    async with c.session.post(
        c.engines[other].url + "/v1/completions", json={"model": MODEL, "prompt": head, "max_tokens": 1}
    ) as r:
        assert r.status == 200
    status, out = await c.complete({"model": MODEL, "prompt": p, "max_tokens": 2})
    assert status == 200, out
    assert c.router_metric("cachehit_router_probe_rejections_total", backend=first) == 2
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 400 // 16 * 16, out["usage"]


async def test_no_prefill_backend_falls_back_to_direct(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=0)
    status, out = await c.complete({"model": MODEL, "prompt": long_prompt("nopf"), "max_tokens": 4})
    assert status == 200
    assert out["choices"][0]["finish_reason"] == "length"
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 1}


async def test_short_prompt_goes_direct_even_with_a_prefill_backend(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=1, routing={"min_pd_prompt_tokens": 256})
    status, _out = await c.complete({"model": MODEL, "prompt": long_prompt("short", 40), "max_tokens": 4})
    assert status == 200
    assert c.routes() == {"probe_hit": 0, "pd": 0, "direct": 1}
    assert await c.engine_metric("p0", "vllm:prompt_tokens_total") == 0


async def test_streaming_answer_has_one_id_usage_and_done(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=1)
    status, events = await c.stream(
        {"model": MODEL, "prompt": long_prompt("stream"), "max_tokens": 12, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({ch["id"] for ch in chunks}) == 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    text_chunks = [ch for ch in chunks if ch["choices"]]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(ch["choices"][0].get("token_ids") is None for ch in text_chunks)  # the client did not ask


async def test_losers_are_cancelled_and_stop_running_on_their_engine(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=3, prefillers=0, routing={"race": "always"})
    prompt = long_prompt("losers", 300)
    # Warm every decoder directly so all three hold the prompt and will accept a probe.
    for e in c.engines.values():
        async with c.session.post(
            e.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        ) as r:
            assert r.status == 200
    status, out = await c.complete({"model": MODEL, "prompt": prompt, "max_tokens": 200})
    assert status == 200
    assert out["usage"]["completion_tokens"] == 200
    assert c.routes()["probe_hit"] == 1
    losers = sum(c.router_metric_or_zero("cachehit_router_probe_losers_total", backend=n) for n in c.engines)
    assert losers == 2
    # The engines aborted the losers: nothing runs anywhere once the answer is complete, and
    # each loser produced far fewer tokens than the winner's 200.
    assert await c.wait_idle() == {"d0": 0, "d1": 0, "d2": 0}
    gen = sorted((await c.engine_metrics("vllm:generation_tokens_total")).values())
    assert gen[-1] >= 200 + 1
    assert gen[0] < 50
    assert gen[1] < 50


async def test_client_disconnect_stops_upstream_work(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=1, sim={"speed": 5.0})
    body = {"model": MODEL, "prompt": long_prompt("gone"), "max_tokens": 2000, "stream": True}
    resp = await c.post("/v1/completions", body)
    assert resp.status == 200
    got = 0
    async for line in resp.content:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    assert sum(c.engine_running().values()) == 1  # the decode engine is generating
    resp.close()  # the client goes away mid-stream
    assert await c.wait_idle() == {"d0": 0, "d1": 0, "p0": 0}
    await eventually(
        lambda: all(s.inflight == 0 for s in c.registry.states.values()),
        what="the router's in-flight counts back to 0",
    )


async def test_chat_non_streaming_through_pd(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2, prefillers=1, per_backend=PD_PREFERRED)
    msgs = [{"role": "system", "content": long_prompt("sys", 200)}, {"role": "user", "content": "hello there"}]
    status, out = await c.complete({"model": MODEL, "messages": msgs, "max_tokens": 6}, "/v1/chat/completions")
    assert status == 200, out
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] == 6
    assert c.routes()["pd"] == 1
