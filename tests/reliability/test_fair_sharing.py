"""Fair sharing: per-key limits and priorities ([[tenants]]), through the real router.

A simulated engine and `router --config` run as processes; the keys of two tenants come
from the environment (`api_key_env`), as an operator would keep them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from support.metrics import scrape_metrics
from support.polling import eventually
from support.subprocess_cluster import MODEL, RouterProc, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

FLOOD_KEY, QUIET_KEY, METERED_KEY = "sk-flood-0123", "sk-quiet-4567", "sk-metered-89ab"


@pytest.fixture
def router(procs: Procs, monkeypatch: pytest.MonkeyPatch) -> RouterProc:
    monkeypatch.setenv("CACHEHIT_TEST_FLOOD_KEY", FLOOD_KEY)
    monkeypatch.setenv("CACHEHIT_TEST_QUIET_KEY", QUIET_KEY)
    engine = procs.sim("--speed", "5")
    return procs.router(
        {
            "server": {"max_concurrent_requests": 4, "max_queued_requests": 64, "queue_timeout_s": 30.0},
            "tenants": [
                {
                    "name": "flood",
                    "api_key_env": "CACHEHIT_TEST_FLOOD_KEY",
                    "max_concurrent_requests": 2,
                    "max_queued_requests": 6,
                },
                {"name": "quiet", "api_key_env": "CACHEHIT_TEST_QUIET_KEY", "max_priority": 1},
                {"name": "metered", "api_key": METERED_KEY, "requests_per_s": 0.05, "burst": 1},
            ],
            "backends": sim_backends({"d0": engine}),
        }
    )


async def _post(
    s: aiohttp.ClientSession, url: str, key: str, max_tokens: int = 60, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    async with s.post(
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        json={"model": MODEL, "prompt": "share the engine", "max_tokens": max_tokens},
    ) as r:
        return r.status, dict(r.headers), await r.text()


@pytest.mark.timeout(180)
async def test_a_tenant_at_its_limits_does_not_hold_back_another(router: RouterProc) -> None:
    async with aiohttp.ClientSession() as s:
        flood = [asyncio.create_task(_post(s, router.url, FLOOD_KEY)) for _ in range(30)]

        async def flood_saturated() -> bool:
            ms = await scrape_metrics(s, router.url)
            return (
                ms.value("cachehit_router_tenant_inflight", tenant="flood") == 2
                and ms.value("cachehit_router_tenant_queued", tenant="flood") == 6
            )

        await eventually(flood_saturated, 60.0, "flood at its concurrency and queue limits")
        # While flood is at its limits, quiet's requests are served (two slots are free for
        # them), and with priority 1, which its key allows.
        quiet = await asyncio.gather(
            *(_post(s, router.url, QUIET_KEY, headers={"X-Request-Priority": "1"}) for _ in range(4))
        )
        ms = await scrape_metrics(s, router.url)
        assert ms.value("cachehit_router_tenant_queued", tenant="flood") > 0  # still held back
        assert [q[0] for q in quiet] == [200] * 4, quiet
        flood_out = await asyncio.gather(*flood)
        statuses = sorted(f[0] for f in flood_out)
        assert set(statuses) == {200, 429}, statuses
        assert statuses.count(200) >= 8, statuses
        rejected = [f for f in flood_out if f[0] == 429]
        assert all(int(f[1]["Retry-After"]) >= 1 and "'flood'" in f[2] for f in rejected)

        ms = await scrape_metrics(s, router.url)
        assert ms.value("cachehit_router_tenant_requests_total", tenant="quiet", status="200") == 4
        assert ms.value("cachehit_router_tenant_rejections_total", tenant="flood", reason="tenant_queue") == len(
            rejected
        )
        assert ms.sample_or_zero("cachehit_router_tenant_rejections_total", tenant="quiet", reason="tenant_queue") == 0
        for t in ("flood", "quiet", "metered"):
            assert ms.value("cachehit_router_tenant_inflight", tenant=t) == 0
        async with s.get(router.url + "/metrics") as r:
            text = await r.text()
        assert not any(k in text for k in (FLOOD_KEY, QUIET_KEY, METERED_KEY))


@pytest.mark.timeout(120)
async def test_per_key_rate_limit_and_priority_rules(router: RouterProc) -> None:
    async with aiohttp.ClientSession() as s:
        assert (await _post(s, router.url, METERED_KEY, max_tokens=2))[0] == 200
        status, headers, body = await _post(s, router.url, METERED_KEY, max_tokens=2)
        assert status == 429, (status, body)
        assert 1 <= int(headers["Retry-After"]) <= 20, (status, body)
        assert "'metered'" in body
        assert "0.05 requests per second" in body
        assert (await _post(s, router.url, QUIET_KEY, max_tokens=2))[0] == 200  # others unaffected

        # A priority above what the key allows is refused; a malformed one is a 400.
        status, _, body = await _post(s, router.url, FLOOD_KEY, headers={"X-Request-Priority": "1"})
        assert status == 403, body
        assert "X-Request-Priority" in body, body
        assert "at most 0" in body, body
        status, _, body = await _post(s, router.url, QUIET_KEY, headers={"X-Request-Priority": "soon"})
        assert status == 400, body
        assert "X-Request-Priority" in body, body
        assert (await _post(s, router.url, FLOOD_KEY, max_tokens=2, headers={"X-Request-Priority": "-3"}))[0] == 200
        assert (await _post(s, router.url, "sk-nobody", max_tokens=2))[0] == 401

        # vLLM's other routes, forwarded to an engine, follow the same keys and rules.
        for key, headers, expected in (
            (QUIET_KEY, {}, 200),
            ("sk-nobody", {}, 401),
            (FLOOD_KEY, {"X-Request-Priority": "1"}, 403),
            (METERED_KEY, {}, 429),
        ):
            async with s.post(
                router.url + "/v1/embeddings",
                headers={"Authorization": f"Bearer {key}", **headers},
                json={"model": MODEL, "input": "share the engine"},
            ) as r:
                assert r.status == expected, (key, r.status, await r.text())

        ms = await scrape_metrics(s, router.url)
        assert ms.value("cachehit_router_tenant_rejections_total", tenant="metered", reason="rate") == 2
        assert ms.value("cachehit_router_tenant_requests_total", tenant="metered", status="429") == 2
