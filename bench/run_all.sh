#!/usr/bin/env bash
# Every benchmark of bench/RESULTS.md, one after the other (never two at once: they would
# measure each other), into OUT (default bench/out, git-ignored). About an hour and a half on 2 cores.
# Usage: bench/run_all.sh [OUT] [--skip-trace]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
log() { echo "== $(date -u +%H:%M:%S) $*"; }

log "routing suite: every mode on every suite workload (the regret table)"
$PY -m bench suite --out "$OUT/suite"

log "prefix-groups: every mode"
$PY -m bench replay --workload prefix-groups --mode all --out "$OUT/prefix-groups"

if [[ "${2:-}" != "--skip-trace" ]]; then
  log "Mooncake trace (last 400 requests): every mode"
  $PY -m bench replay --mode all --out "$OUT/trace"
fi
log "Mooncake trace: probe without P/D fallback (cold prompts run on the least-loaded decoder)"
$PY -m bench replay --mode probe --min-pd-prompt-tokens 1000000000 --label probe_no_pd --out "$OUT/trace-variants/probe_no_pd"
log "Mooncake trace: probe with 2 prefill engines"
$PY -m bench replay --mode probe --prefill 2 --label probe_P2 --out "$OUT/trace-variants/probe_P2"

log "Mooncake trace on engines 8x an H100 (the prefill engine keeps up)"
$PY -m bench replay --speed 8 --mode oracle,probe,prefix_tree,round_robin --out "$OUT/trace-light"

log "multi-turn sessions"
$PY -m bench replay --workload multiturn --mode probe,prefix_tree,least_loaded,round_robin --out "$OUT/multiturn"

log "CPU KV tier: hit ratio and TTFT against F = 0, 2, 4, 8, 16 x GPU KV (trace, first 1,500 requests)"
$PY -m bench offload-sweep --resume --out "$OUT/offload-sweep"

log "idle CPU and NIXL transfer time of real vLLM engines (NIXL's own progress thread, the launcher's default)"
$PY -m bench engine-idle --out "$OUT/engine-idle"

log "router overhead"
$PY -m bench overhead --out "$OUT/overhead"

log "threshold sweep (trace, last 300 requests)"
$PY -m bench sweep-threshold --limit 300 --out "$OUT/sweep-threshold"

log "load sweep"
$PY -m bench load-sweep --resume --out "$OUT/load-sweep"

log "scaling"
$PY -m bench scaling --out "$OUT/scaling"

log "profiles"
$PY -m bench profile --out "$OUT/profile" --strategy round_robin
$PY -m bench profile --out "$OUT/profile" --strategy probe --stream
log "benchmarks done"

log "collect the small artifacts (tables, summaries, plots) into bench/results"
collect() {  # collect SRC DEST: *.md, *.json (not per-request data), *.png, and each run's summary.json
  local src=$1 dest=$2
  mkdir -p "$dest"
  find "$src" -maxdepth 1 -type f \( -name '*.md' -o -name '*.json' -o -name '*.png' \) -exec cp {} "$dest/" \;
  find "$src" -mindepth 2 -name summary.json | while read -r f; do
    rel=${f#"$src"/}; cp "$f" "$dest/$(dirname "$rel" | tr '/' '_').summary.json"
  done
}
for d in suite prefix-groups trace trace-variants trace-light multiturn offload-sweep engine-idle overhead sweep-threshold load-sweep scaling profile; do
  [[ -d "$OUT/$d" ]] && collect "$OUT/$d" "bench/results/$d"
done
# The load sweep's per-mode CDF and bar plots have 25 entries each: too many to read.
rm -f bench/results/load-sweep/ttft_cdf.png bench/results/load-sweep/hit_ratio.png
log "collected"
