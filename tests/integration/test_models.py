"""GET /v1/models as vLLM gives it (root, parent, max_model_len), and LoRA adapters loaded
or unloaded on an engine after start-up followed by the router (it re-reads each engine's
models with its health checks)."""

from __future__ import annotations

from typing import Any

from support.cluster import MODEL, Cluster, MakeCluster
from support.polling import eventually


async def _router_models(c: Cluster) -> dict[str, dict[str, Any]]:
    async with c.session.get(c.url + "/v1/models") as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "list"
    return {m["id"]: m for m in body["data"]}


async def test_models_are_the_engines_cards(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    async with c.session.get(c.engines["d0"].url + "/v1/models") as r:
        engine = (await r.json())["data"]
    assert await _router_models(c) == {MODEL: engine[0]}
    card = engine[0]
    assert card["root"] == MODEL
    assert card["parent"] is None
    assert card["max_model_len"] == 8192


async def test_lora_adapter_loaded_after_start_is_listed_and_routed(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=2)
    d1 = c.engines["d1"].url
    async with c.session.post(
        d1 + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    ) as r:
        assert r.status == 200
        assert await r.text() == "Success: LoRA adapter 'sql-lora' added successfully."

    async def listed() -> dict[str, dict[str, Any]] | None:
        models = await _router_models(c)
        return models if "sql-lora" in models else None

    models = await eventually(listed, what="the adapter listed by the router", interval=0.05)
    assert models["sql-lora"]["parent"] == MODEL
    assert models["sql-lora"]["root"] == "/adapters/sql"
    assert models["sql-lora"]["max_model_len"] is None

    for stream in (False, True):
        body = {"model": "sql-lora", "prompt": "hello", "max_tokens": 2}
        if stream:
            status, events = await c.stream(body)
            assert status == 200
            assert events[0]["model"] == "sql-lora"
        else:
            status, out = await c.complete(body)
            assert status == 200
            assert out["model"] == "sql-lora"
    served = await c.engine_metrics("vllm:request_success_total")
    assert served["d0"] == 0
    assert served["d1"] >= 2

    async with c.session.post(d1 + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}) as r:
        assert r.status == 200

    async def gone() -> bool:
        return "sql-lora" not in await _router_models(c)

    await eventually(gone, what="the unloaded adapter gone from the router's list", interval=0.05)
    status, err = await c.complete({"model": "sql-lora", "prompt": "hello", "max_tokens": 2})
    assert status == 404
    assert err["error"]["param"] == "model"
