"""A request's prompt matched against the KV-event index (router/dispatch/prompt_index.py):
token ids from the query or an engine's /tokenize, figures only for engines whose index is
fresh, the blocks vLLM computes anyway left out, nothing when tokenizing fails."""

from __future__ import annotations

from typing import Any

from router.dispatch.prompt_index import PromptIndex
from router.engine.errors import CONNECT, UpstreamError
from router.engine.kv_events_wire import BlockHash, BlockStored, EventBatch
from router.routing.kv_index import KvIndex
from router.routing.planning import RouteQuery
from router.routing.snapshot import BackendView, ClusterSnapshot

BS = 4
IDS = tuple(range(100, 112))  # three blocks


def view(name: str, fresh: bool = True) -> BackendView:
    return BackendView(
        name=name, url=f"http://{name}", decodes=True, prefills=False, models=("m",), available=True,
        inflight=0, running=0.0, waiting=0.0, kv_usage=0.0, kv_events_fresh=fresh,
    )  # fmt: skip


def index_holding(engine: str, blocks: int) -> KvIndex:
    idx = KvIndex()
    hashes: list[BlockHash] = [f"{engine}{i}".encode() for i in range(blocks)]
    stored = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(IDS[: blocks * BS]), block_size=BS,
        medium="GPU", lora_name=None, extra_keys=None, group_idx=None,
    )  # fmt: skip
    idx.apply(engine, EventBatch(ts=1.0, events=[stored], data_parallel_rank=None))
    return idx


class _Tokenizer:
    """An engine's /tokenize: the prompt's ids, or a failure."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked: list[str] = []

    async def token_ids(self, backend: str, base_url: str, body: dict[str, Any], **_: Any) -> tuple[int, ...]:
        self.asked.append(backend)
        if self.fail:
            raise UpstreamError(backend, CONNECT, "refused")
        return IDS


def prompt_index(idx: KvIndex, tokenizer: _Tokenizer) -> PromptIndex:
    return PromptIndex(idx, tokenizer, lambda name: (f"http://{name}", ""))  # type: ignore[arg-type]


async def test_fresh_engines_get_the_index_figures_stale_ones_stay_unknown() -> None:
    snap = ClusterSnapshot((view("a"), view("b"), view("c", fresh=False)))
    pi = prompt_index(index_holding("a", 2), _Tokenizer())
    q = await pi.annotate(RouteQuery("m", "text", token_ids=IDS, prompt_tokens=len(IDS)), False, {}, snap, None)
    # a holds two blocks; b's stream is fresh and has nothing; c is not spoken for.
    assert q.indexed == {"a": 8.0, "b": 0.0}


async def test_the_whole_prompt_held_still_leaves_its_last_block_to_compute() -> None:
    # vLLM looks a prompt up over all but its last token, in whole blocks: of 12 tokens in
    # blocks of 4, at most 8 come from the cache even when all three blocks are held.
    snap = ClusterSnapshot((view("a"),))
    pi = prompt_index(index_holding("a", 3), _Tokenizer())
    q = await pi.annotate(RouteQuery("m", "text", token_ids=IDS), False, {}, snap, None)
    assert q.indexed == {"a": 8.0}


async def test_a_text_prompt_is_tokenized_by_an_engine_serving_the_model() -> None:
    snap = ClusterSnapshot((view("a"), view("b")))
    tokenizer = _Tokenizer()
    pi = prompt_index(index_holding("a", 1), tokenizer)
    q = await pi.annotate(RouteQuery("m", "hello"), False, {"prompt": "hello"}, snap, None)
    assert tokenizer.asked == ["a"]
    assert q.token_ids == IDS
    assert q.prompt_tokens == len(IDS)
    assert q.indexed == {"a": 4.0, "b": 0.0}


async def test_a_prompt_that_cannot_be_tokenized_is_planned_without_the_index() -> None:
    snap = ClusterSnapshot((view("a"), view("b")))
    pi = prompt_index(index_holding("a", 1), _Tokenizer(fail=True))
    q = RouteQuery("m", "hello")
    assert await pi.annotate(q, False, {"prompt": "hello"}, snap, None) is q
    assert pi.failures == 1
    # A batch is never tokenized; no fresh index: nothing is even asked.
    assert await pi.annotate(q, False, {"prompt": ["a", "b"]}, snap, None) is q
    stale = ClusterSnapshot((view("a", fresh=False),))
    assert await pi.annotate(q, False, {"prompt": "hello"}, stale, None) is q
