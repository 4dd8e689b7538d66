"""Loading the real vLLM 0.32 captures in tests/fixtures/vllm_wire (docs/VLLM_WIRE.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from router.engine.sse import DONE_PAYLOAD, SSEDecoder

WIRE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_wire"


def load(name: str) -> dict[str, Any]:
    capture: dict[str, Any] = orjson.loads((WIRE / f"{name}.json").read_bytes())
    return capture


def has(name: str) -> bool:
    return (WIRE / f"{name}.json").exists()


def stream_chunks(name: str) -> list[dict[str, Any]]:
    """The parsed events of a captured stream, decoded from its raw bytes, [DONE] dropped."""
    d = SSEDecoder()
    raw = load(name)["raw"].encode()
    payloads = d.feed(raw) + d.flush()
    assert payloads[-1] == DONE_PAYLOAD
    return [orjson.loads(p) for p in payloads[:-1]]


def body(name: str) -> dict[str, Any]:
    answer: dict[str, Any] = orjson.loads(load(name)["raw"].encode())
    return answer


def request_body(name: str) -> bytes:
    return orjson.dumps(load(name)["request"]["body"])


def normalized(obj: Any) -> Any:
    """Drop what legitimately differs between two answers: ids and timestamps."""
    if isinstance(obj, list):
        return [normalized(o) for o in obj]
    return {k: v for k, v in obj.items() if k not in ("id", "created")}
