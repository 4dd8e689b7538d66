"""The vLLM metrics the router reads from an engine's `/metrics`, and their parser.

The load view reads the running and waiting request gauges and the KV cache usage; the
cost model reads the counters of prompt tokens served from each cache tier and the CPU
tier's load seconds, to learn what a cached token costs (router/routing/speed_learner.py).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

# vLLM metrics the load view reads (gauges, summed over label sets).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Counters the cost model reads for what a cached token costs (a CPU-tier load or nothing).
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
HITS_DEVICE = CACHED_BY_SOURCE + ":device"  # GPU prefix-cache hit tokens
HITS_HOST = CACHED_BY_SOURCE + ":host"  # CPU-tier (OffloadingConnector) hit tokens
OFFLOAD_LOAD_TIME = "vllm:kv_offload_load_time"
# Engine cores the server's running-requests gauge names (vLLM labels each DP rank's
# samples engine="<rank>"): more than one is a data-parallel server.
ENGINE_CORES = "engine_cores"

_GAUGES = (RUNNING, WAITING, KV_USAGE)
# Hand-written on purpose: prometheus_client's parser builds every family and sample of
# the page (vLLM's has ~90 families, histograms with dozens of buckets) to yield the five
# the router reads: ~2.5 ms for the simulator's 18 KB page, on the event loop, for every
# engine at every scrape. One regex scan for those lines (a literal after a newline, which
# the regex engine searches for in C) takes ~45 us. `# TYPE` lines are matched too: a
# family that is declared but has no sample yet reads as 0, as it did through the library.
_LINE = re.compile(
    r"\n(?P<type># TYPE )?(?P<name>vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc"
    r"|prompt_tokens_cached_by_source|kv_offload_load_time))(?P<total>_total)?"
    r"(?:\{(?P<labels>.*)\})?[ \t]+(?P<value>\S+)"
)
# Label values are read past their escapes (`\"`, `\\`, `\n`) but not unescaped: the two
# labels read, `engine` and `source`, are plain words. Read up to the first quote, a value
# ending in an escaped quote then `\n=` read as a label `n` opening at its `="`.
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_load_metrics(text: str, engine: str | None = None) -> dict[str, float]:
    """Sum, over label sets, the gauges the load view uses from a Prometheus exposition,
    and the counters of hit tokens by cache tier (`HITS_DEVICE`, `HITS_HOST`) and of CPU-tier
    load seconds. With `engine`, only the samples of that engine core (vLLM's `engine`
    label: a DP rank's index), so each rank of a data-parallel server reads its own load.

    A page without vLLM's running-requests gauge (not a vLLM engine, or not an exposition
    at all) goes through prometheus_client's parser, which reads it as before or raises."""
    out: dict[str, float] = {}
    cores: set[str | None] = set()
    seen_running = False
    try:
        for m in _LINE.finditer("\n" + text):
            name, labels_text = m["name"], m["labels"]
            counter = name in (CACHED_BY_SOURCE, OFFLOAD_LOAD_TIME)
            declared = bool(m["type"])
            if declared:
                # A counter's TYPE line names it with or without _total; another type: not ours.
                if (m["value"] == "counter") != counter or (m["total"] and not counter):
                    continue
            elif counter != bool(m["total"]):
                continue  # a gauge's name with _total, or a counter's without: another family
            # The family is there (declared, or a sample of it), whichever engine's samples count.
            if name != CACHED_BY_SOURCE:
                out.setdefault(name, 0.0)
            seen_running |= name == RUNNING
            if declared:
                continue
            labels = dict(_LABEL.findall(labels_text)) if labels_text else {}
            if engine is not None and labels.get("engine", engine) != engine:
                continue
            value = float(m["value"])
            if name == CACHED_BY_SOURCE:
                source = labels.get("source")
                if source not in ("device", "host"):
                    continue
                name = f"{CACHED_BY_SOURCE}:{source}"
            elif name == RUNNING:
                cores.add(labels.get("engine"))
            out[name] = out.get(name, 0.0) + value
    except ValueError:
        return _library_parse(text, engine)
    if not seen_running:
        return _library_parse(text, engine)
    out[ENGINE_CORES] = float(len(cores))
    return out


def _library_parse(text: str, engine: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        samples = family.samples
        if engine is not None:
            samples = [s for s in samples if s.labels.get("engine", engine) == engine]
        if family.name in _GAUGES:
            out[family.name] = out.get(family.name, 0.0) + sum(s.value for s in samples if s.name == family.name)
            if family.name == RUNNING:
                out[ENGINE_CORES] = float(len({s.labels.get("engine") for s in samples}))
        elif family.name == CACHED_BY_SOURCE:
            for s in samples:
                source = s.labels.get("source")
                if s.name == CACHED_BY_SOURCE + "_total" and source in ("device", "host"):
                    key = f"{CACHED_BY_SOURCE}:{source}"
                    out[key] = out.get(key, 0.0) + s.value
        elif family.name == OFFLOAD_LOAD_TIME:
            out[family.name] = sum(s.value for s in samples if s.name == family.name + "_total")
    return out
