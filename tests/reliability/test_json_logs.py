"""The `router` command's logs (router/observability/logs.py): one JSON object per line by default, the
request line's fields at the top level; text for humans with server.log_format = "text"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
import orjson
import pytest

from support.subprocess_cluster import MODEL, RouterProc, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

ANNOUNCE = ("router: serving", "  try:")  # printed to stdout for a human, not logged


async def _two_requests(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"X-Request-Id": "logged-1"},
        ) as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"}) as r:
            assert r.status == 404


def _log_lines(router: RouterProc) -> list[str]:
    return [ln for ln in router.log_path.read_text().splitlines() if ln and not ln.startswith(ANNOUNCE)]


async def test_every_log_line_is_one_json_object(procs: Procs) -> None:
    eng = procs.sim()
    router = procs.router({"backends": sim_backends({"e": eng})})
    await _two_requests(router.url)
    router.stop()
    lines = _log_lines(router)
    objs = [orjson.loads(ln) for ln in lines]  # raises on any line that is not pure JSON
    assert all(isinstance(o, dict) and {"time", "level", "logger", "message"} <= o.keys() for o in objs)
    reqs = [o for o in objs if o["logger"] == "cachehit_router.requests"]
    assert [(o["message"], o["request_id"], o["status"]) for o in reqs] == [
        ("request", "cmpl-logged-1", 200),
        ("request", reqs[1]["request_id"], 404),
    ]
    assert reqs[1]["request_id"].startswith("cmpl-")
    assert reqs[1]["model"] == "nope"
    ok = reqs[0]
    assert ok["endpoint"] == "completions"
    assert ok["model"] == MODEL
    assert ok["route"] in ("probe_hit", "direct")
    assert ok["winner"] == "e"
    assert ok["completion_tokens"] == 2
    assert isinstance(ok["ttft_ms"], float)
    assert any(o["logger"] == "cachehit_router.app" and "router ready" in o["message"] for o in objs)


@pytest.mark.parametrize("fmt", ["text"])
async def test_text_logs_for_humans(procs: Procs, fmt: str) -> None:
    eng = procs.sim()
    router = procs.router({"server": {"log_format": fmt}, "backends": sim_backends({"e": eng})})
    await _two_requests(router.url)
    router.stop()
    lines = _log_lines(router)
    reqs = [ln for ln in lines if " INFO cachehit_router.requests: " in ln]
    assert len(reqs) == 2
    fields = orjson.loads(reqs[0].split(" INFO cachehit_router.requests: ", 1)[1])
    assert fields["request_id"] == "cmpl-logged-1"
    assert fields["status"] == 200
    assert any(" INFO cachehit_router.app: router ready" in ln for ln in lines)
