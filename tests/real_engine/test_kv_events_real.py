"""The router's KV-event index against a real vLLM engine (CPU build, tiny random model,
threshold plugin): what the index says an engine holds of a prompt is what that engine
then reports as the prompt's cached tokens.

One engine (conftest.py `kv_events_engine`) publishes its KV-cache events over ZMQ with a
replay socket; an in-process router follows them. vLLM publishes from its scheduler, in
the engine-core process: a batch per engine step that stored or removed blocks, queued to
a publisher thread, so a batch can reach the router just after the answer of the request
whose step made it. The tests poll for the index to show a request's blocks.

Comparing the index with vLLM: the index holds full blocks (32 tokens here), so a prompt
of n tokens matches at most floor(n / 32) * 32 tokens; vLLM reports
`usage.prompt_tokens_details.cached_tokens`, its prefix-cache hit, looked up over the
first n - 1 tokens only (the last one is always computed, for its logits) and in whole
blocks: floor((n - 1) / 32) * 32 at most. So an index hit `h` predicts
`min(h, floor((n - 1) / 32) * 32)` cached tokens; a prompt whose length is a multiple of
32 has its last block computed again although the index (rightly) holds it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
import pytest

from router.config.parse import parse_config
from router.engine.tokenize import tokenize_body
from router.routing.kv_index import KvHit
from router.server.app import ROUTER_KEY, build_app
from router.server.state import RouterState
from support.cluster import registry_of
from support.polling import eventually
from support.ports import serve_on_free_port
from support.real_engine import EngineProcess, post_json

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(900)]

MODEL = "tiny"
NAME = "engine"
BLOCK = 32  # the launcher's --block-size on CPU (engine_launcher/commands.py)
# Batches arrive within milliseconds; the bound is for two loaded cores.
EVENTS_WITHIN_S = 60.0


def ids(seed: int, n: int) -> list[int]:
    """n token ids below the tiny model's vocabulary (2000), distinct per seed."""
    return [100 + (seed * 131 + 7 * i) % 1800 for i in range(n)]


def full_blocks(n: int) -> int:
    return n // BLOCK * BLOCK


