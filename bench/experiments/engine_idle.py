"""Idle CPU of real vLLM engines with NIXL, and NIXL prefill/decode transfer time.

    python -m bench engine-idle --model DIR [--settings nixl,launcher] [--transfers 20]
                                [--idle-s 15] [--out DIR]

For each setting, starts a producer and a consumer vLLM engine (CPU build; one core each)
from the launcher's own command line (engine_launcher.commands.vllm_command), then:
1. idle CPU: % of one core used by each engine's whole process tree over `--idle-s` seconds,
   after start-up settles, and again after the transfers;
2. transfer time: `--transfers` prefill legs (max_tokens 1, do_remote_decode) each followed by
   the decode leg on the consumer, which pulls the prompt's KV blocks over NIXL (prompts of
   `--prompt-words` words, each new so nothing is cached locally); p50/p90 of each leg.

Settings: `nixl` = NIXL's own progress thread (CACHEHIT_NIXL_PROGRESS_DELAY_US unset: the
thread polls with timeout 0), `launcher` = the launcher's default, or a number of
microseconds. Engines are stopped by process group. Needs vLLM (CPU build) and NIXL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.procs import Proc, ProcessSet, free_ports
from router.engine.wire import PREFILL_REQUEST_PARAMS

PROGRESS_ENV = "CACHEHIT_NIXL_PROGRESS_DELAY_US"


def tree_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in the process group."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / hz


def idle_cpu(pgids: list[int], seconds: float) -> list[float]:
    """% of one core each group used over `seconds`."""
    before = [tree_cpu_s(g) for g in pgids]
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return [100.0 * (tree_cpu_s(g) - b) / dt for g, b in zip(pgids, before, strict=False)]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_healthy(procs: list[Proc], urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(urls, procs, strict=False))
    while pending and time.monotonic() < deadline:
        for url, p in list(pending.items()):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited before /health answered:\n{p.log_tail()}")
            if healthy(url):
                del pending[url]
        time.sleep(0.5)
    if pending:
        raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {list(pending)}")


def run_setting(setting: str, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from engine_launcher.commands import vllm_command
    from engine_launcher.host import HostInfo
    from engine_launcher.ports import EnginePorts
    from router.config.schema import EngineConfig
    from router.names import EngineRole

    cores = sorted(os.sched_getaffinity(0))
    ports = free_ports(4)
    procs, urls = [], []
    with ProcessSet(log_dir / setting) as ps:
        for i, role in enumerate(("producer", "consumer")):
            core = (cores[i % len(cores)],)
            e = EngineConfig(
                name=role,
                kind="vllm",
                role=EngineRole(role),
                port=ports[2 * i],
                model=a.model,
                served_model_name="tiny",
                nixl_side_channel_port=ports[2 * i + 1],
                cpu_cores=core,
                extra_args=("--max-model-len", "2048"),
                env=(("TORCHDYNAMO_DISABLE", "1"),),
            )
            cmd = vllm_command(
                e,
                EnginePorts(http=ports[2 * i], nixl=ports[2 * i + 1]),
                HostInfo(gpu_count=0, cpu_ids=tuple(cores)),
                log_dir=str(log_dir),
                cpu_cores=core,
                python=sys.executable,
            )
            env = dict(cmd.env)
            if setting == "nixl":  # empty: the plugin leaves NIXL alone
                env[PROGRESS_ENV] = ""
            elif setting != "launcher":
                env[PROGRESS_ENV] = str(int(setting))
            procs.append(ps.start(role, cmd.argv, env))
            urls.append(f"http://127.0.0.1:{ports[2 * i]}")
        wait_healthy(procs, urls, a.startup_timeout)
        time.sleep(a.settle_s)
        pgids = [p.pid for p in procs]
        idle_before = idle_cpu(pgids, a.idle_s)
        prefill_s, decode_s, pulled = [], [], []
        for n in range(a.transfers + 1):
            prompt = f"{setting} {n} " + "hello world " * (a.prompt_words // 2)
            t0 = time.monotonic()
            pre = post(
                urls[0] + "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": PREFILL_REQUEST_PARAMS},
            )
            t1 = time.monotonic()
            dec = post(
                urls[1] + "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": pre["kv_transfer_params"]},
            )
            t2 = time.monotonic()
            if n == 0:
                continue  # the first exchange includes the NIXL handshake
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
            pulled.append(dec["usage"]["prompt_tokens"])
        time.sleep(a.settle_s)
        idle_after = idle_cpu(pgids, a.idle_s)
    return {
        "setting": setting,
        "idle_cpu_pct_before": idle_before,
        "idle_cpu_pct_after": idle_after,
        "transfers": a.transfers,
        "prompt_tokens": statistics.median(pulled),
        "prefill_p50_ms": 1000 * statistics.median(prefill_s),
        "decode_p50_ms": 1000 * statistics.median(decode_s),
        "decode_p90_ms": 1000 * statistics.quantiles(decode_s, n=10)[-1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench engine-idle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="model dir (default: build the tiny random model in a temp dir)")
    p.add_argument("--settings", default="nixl,launcher")
    p.add_argument("--transfers", type=int, default=20)
    p.add_argument("--prompt-words", type=int, default=500)
    p.add_argument("--idle-s", type=float, default=15.0)
    p.add_argument(
        "--settle-s", type=float, default=35.0, help="wait before each idle measurement (past vLLM's 30 s KV lease)"
    )
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--out", help="write results.json here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="engine-idle-") as tmp:
        if not a.model:
            from engine_launcher.tiny_model import build_tiny_model

            a.model = str(build_tiny_model(Path(tmp) / "tiny-model"))
        log_dir = Path(a.out or tmp) / "logs"
        results = []
        for setting in [s.strip() for s in a.settings.split(",") if s.strip()]:
            r = run_setting(setting, a, log_dir)
            results.append(r)
            print(json.dumps(r), flush=True)
    print(
        "\n| setting | idle CPU % of a core (producer, consumer) before / after transfers "
        "| prefill p50 ms | decode (NIXL pull) p50 / p90 ms |"
    )
    print("|---|---|---|---|")
    for r in results:
        b = ", ".join(f"{x:.1f}" for x in r["idle_cpu_pct_before"])
        af = ", ".join(f"{x:.1f}" for x in r["idle_cpu_pct_after"])
        print(
            f"| {r['setting']} | {b} / {af} | {r['prefill_p50_ms']:.0f} | "
            f"{r['decode_p50_ms']:.0f} / {r['decode_p90_ms']:.0f} |"
        )
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
