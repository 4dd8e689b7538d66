"""The Grafana dashboard (deploy/grafana/cachehit-router.json) asks only for what exists:
every metric its queries name is exported by the router (its live /metrics) or by vLLM 0.32
(a captured engine /metrics), with the labels the query filters on; and the router's
request metrics carry `model` with histogram buckets up to timeouts.total_s."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support.cluster import MODEL, MakeCluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "cachehit-router.json"
VLLM_METRICS = ROOT / "tests" / "fixtures" / "vllm_wire" / "metrics.json"

# PromQL words that are not metric names.
_PROMQL = {
    "sum",
    "by",
    "without",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "avg",
    "max",
    "min",
    "count",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "label_values",
    "offset",
    "bool",
    "topk",
    "bottomk",
    "le",
}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")


def queries(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, ranges, grouping clauses and
    functions left out)."""
    e = re.sub(r"\{[^}]*\}", " ", expr)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", e)
    e = re.sub(r'"[^"]*"', " ", e)
    e = re.sub(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,[^)]*\)", r" \1 ", e)
    names = set()
    for m in _NAME.finditer(e):
        rest = e[m.end() :].lstrip()
        if m.group(0) in _PROMQL or rest.startswith("("):
            continue
        names.add(m.group(0))
    return names


def selector_labels(expr: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(expr):
        out.setdefault(name, set()).update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    return out


def vllm_samples() -> dict[str, set[str]]:
    """Sample name -> label names, from the captured engine /metrics."""
    fams = json.loads(VLLM_METRICS.read_text())["families"]
    out: dict[str, set[str]] = {}
    for fam in fams.values():
        for s in fam["samples"]:
            match = re.match(r"[^{ ]+", s)
            assert match is not None  # a sample line starts with its name
            name = match.group(0)
            out.setdefault(name, set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', s))
    return out


def test_metric_name_extraction() -> None:
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(a_bucket{model=~"$model"}[5m])))') == {"a_bucket"}
    assert metric_names("sum(rate(x_total[1m])) / sum(rate(y:z_total[1m]))") == {"x_total", "y:z_total"}
    assert metric_names("label_values(cachehit_router_requests_total, model)") == {"cachehit_router_requests_total"}
    assert selector_labels('vllm:a{model_name=~"$m",x!="1"}') == {"vllm:a": {"model_name", "x"}}


async def test_every_dashboard_query_names_an_exported_metric(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    # A request of each outcome, so that the labelled series exist.
    status, _ = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 200
    status, _ = await c.complete({"model": "not-served", "prompt": "hello"})
    assert status == 404
    async with c.session.get(c.url + "/metrics") as r:
        text = await r.text()
    router: dict[str, set[str] | None] = {}  # None: declared, no sample yet
    for fam in text_string_to_metric_families(text):
        # Declared families count even before their first sample (a labelled counter
        # nothing has incremented yet): their labels are then unknown, not checked.
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
        for suffix in suffixes:
            router.setdefault(fam.name + suffix, None)
        for s in fam.samples:
            router[s.name] = (router.get(s.name) or set()) | set(s.labels)
    exported = {**vllm_samples(), **router}

    dash = json.loads(DASHBOARD.read_text())
    qs = queries(dash)
    assert len(qs) >= 20
    used: set[str] = set()
    for q in qs:
        names = metric_names(q)
        assert names, q
        for n in names:
            assert n in exported, f"{n} (in {q!r}) is exported neither by the router nor by vLLM"
            used.add(n)
        for n, labels in selector_labels(q).items():
            known = exported[n]
            if known is not None:
                assert labels <= known, f"{n} has no label {labels - known} (in {q!r})"
    assert any(n.startswith("vllm:") for n in used)
    assert any(n.startswith("cachehit_router_") for n in used)
    # Panel ids unique, every panel has a query.
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["targets"] for p in dash["panels"])


async def test_request_metrics_have_a_model_label_and_buckets_to_the_total_timeout(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1, timeouts={"total_s": 1500})
    status, _ = await c.complete({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert status == 200
    status, _ = await c.complete({"model": "made-up-by-a-client", "prompt": "hello"})
    assert status == 404
    assert c.router_metric("cachehit_router_requests_total", model=MODEL, status="200") == 1
    # A model no backend serves is counted as "other": clients cannot grow the label set.
    assert c.router_metric("cachehit_router_requests_total", model="other", status="404") == 1
    assert c.router_metric_or_zero("cachehit_router_requests_total", model="made-up-by-a-client") == 0
    assert c.router_metric("cachehit_router_ttft_seconds_count", model=MODEL) == 1
    buckets = sorted(
        float(s.labels["le"])
        for fam in c.state.metrics.registry.collect()
        for s in fam.samples
        if s.name == "cachehit_router_request_duration_seconds_bucket" and s.labels["model"] == MODEL
    )
    assert buckets[-2:] == [1500.0, float("inf")]
    assert 900.0 in buckets
    assert 0.005 in buckets
