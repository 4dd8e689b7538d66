"""A run directory's files: `summary.json`, `requests.jsonl` (one row per request, with the
router's own log record of it) and the router's per-request log, written and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # a type only: reading results needs no load generator
    from bench.harness.loadgen import Result


def parse_router_log(path: Path) -> dict[str, dict[str, Any]]:
    """request id -> the router's per-request log record: a JSON line of logger
    cachehit_router.requests (server.log_format = "json", the default), or in the text
    format the JSON after the logger name."""
    out: dict[str, dict[str, Any]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("logger") != "cachehit_router.requests":
                    continue
            else:
                i = line.find("cachehit_router.requests: ")
                if i < 0:
                    continue
                d = json.loads(line[i + len("cachehit_router.requests: ") :])
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("request_id"):
            out[d["request_id"]] = d
    return out


def write_outputs(out: Path, summary: dict[str, Any], results: list[Result], logs: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    with open(out / "requests.jsonl", "wb") as f:
        for r in results:
            row = r.row()
            lg = logs.get(r.response_id)
            if lg:
                row.update(
                    {
                        "route": lg.get("route"),
                        "winner": lg.get("winner"),
                        "prefill": lg.get("prefill"),
                        "probes": lg.get("probes"),
                        "rejections": lg.get("rejections"),
                        "losers": lg.get("losers"),
                        "expired": lg.get("expired"),
                        "router_ttft_ms": lg.get("ttft_ms"),
                        # the routing cost model's TTFT prediction for the leg that answered
                        "predicted_ttft_ms": lg.get("predicted_ttft_ms"),
                        # probe hits: the predicted TTFT of the best engine computing the whole prompt
                        "scratch_ttft_ms": lg.get("scratch_ttft_ms"),
                    }
                )
            f.write(orjson.dumps(row) + b"\n")


def load_summary(d: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((Path(d) / "summary.json").read_text())
    return summary


def load_requests(d: Path) -> list[dict[str, Any]]:
    p = Path(d) / "requests.jsonl"
    if not p.exists():
        return []
    return [orjson.loads(line) for line in p.read_bytes().splitlines() if line.strip()]
