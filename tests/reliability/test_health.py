"""Backend health and the circuit breaker, through HTTP only.

Engines are simulator processes and the router is `router --config`: an engine is stopped
for real (SIGKILL), skipped, restarted on the same port and used again; an engine that
answers every request with 500 while its /health stays fine is kept out by the breaker
(no probes during the cool-down), /ready and /metrics say so, and one successful trial
closes the breaker again.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from support.metrics import scrape_metrics
from support.polling import eventually
from support.subprocess_cluster import MODEL, RouterProc, set_faults, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

ADMIN = "admin-secret"


async def _get(s: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with s.get(url, **kw) as r:
        raw = await r.read()
        return r.status, (orjson.loads(raw) if raw and r.content_type == "application/json" else raw)


async def _complete(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 3) -> tuple[int, dict[str, Any]]:
    async with s.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}) as r:
        return r.status, orjson.loads(await r.read())


async def _healthy(s: aiohttp.ClientSession, router: RouterProc, name: str) -> float:
    return (await scrape_metrics(s, router.url)).value("cachehit_router_backend_healthy", backend=name)


async def test_stopped_engine_is_skipped_and_comes_back_after_restart_on_the_same_port(procs: Procs) -> None:
    engines = {n: procs.sim("--speed", "5") for n in ("d0", "d1")}
    router = procs.router(
        {
            "server": {"admin_api_key": ADMIN},
            # Every request races: the engine's return is shown by its winning a race.
            "routing": {"race": "always"},
            "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4, "failure_threshold": 3, "cooldown_s": 1.0},
            "backends": sim_backends(engines),
        }
    )
    async with aiohttp.ClientSession() as s:
        assert (await _get(s, router.url + "/ready"))[0] == 200
        ms = await scrape_metrics(s, router.url)
        assert [ms.value("cachehit_router_backend_healthy", backend=n) for n in engines] == [1, 1]
        assert [ms.value("cachehit_router_backend_circuit_state", backend=n) for n in engines] == [0, 0]

        engines["d0"].kill(signal.SIGKILL)
        await eventually(lambda: _is_zero(s, router, "d0"), 10, "d0 marked unhealthy")
        status, admin = await _get(s, router.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN}"})
        assert status == 200
        d0 = next(b for b in admin if b["name"] == "d0")
        assert d0["healthy"] is False, d0
        assert "connect" in d0["last_error"].lower(), d0
        assert (await _get(s, router.url + "/ready"))[0] == 200  # d1 still takes requests

        # Skipped: every request succeeds on d1 and the router does not even try d0.
        before = (await scrape_metrics(s, router.url)).sample_or_zero("cachehit_router_upstream_errors_total")
        results = await asyncio.gather(*(_complete(s, router.url, f"while d0 is down {i}") for i in range(10)))
        assert all(st == 200 and out["usage"]["completion_tokens"] == 3 for st, out in results), results
        assert (await scrape_metrics(s, router.url)).sample_or_zero("cachehit_router_upstream_errors_total") == before

        engines["d0"].restart()
        await eventually(lambda: _is_one(s, router, "d0"), 10, "d0 healthy again")
        # Used again: a prompt only d0 holds wins the probe race there.
        prompt = "warm on d0 only " + " ".join(f"x{i}" for i in range(60))
        async with s.post(
            engines["d0"].url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        gen_before = await _engine_generated(s, engines["d0"].url)
        status, out = await _complete(s, router.url, prompt, max_tokens=5)
        assert status == 200
        assert out["usage"]["completion_tokens"] == 5
        assert await _engine_generated(s, engines["d0"].url) >= gen_before + 5

        # Everything down: /ready says so and requests end at once with a clear error.
        engines["d0"].kill()
        engines["d1"].kill()
        await eventually(lambda: _ready_status(s, router, 503), 10, "/ready 503")
        async with asyncio.timeout(15):
            status, out = await _complete(s, router.url, "nobody home")
        assert status in (502, 503), out
        assert out["error"]["code"] == status, out
        engines["d1"].restart()
        await eventually(lambda: _ready_status(s, router, 200), 10, "/ready 200 after restart")
        status, out = await _complete(s, router.url, "back again")
        assert status == 200, out


async def _is_zero(s: aiohttp.ClientSession, router: RouterProc, name: str) -> bool:
    return await _healthy(s, router, name) == 0


async def _is_one(s: aiohttp.ClientSession, router: RouterProc, name: str) -> bool:
    return await _healthy(s, router, name) == 1


async def _ready_status(s: aiohttp.ClientSession, router: RouterProc, want: int) -> bool:
    return (await _get(s, router.url + "/ready"))[0] == want


async def _engine_generated(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/_sim/state") as r:
        generated: float = orjson.loads(await r.read())["generated"]
        return generated


async def test_breaker_opens_on_500s_keeps_the_engine_out_then_closes_after_a_trial(procs: Procs) -> None:
    engines = {n: procs.sim("--speed", "5") for n in ("d0", "d1")}
    router = procs.router(
        {
            "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4, "failure_threshold": 2, "cooldown_s": 2.0},
            "routing": {"strategy": "round_robin"},
            "backends": sim_backends(engines),
        }
    )
    async with aiohttp.ClientSession() as s:
        await set_faults(s, engines["d0"].url, error_rate=1.0)

        async def d0_errors() -> float:
            return (await scrape_metrics(s, router.url)).value(
                "cachehit_router_upstream_errors_total", backend="d0", kind="status"
            )

        # Round robin sends every other request to d0 first; each 500 is retried on d1.
        for i in range(6):
            status, out = await _complete(s, router.url, f"breaker {i}")
            assert status == 200, out
        ms = await scrape_metrics(s, router.url)
        assert ms.value("cachehit_router_backend_circuit_state", backend="d0") == 2
        assert ms.value("cachehit_router_backend_healthy", backend="d0") == 0
        assert ms.value("cachehit_router_retries_total", backend="d0") >= 2
        opened_errors = await d0_errors()
        assert opened_errors == 2  # opened at the threshold, then never tried again
        # /health and /metrics of d0 stay fine (scrapes succeed), yet it stays out. The sleep
        # is the behaviour under test: for three scrape intervals of successful scrapes, no
        # event marks "still open", so a fixed window is what is checked.
        await asyncio.sleep(0.6)
        for i in range(6):
            status, out = await _complete(s, router.url, f"open {i}")
            assert status == 200, out
        assert await d0_errors() == opened_errors
        assert (await scrape_metrics(s, router.url)).value("cachehit_router_backend_circuit_state", backend="d0") == 2

        # The engine recovers; after the cool-down one trial request closes the breaker.
        await set_faults(s, engines["d0"].url, error_rate=0.0)

        # Requests during the cool-down (cooldown_s = 2) go to d1; the first after it is d0's trial.
        async def closed() -> bool:
            await _complete(s, router.url, "trial")
            return (await scrape_metrics(s, router.url)).value(
                "cachehit_router_backend_circuit_state", backend="d0"
            ) == 0

        await eventually(closed, 15, "breaker closed after a successful trial", interval=0.1)
        assert await _healthy(s, router, "d0") == 1


async def test_ready_follows_the_breaker_of_the_only_decoder(procs: Procs) -> None:
    engines = {"d0": procs.sim("--speed", "5")}
    router = procs.router(
        {
            "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4, "failure_threshold": 2, "cooldown_s": 1.5},
            "routing": {"strategy": "least_loaded"},
            "backends": sim_backends(engines),
        }
    )
    async with aiohttp.ClientSession() as s:
        await set_faults(s, engines["d0"].url, error_rate=1.0)
        for i in range(2):
            status, out = await _complete(s, router.url, f"fail {i}")
            assert status == 502, out
            assert "500" in out["error"]["message"], out
        assert (await _get(s, router.url + "/ready"))[0] == 503
        await set_faults(s, engines["d0"].url, error_rate=0.0)
        # After the cool-down the open breaker admits a trial: ready again, and the trial closes it.
        await eventually(lambda: _ready_status(s, router, 200), 10, "/ready after cool-down")
        status, out = await _complete(s, router.url, "trial")
        assert status == 200, out
        ms = await scrape_metrics(s, router.url)
        assert ms.value("cachehit_router_backend_circuit_state", backend="d0") == 0