def vllm_cached(hit: int, n: int) -> int:
    """The cached tokens vLLM reports for a prompt of n tokens whose first `hit` the index
    holds (see the module's docstring)."""
    return min(hit, (n - 1) // BLOCK * BLOCK)


class Router:
    """An in-process router whose one backend is the engine, with its event endpoints."""

    def __init__(self, engine: EngineProcess, strategy: str) -> None:
        self.engine = engine
        self.config = parse_config(
            {
                "server": {"port": 0},
                "routing": {"strategy": strategy},
                "timeouts": {"first_token_s": 120, "idle_s": 120, "total_s": 300},
                "health": {"scrape_interval_s": 2.0, "check_interval_s": 4.0},
                # Two busy cores can delay a batch by seconds: not a stale stream here.
                "kv_events": {"stale_after_s": 60.0},
                "backends": [
                    {
                        "name": NAME,
                        "url": engine.base_url,
                        "role": "decode",
                        "kv_events_endpoint": engine.extra["kv_events_endpoint"],
                        "kv_events_replay_endpoint": engine.extra["kv_events_replay_endpoint"],
                    }
                ],
            }
        )

    async def __aenter__(self) -> Router:
        self.app = build_app(self.config, start_engines=False)
        self.runner, self.url = await serve_on_free_port(self.app, cancel_handlers=True)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        await eventually(self.fresh, within=EVENTS_WITHIN_S, what="the snapshot calls the engine's index fresh")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.runner.cleanup()

    @property
    def state(self) -> RouterState:
        return self.app[ROUTER_KEY]

    def fresh(self) -> bool:
        view = registry_of(self.state).snapshot().get(NAME)
        return bool(view and view.kv_events_fresh)

    def hit(self, token_ids: list[int]) -> KvHit:
        assert self.state.kv_events is not None  # the backend has event endpoints
        return self.state.kv_events.index.match(token_ids).get(NAME, KvHit(0, 0))

    async def shows(self, token_ids: list[int], tokens: int) -> KvHit:
        """Until the index holds `tokens` of the prompt on GPU (its batch may trail the answer)."""

        def held() -> KvHit | None:
            h = self.hit(token_ids)
            return h if h.gpu_tokens == tokens else None

        got = await eventually(
            held,
            within=EVENTS_WITHIN_S,
            what=f"the index holding {tokens} of a {len(token_ids)}-token prompt (holds {self.hit(token_ids)})",
        )
        assert got is not None  # eventually returns a truthy value
        return got

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = {"model": MODEL, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
        async with self.session.post(self.url + path, json=payload) as r:
            out: dict[str, Any] = orjson.loads(await r.read())
            assert r.status == 200, (r.status, out, self.engine.log_tail())
        return out

    async def router_token_ids(self, chat: bool, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the router's prompt index gets them (/tokenize)."""
        tb = tokenize_body(chat, {"model": MODEL, **body}, MODEL)
        assert tb is not None
        assert self.state.prompt_index is not None  # the kv_events strategy keeps one
        got = await self.state.prompt_index.tokenizer.token_ids(NAME, self.engine.base_url, tb)
        return list(got)


def prompt_ids(out: dict[str, Any]) -> list[int]:
    """The engine's own token ids of the prompt (`return_token_ids`)."""
    # Chat answers carry them at the top, completions per choice.
    ids: list[int] = out.get("prompt_token_ids") or out["choices"][0]["prompt_token_ids"]
    return ids


def cached(out: dict[str, Any]) -> int:
    n: int = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return n


def records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    # The request log's record carries its fields as the `request` attribute (logging extra).
    return [
        r.__dict__["request"]
        for r in caplog.records
        if r.name == "cachehit_router.requests" and "request" in r.__dict__
    ]


async def test_the_index_matches_what_the_engine_reports(
    kv_events_engine: EngineProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router")
    async with Router(kv_events_engine, "kv_events") as r:
        # Prompts: 2 blocks and a part; exactly 3 blocks (its last block vLLM computes
        # again); a chat request (the /tokenize path with the chat template).
        a = ids(1, 2 * BLOCK + 16)
        b = ids(2, 3 * BLOCK)
        chat = {"messages": [{"role": "user", "content": " ".join(["lantern meadow copper"] * 20)}]}
        sent: list[tuple[str, dict[str, Any], list[int]]] = []
        for path, body, chat_path in (
            ("/v1/completions", {"prompt": a}, False),
            ("/v1/completions", {"prompt": b}, False),
            ("/v1/chat/completions", chat, True),
        ):
            out = await r.post(path, body)
            engine_ids = prompt_ids(out)
            router_ids = body["prompt"] if not chat_path else await r.router_token_ids(True, body)
            assert engine_ids == router_ids, (path, engine_ids, router_ids)
            assert out["usage"]["prompt_tokens"] == len(engine_ids)
            sent.append((path, body, engine_ids))

        for path, body, prompt in sent:
            n = len(prompt)
            hit = await r.shows(prompt, full_blocks(n))
            assert hit.cpu_tokens == 0
            caplog.clear()
            again = await r.post(path, body)
            # The router planned the repeat on what the index said, and the engine agrees.
            (rec,) = records(caplog)
            assert rec["winner"] == NAME, rec
            assert rec["race_reason"] == "not_racing", rec
            assert cached(again) == vllm_cached(hit.gpu_tokens, n), (path, n, hit, again["usage"])
            assert rec["indexed_hits"] == {NAME: cached(again)}, (path, n, rec)
            print(f"\n[kv events] {path} {n} tokens: index {hit.gpu_tokens}, engine cached {cached(again)}")

        # A prompt sharing the first two blocks of `a`: the index finds them before it is sent.
        c = a[: 2 * BLOCK] + ids(3, 40)
        assert r.hit(c) == KvHit(2 * BLOCK, 0)
        caplog.clear()
        out = await r.post("/v1/completions", {"prompt": c})
        (rec,) = records(caplog)
        assert rec["indexed_hits"] == {NAME: 2 * BLOCK} == {NAME: cached(out)}, (rec, out["usage"])
        await r.shows(c, full_blocks(len(c)))

        # Reset the engine's prefix cache: its AllBlocksCleared empties the router's view.
        # vLLM queues the event and publishes it with its next step's batch (an idle engine
        # takes no step), so one more request carries it.
        status, answer = post_json(kv_events_engine.base_url, "/reset_prefix_cache", None)
        assert status == 200, answer
        assert answer == {"success": True}, answer
        d = ids(4, 2 * BLOCK + 5)
        caplog.clear()
        await r.post("/v1/completions", {"prompt": d})
        await r.shows(d, full_blocks(len(d)))
        assert r.state.kv_events is not None
        stats = r.state.kv_events.index.stats(NAME)
        assert stats.blocks == stats.gpu_blocks == len(d) // BLOCK, stats
        for prompt in (a, b, c):
            assert r.hit(prompt) == KvHit(0, 0)
        out = await r.post("/v1/completions", {"prompt": a})
        assert cached(out) == 0, out["usage"]


async def test_probe_skips_the_race_when_the_index_knows(
    kv_events_engine: EngineProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachehit_router")
    # A new router: its index is rebuilt from the engine's replay socket.
    async with Router(kv_events_engine, "probe") as r:
        # Sent twice through the router, the engine serving nobody else: the second time
        # its memory says what the index would (it placed the prompt itself a moment ago and
        # the engine lost no block since); no lookup, no race.
        g = ids(8, 3 * BLOCK + 10)
        await r.post("/v1/completions", {"prompt": g})
        await r.shows(g, full_blocks(len(g)))
        caplog.clear()
        await r.post("/v1/completions", {"prompt": g})
        (rec,) = records(caplog)
        assert rec["race_reason"] == "memory_knows", rec
        assert rec["probes"] == 0, rec
        e = ids(5, 3 * BLOCK + 10)
        # (The repeat stored no block: its leg's credit lingers a moment; one stored in that
        # moment would be counted the router's.)
        seqs = registry_of(r.state).states[NAME].sequences
        await eventually(lambda: seqs.owed(registry_of(r.state).clock()) == 0, what="no beginning owed")
        # Sent to the engine directly: this router's memory knows nothing of it, only the
        # engine's events do.
        body = {"model": MODEL, "prompt": e, "max_tokens": 1, "temperature": 0}
        status, out = await asyncio.to_thread(post_json, kv_events_engine.base_url, "/v1/completions", body)
        assert status == 200, out
        await r.shows(e, full_blocks(len(e)))
        assert seqs.others_seen(registry_of(r.state).clock())  # a sequence it did not send
        caplog.clear()
        again = await r.post("/v1/completions", {"prompt": e})
        (rec,) = records(caplog)
        assert rec["race_reason"] == "index_knows", rec
        assert rec["probes"] == 0, rec
        assert rec["winner"] == NAME, rec
        assert rec["indexed_hits"] == {NAME: cached(again)} == {NAME: vllm_cached(full_blocks(len(e)), len(e))}, (
            rec,
            again["usage"],
        )
        assert out["usage"]["prompt_tokens"] == len(e)
        # Sent again: the router placed it itself a moment ago, but the engine now serves
        # traffic it did not send (the request above, seen in its KV events), so its memory
        # may miss what others stored there: the index is asked; still no race.
        caplog.clear()
        await r.post("/v1/completions", {"prompt": e})
        (rec,) = records(caplog)
        assert rec["race_reason"] == "index_knows", rec
        assert rec["probes"] == 0, rec
        assert rec["winner"] == NAME, rec


async def test_a_request_sent_around_the_router_is_another_replicas_sequence(kv_events_engine: EngineProcess) -> None:
    """vLLM stores a sequence's decoded blocks as it generates them, each chained to the one
    before: the router's own request grows a chain of its own (its decoded blocks time the
    engine's block), and one sent to the engine directly is counted as others'."""
    async with Router(kv_events_engine, "probe") as r:
        seqs = registry_of(r.state).states[NAME].sequences
        before = seqs.began_others
        own = ids(6, 2 * BLOCK + 8)
        await r.post("/v1/completions", {"prompt": own, "max_tokens": 3 * BLOCK, "ignore_eos": True})
        await eventually(lambda: seqs.block_samples >= 2, within=EVENTS_WITHIN_S, what="its decoded blocks stored")
        assert seqs.began_others == before, "the router's own request counted as another's"
        theirs = ids(7, 2 * BLOCK + 8)
        body = {"model": MODEL, "prompt": theirs, "max_tokens": 2 * BLOCK, "ignore_eos": True, "temperature": 0}
        status, out = await asyncio.to_thread(post_json, kv_events_engine.base_url, "/v1/completions", body)
        assert status == 200, out
        await eventually(lambda: seqs.began_others == before + 1, within=EVENTS_WITHIN_S, what="others' sequence")
        view = registry_of(r.state).snapshot().get(NAME)
        assert view is not None
        assert view.others_seen
        gauge = f'cachehit_router_kv_events_others_sequences{{backend="{NAME}"}} {before + 1}.0'
        assert gauge in r.state.metrics.exposition().decode()
