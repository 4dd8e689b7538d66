"""The prefix memory's real size at its cap, and what one tenant's flood leaves the others.

    python -m bench prefix-memory [--max-mib 64] [--tenants 8] [--flood-prompts 16]
                                  [--flood-mb 4]

Fills a `PrefixMemory` (router/routing/prefix_memory.py) to its byte budget with prompts of
`--tenants` tenants (each a shared system prompt and unique turns over 4 engines), measures
the bytes it holds with tracemalloc (every allocation made while filling, the hashes cache
included), then lets one tenant send `--flood-prompts` unique prompts of `--flood-mb` MB
and reports how many of the other tenants' system prompts are still matched.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc

from router.routing.prefix_memory import ENTRY_BYTES, PrefixMemory


def _text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=chars))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench prefix-memory")
    p.add_argument("--max-mib", type=float, default=64.0)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--flood-prompts", type=int, default=16)
    p.add_argument("--flood-mb", type=float, default=4.0)
    a = p.parse_args(argv)
    rng = random.Random(1)
    systems = {f"t{i}": _text(rng, 8192) for i in range(a.tenants)}
    turn = _text(rng, 200_000)

    gc.collect()
    tracemalloc.start()
    mem = PrefixMemory(max_bytes=int(a.max_mib * 2**20))
    t0 = time.perf_counter()
    i = 0
    while len(mem) < mem.max_entries:
        tenant = f"t{i % a.tenants}"
        offset = rng.randrange(0, len(turn) - 16_384)
        prompt = systems[tenant] + turn[offset : offset + 16_384] + str(i)
        mem.insert(mem.chunk_hashes(prompt), f"d{i % 4}", tenant=tenant)
        i += 1
    fill_s = time.perf_counter() - t0
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"prefix memory at its cap: budget {a.max_mib:g} MiB, {len(mem):,} entries "
        f"(estimate {mem.approx_bytes / 2**20:.1f} MiB at {ENTRY_BYTES} B each), "
        f"measured {held / 2**20:.1f} MiB ({held / len(mem):.0f} B per entry), filled in {fill_s:.1f} s"
    )

    flood = "flood"
    t0 = time.perf_counter()
    for k in range(a.flood_prompts):
        big = str(k) + _text(random.Random(k), int(a.flood_mb * 1e6))
        mem.insert(mem.chunk_hashes(big), "d0", tenant=flood)
    flood_s = time.perf_counter() - t0
    kept = sum(1 for t, s in systems.items() if mem.match(mem.chunk_hashes(s))[0] == len(mem.chunk_hashes(s)))
    print(
        f"after {a.flood_prompts} unique {a.flood_mb:g} MB prompts of one tenant ({flood_s:.1f} s): "
        f"{len(mem):,} entries, the flooder holds {mem.entries_of(flood):,}, "
        f"{kept}/{len(systems)} other tenants' system prompts still matched whole"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
