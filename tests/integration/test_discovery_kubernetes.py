"""Engines found through the Kubernetes API by label selector.

No API server can run here: a small aiohttp server answers `GET /api/v1/namespaces/
{ns}/pods?labelSelector=...` with a PodList in the API's own shape (tests/fixtures/
kubernetes/), checking the bearer token and the selector as the API server would. The
engines behind the pod IPs are real (simulators on loopback addresses).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from engine_launcher.sim import SimEngineConfig, SimEngineHandle, start_sim_engine
from router.fleet.kubernetes import ready_pods
from support.cluster import MODEL, registry_of
from support.fleet import ADDRS, finished, start_router
from support.polling import eventually
from support.ports import free_port_on, site_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes"
POD_LIST = json.loads((FIXTURES / "pods_inference_app_vllm_role_decode.json").read_text())
FORBIDDEN = (FIXTURES / "status_forbidden.json").read_bytes()
SELECTOR = "app=vllm,role=decode"
READY = ("vllm-decode-7d9f8c6b5-a1b2c", "vllm-decode-7d9f8c6b5-d3e4f")


def test_only_pods_a_service_would_route_to_count() -> None:
    # Pending without an IP, Running but not Ready, and terminating pods are left out.
    assert ready_pods(POD_LIST) == [(READY[0], "127.0.0.2"), (READY[1], "127.0.0.3")]
    assert ready_pods({"kind": "PodList", "items": None}) == []


class FakeApiServer:
    def __init__(self, token: str) -> None:
        self.token = token
        self.present = {p["metadata"]["name"] for p in POD_LIST["items"]}
        self.forbidden = False
        self.requests = 0
        self.url = ""  # set once it serves
        self.token_file: Path | None = None

    async def pods(self, request: web.Request) -> web.Response:
        self.requests += 1
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(
                status=401,
                content_type="application/json",
                body=orjson.dumps(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "message": "Unauthorized",
                        "reason": "Unauthorized",
                        "code": 401,
                    }
                ),
            )
        if self.forbidden:
            return web.Response(status=403, content_type="application/json", body=FORBIDDEN)
        ns, selector = request.match_info["ns"], request.query.get("labelSelector")
        items = [
            p
            for p in POD_LIST["items"]
            if p["metadata"]["name"] in self.present
            and ns == p["metadata"]["namespace"]
            and all(
                p["metadata"]["labels"].get(k) == v
                for k, v in (kv.split("=") for kv in (selector or "").split(",") if kv)
            )
        ]
        return web.Response(content_type="application/json", body=orjson.dumps({**POD_LIST, "items": items}))


# What `kube` gives: the API server, the engines' port, the engines by address, the
# routers' runners (cleaned up at the end) and an HTTP session.
Kube = tuple[FakeApiServer, int, dict[str, SimEngineHandle], list[web.AppRunner], aiohttp.ClientSession]


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[Kube]:
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    api = FakeApiServer("token-1")
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods", api.pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api.url = f"http://127.0.0.1:{site_port(site)}"
    api.token_file = token_file
    port = free_port_on(ADDRS)
    # Every pod IP has an engine that answers, the pods that are not ready too: only the
    # API's view decides.
    engines = {
        a: await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0, role="consumer"), host=a, port=port)
        for a in ADDRS
    }
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()
    yield api, port, engines, runners, session
    await session.close()
    for r in runners:
        await r.cleanup()
    for e in engines.values():
        await e.close()
    await runner.cleanup()


async def test_ready_pods_join_and_leave(kube: Kube) -> None:
    api, port, engines, runners, session = kube
    state, url = await start_router(
        {
            "server": {"port": 0},
            "health": {"scrape_interval_s": 0.2, "check_interval_s": 0.4},
            "discovery": [
                {
                    "kind": "kubernetes",
                    "namespace": "inference",
                    "label_selector": SELECTOR,
                    "port": port,
                    "models": [MODEL],
                    "interval_s": 0.2,
                    "api_server": api.url,
                    "token_file": str(api.token_file),
                }
            ],
        },
        runners,
    )
    source = f"discovery:kubernetes:{SELECTOR}"
    names = {f"{READY[0]}@127.0.0.2:{port}", f"{READY[1]}@127.0.0.3:{port}"}
    assert set(registry_of(state).states) == names  # found before serving
    for i in range(6):
        async with session.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": f"pod {i}", "max_tokens": 2}
        ) as r:
            assert r.status == 200
    assert await finished(session, engines["127.0.0.4"]) == 0  # not ready: never used
    assert await finished(session, engines["127.0.0.5"]) == 0  # terminating: never used

    # A pod goes away (scale-down): drained and removed.
    api.present.discard(READY[1])
    await eventually(
        lambda: set(registry_of(state).states) == {f"{READY[0]}@127.0.0.2:{port}"}, within=15, what="the pod's removal"
    )

    # The API refuses (RBAC): nothing changes.
    api.forbidden = True
    discovery = state.discovery
    assert discovery is not None  # [[discovery]] configured
    failures = discovery.failures.get(source, 0)
    await eventually(lambda: discovery.failures.get(source, 0) >= failures + 2, within=15, what="refused look-ups")
    assert set(registry_of(state).states) == {f"{READY[0]}@127.0.0.2:{port}"}
    api.forbidden = False

    # The token rotates: the file is re-read every round.
    api.token = "token-2"
    assert api.token_file is not None
    api.token_file.write_text("token-2\n")
    api.present.add(READY[1])
    await eventually(lambda: set(registry_of(state).states) == names, within=15, what="the pod's return")
    assert api.requests > 0
