"""Where a LoRA adapter no engine holds is loaded: the decoder the cost model predicts
soonest for a request now (the least queued work, as `least_loaded` chooses), among the
available ones with room for another adapter (`routing.max_adapters_per_engine`). Engines
behind one address (DP ranks) hold one set of adapters: a load there loads every rank,
so they count as one."""

from __future__ import annotations

from router.routing.planning import fastest
from router.routing.snapshot import ClusterSnapshot


def engine_for_adapter(snap: ClusterSnapshot, max_per_engine: int, salt: int = 0) -> str | None:
    """The backend to load an adapter on, None when every engine is full or unavailable."""
    candidates = [b for b in snap.decoders(None) if b.available and len(b.adapters) < max_per_engine]
    if not candidates:
        return None
    best, _ = fastest(candidates, lambda b: 0.0, salt)
    return best.name
