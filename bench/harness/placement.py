"""Where a run's requests went, and what the cost model predicted there against what was
observed: `python -m bench.harness.placement RUN_DIR...` (a replay's or a suite mode's
directory, holding `requests.jsonl`).

Per run: how often a request whose prompt repeats an earlier one's (the same group or
session: its `tag`) went to an engine that had served that tag (the only engines that
can hold its prefix) and to the very engine of the tag's last request, next to what
spreading at random gives (1 / engines for the last one); then, per engine, requests,
hits, and the median predicted and observed time to first token of its misses and of
its hits. A cache-blind policy predicts every request as a miss, so its error on hits is
the cache's; on misses it is the load model's own.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.stats import median


@dataclass(frozen=True)
class RepeatPlacement:
    """How requests that repeat a tag were placed."""

    repeats: int
    to_a_holder: float  # share sent to an engine that served the tag before
    to_the_last: float  # share sent to the engine of the tag's previous request
    engines: int


def repeat_placement(rows: Sequence[dict[str, Any]]) -> RepeatPlacement:
    served: dict[str, set[str]] = defaultdict(set)
    last: dict[str, str] = {}
    repeats = holder = same = 0
    for r in sorted(rows, key=lambda r: float(r.get("start_s") or 0.0)):
        tag, engine = r.get("tag"), r.get("winner")
        if not tag or not engine:
            continue
        if tag in last:
            repeats += 1
            holder += engine in served[tag]
            same += engine == last[tag]
        served[tag].add(engine)
        last[tag] = engine
    engines = len({r["winner"] for r in rows if r.get("winner")})
    return RepeatPlacement(repeats, holder / max(repeats, 1), same / max(repeats, 1), engines)


def per_engine(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per engine: requests, hits, and median predicted / observed TTFT (ms) of misses and hits."""
    out: dict[str, dict[str, Any]] = {}
    for engine in sorted({r["winner"] for r in rows if r.get("winner")}):
        mine = [r for r in rows if r.get("winner") == engine]
        hits = [r for r in mine if (r.get("cached_tokens") or 0) > 0]
        misses = [r for r in mine if not (r.get("cached_tokens") or 0) > 0]

        def med(rs: list[dict[str, Any]], key: str) -> float | None:
            return median(float(r[key]) for r in rs if r.get(key) is not None)

        out[engine] = {
            "requests": len(mine),
            "hits": len(hits),
            "miss_predicted_ms": med(misses, "predicted_ttft_ms"),
            "miss_observed_ms": med(misses, "router_ttft_ms"),
            "hit_predicted_ms": med(hits, "predicted_ttft_ms"),
            "hit_observed_ms": med(hits, "router_ttft_ms"),
        }
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def report(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines() if line.strip()]
    rp = repeat_placement(rows)
    lines = [
        f"{run_dir}: {len(rows)} requests; {rp.repeats} repeat a tag: {rp.to_a_holder:.2f} to an engine that"
        f" served it, {rp.to_the_last:.2f} to its last engine (at random {1 / max(rp.engines, 1):.2f})",
        "  engine  req  hits  miss pred/obs ms  hit pred/obs ms",
    ]
    for engine, e in per_engine(rows).items():
        lines.append(
            f"  {engine:6} {e['requests']:4} {e['hits']:5}  {_ms(e['miss_predicted_ms']):>7}/{_ms(e['miss_observed_ms']):<8}"
            f" {_ms(e['hit_predicted_ms']):>6}/{_ms(e['hit_observed_ms'])}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    for d in argv:
        print(report(Path(d)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
