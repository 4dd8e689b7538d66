"""Health-check answers the test decides the timing of: every call of the health monitor's
upstream client waits until the test lets it answer, so a check can straddle any change of
the fleet. One address refuses every connection."""

from __future__ import annotations

import asyncio
from typing import Any

DOWN = "http://down:1"  # refuses every connection


class GatedEngines:
    """The calls `HealthMonitor` makes (`get_text`, and the capability probe's `post_json`)."""

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future[None]] = []

    async def get_text(self, url: str, timeout_s: float, api_key: str = "") -> tuple[int, str]:
        gate = asyncio.get_running_loop().create_future()
        self.waiting.append(gate)
        await gate
        if url.startswith(DOWN):
            raise ConnectionRefusedError(url)
        if url.endswith("/v1/models"):
            return 200, '{"data": [{"id": "m"}]}'
        return 200, ""

    async def post_json(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"choices": [{"finish_reason": "cache_threshold", "text": ""}]}

    def answer(self, n: int) -> None:
        """Let the `n` oldest waiting calls answer."""
        for gate in self.waiting[:n]:
            if not gate.done():
                gate.set_result(None)
        del self.waiting[:n]
