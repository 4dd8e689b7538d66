"""Regenerate tests/fixtures/vllm_wire/: the exact HTTP answers of a real vLLM 0.32 engine.

    .venv/bin/python tests/real_engine/capture_wire.py            # starts its own engines
    .venv/bin/python tests/real_engine/capture_wire.py --base-url http://127.0.0.1:8000

It builds the tiny model, starts a NIXL producer (core 0) and a NIXL consumer (core 1) from
the launcher's own command line, plain vLLM (no plugin, so the captures show upstream
behaviour), sends every case of tests/support/wire_cases.py, and writes one JSON file per case:
  {"request": {...}, "status": 200, "content_type": "...", "raw": "<body as sent>",
   "parsed": <JSON body, or the list of SSE data payloads>}
Volatile values (ids, timestamps, fingerprints, engine uuids, ports) are normalized so that
a re-capture only shows real changes. Sampling is greedy, so token ids are reproducible on
the same model recipe; chunking is not (vLLM merges tokens into one chunk when its client
reads slowly), so review a re-capture's diff before committing it. Captures whose answers
depend on this model's tokens (stop token / stop string) are written to model_specific/.
`--plugin` adds the threshold cases against an engine with the
cache-hit threshold plugin (files prefixed `threshold_`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the `support` package

from router.engine.wire import PREFILL_REQUEST_PARAMS
from support.ports import free_port_below_ephemeral_range
from support.real_engine import (
    EngineProcess,
    engine_command,
    request,
)
from support.sse import parse_sse
from support.wire_cases import CASES, DETAILS_CASES, DISAGG_PROMPT, THRESHOLD_CASES, USAGE, comp

OUT = REPO / "tests" / "fixtures" / "vllm_wire"

# The first request with logprobs makes a CPU engine torch.compile a small sampler kernel
# (inductor + g++): minutes on two busy cores. Eager mode gives the same answers.
ENGINE_ENV = {"TORCHDYNAMO_DISABLE": "1"}


_NORMALIZERS = [
    (re.compile(r'"id":"(cmpl|chatcmpl)-[0-9A-Za-z_-]+"'), r'"id":"\1-<id>"'),
    (re.compile(r'"created":\d+'), '"created":1700000000'),
    (re.compile(r'"system_fingerprint":"vllm-([0-9.]+)-[0-9a-f]+"'), r'"system_fingerprint":"vllm-\1-<fingerprint>"'),
    (re.compile(r'"(modelperm)-[0-9a-f]+"'), r'"\1-<id>"'),
    (re.compile(r'"remote_engine_id":"[^"]+"'), '"remote_engine_id":"<engine-uuid>"'),
    (re.compile(r'"remote_request_id":"[^"]+"'), '"remote_request_id":"<request-id>"'),
    (re.compile(r'"remote_port":\d+'), '"remote_port":5600'),
    (re.compile(r'"root":"[^"]+"'), '"root":"<model-dir>"'),
    (re.compile(r'"expires_at":[0-9.e+]+'), '"expires_at":1700000030'),
    (re.compile(r"(cmpl|chatcmpl)-[0-9a-f]{16}"), r"\1-<id>"),
]


def normalize(text: str) -> str:
    for pattern, repl in _NORMALIZERS:
        text = pattern.sub(repl, text)
    return text


def capture(base_url: str, name: str, method: str, path: str, body: object) -> dict[str, Any]:
    raw_body = body if isinstance(body, bytes) else None
    t0 = time.monotonic()
    status, data = request(base_url, method, path, None if raw_body else body, raw_body=raw_body, timeout=120)
    elapsed = time.monotonic() - t0
    text = normalize(data.decode(errors="replace"))
    parsed: object
    is_sse = isinstance(body, dict) and body.get("stream") and status == 200
    try:
        parsed = parse_sse(text.encode()) if is_sse else json.loads(text)
    except (ValueError, AssertionError):
        parsed = None
    record = {
        "request": {"method": method, "path": path, "body": body.decode() if isinstance(body, bytes) else body},
        "status": status,
        "raw": text,
        "parsed": parsed,
    }
    print(f"{name:48s} {status}  {elapsed * 1000:7.1f} ms")
    return record


def metrics_summary(base_url: str) -> dict[str, Any]:
    """Every `vllm:` metric family with its type, help and one sample line per label set."""
    status, data = request(base_url, "GET", "/metrics", timeout=10)
    families: dict[str, dict[str, Any]] = {}
    for line in data.decode().splitlines():
        if line.startswith(("# HELP vllm:", "# TYPE vllm:", "# HELP cachehit_", "# TYPE cachehit_")):
            _, kind, name, rest = line.split(" ", 3)
            families.setdefault(name, {"samples": []})[kind.lower()] = rest
        elif line.startswith(("vllm:", "cachehit_")):
            key = line.rsplit(" ", 1)[0]
            base = key.split("{", 1)[0]
            fam = next((f for f in families if base == f or base.startswith(f + "_")), base)
            families.setdefault(fam, {"samples": []})["samples"].append(normalize(key))
    return {"status": status, "families": families}


def write(name: str, record: dict[str, Any]) -> None:
    path = OUT / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


def run_cases(base_url: str, cases: dict[str, Any]) -> None:
    for name, (method, path, body) in cases.items():
        write(name, capture(base_url, name, method, path, body))


def run_disagg(producer: str, consumer: str) -> None:
    body = comp(
        prompt=DISAGG_PROMPT,
        max_tokens=1,
        stream=False,
        kv_transfer_params=PREFILL_REQUEST_PARAMS,
        return_token_ids=True,
    )
    rec = capture(producer, "disagg_prefill_leg", "POST", "/v1/completions", body)
    write("disagg_prefill_leg", rec)
    _, data = request(producer, "POST", "/v1/completions", body)  # fresh, un-normalized
    kv = json.loads(data)["kv_transfer_params"]
    decode = comp(
        prompt=DISAGG_PROMPT, max_tokens=4, stream=True, return_token_ids=True, kv_transfer_params=kv, **USAGE
    )
    rec = capture(consumer, "disagg_decode_leg_stream", "POST", "/v1/completions", decode)
    rec["request"]["body"] = json.loads(normalize(json.dumps(decode, separators=(",", ":"))))
    write("disagg_decode_leg_stream", rec)
    time.sleep(1.5)  # metrics are pushed by the engine core about once per second
    _status, data = request(consumer, "GET", "/metrics")
    hits = [
        normalize(l)
        for l in data.decode().splitlines()
        if l.startswith("vllm:external_prefix_cache_hits_total")
        or l.startswith("vllm:prefix_cache_queries_total")
        or l.startswith("vllm:prefix_cache_hits_total")
    ]
    write("disagg_consumer_metrics", {"lines": hits})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="capture from this running engine (no disagg cases)")
    ap.add_argument(
        "--plugin", action="store_true", help="also capture the threshold cases on an engine with the plugin"
    )
    ap.add_argument("--only-plugin", action="store_true", help="only the threshold cases")
    ap.add_argument(
        "--details",
        action="store_true",
        help="only the prompt_tokens_details cases (engine with the plugin and --enable-prompt-tokens-details)",
    )
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.base_url:
        run_cases(args.base_url, THRESHOLD_CASES if args.only_plugin else CASES)
        write("metrics", metrics_summary(args.base_url))
        return 0

    from engine_launcher.tiny_model import build_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-wire-"))
    model = build_tiny_model(work / "tiny-model")
    engines: list[EngineProcess] = []
    try:
        if not (args.only_plugin or args.details):
            for name, role, core in (("producer", "producer", 0), ("consumer", "consumer", 1)):
                port = free_port_below_ephemeral_range()
                argv_, env = engine_command(
                    model,
                    name=name,
                    port=port,
                    nixl_port=free_port_below_ephemeral_range(),
                    role=role,
                    cpu_cores=(core,),
                    plugin=False,
                    extra_args=("--max-model-len", "2048"),
                    env=ENGINE_ENV,
                )
                engines.append(EngineProcess(argv_, env, port, work / f"{name}.log").start())
            for e in engines:
                print(f"{e.log_path.stem}: healthy after {e.wait_healthy():.1f} s")
            producer, consumer = (e.base_url for e in engines)
            run_cases(producer, CASES)
            write("metrics", metrics_summary(producer))
            run_disagg(producer, consumer)
            for e in engines:
                e.stop()
            engines.clear()
        if args.details:
            port = free_port_below_ephemeral_range()
            argv_, env = engine_command(
                model,
                name="details",
                port=port,
                nixl_port=free_port_below_ephemeral_range(),
                role="both",
                cpu_cores=(0,),
                plugin=True,
                extra_args=("--max-model-len", "2048"),
                env=ENGINE_ENV,
            )
            if "--enable-prompt-tokens-details" not in argv_:
                argv_.append("--enable-prompt-tokens-details")
            e = EngineProcess(argv_, env, port, work / "details.log").start()
            engines.append(e)
            print(f"details: healthy after {e.wait_healthy():.1f} s")
            run_cases(e.base_url, DETAILS_CASES)
            return 0
        if args.plugin or args.only_plugin:
            port = free_port_below_ephemeral_range()
            argv_, env = engine_command(
                model,
                name="plugin",
                port=port,
                nixl_port=free_port_below_ephemeral_range(),
                role="both",
                cpu_cores=(0,),
                plugin=True,
                extra_args=("--max-model-len", "2048"),
                env=ENGINE_ENV,
            )
            e = EngineProcess(argv_, env, port, work / "plugin.log").start()
            engines.append(e)
            print(f"plugin: healthy after {e.wait_healthy():.1f} s")
            run_cases(e.base_url, THRESHOLD_CASES)
    finally:
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
