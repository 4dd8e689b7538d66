"""The routing modes the bench knows, in one place: our router's strategies (read from its
policy registry, so a new policy is benchmarked without editing the bench), the peer
routers' modes, and `oracle` (the infinite-cache bound, which runs nothing).
"""

from __future__ import annotations

from router.routing.policies import POLICIES

# Our router's [routing] strategies, in the registry's order.
ROUTER_MODES: tuple[str, ...] = tuple(POLICIES)
# The strategy that asks the engines (the probe race).
PROBE = "probe"
# Our strategies that do not ask the engines: the suite's regret is against the best of them.
BASELINES: tuple[str, ...] = tuple(m for m in ROUTER_MODES if m != PROBE)
ORACLE = "oracle"
# Probe with routing.split fixed by the operator (the goodput choice's two extremes).
SPLIT_MODES = {"probe_split_always": "always", "probe_split_never": "never"}
# Every mode our router runs.
OUR_MODES: tuple[str, ...] = (*ROUTER_MODES, *SPLIT_MODES)


# The suite's A/A control runs a mode a second time under this suffix: the same routing
# and settings on a fresh cluster. Only the bench sees the label; the run itself gets
# routing_mode(label).
CONTROL_SUFFIX = "~control"


def control_label(mode: str) -> str:
    return mode + CONTROL_SUFFIX


def routing_mode(label: str) -> str:
    """The mode a suite label runs: the mode itself, or the one its control repeats."""
    return label.removesuffix(CONTROL_SUFFIX)


def strategy_of(mode: str) -> str:
    """Our router's routing.strategy for one of OUR_MODES."""
    return PROBE if mode in SPLIT_MODES else mode


# Peer routers: mode -> the peer's own policy name.
EXTERNAL_MODES = {"vllm_router_rr": "round_robin", "vllm_router_cache_aware": "cache_aware"}  # vllm-router
SMG_MODES = {"smg_rr": "round_robin", "smg_cache_aware": "cache_aware"}  # SGLang's router
PEER_EXECUTABLES = {**dict.fromkeys(EXTERNAL_MODES, "vllm-router"), **dict.fromkeys(SMG_MODES, "smg")}

ALL_MODES: tuple[str, ...] = (*ROUTER_MODES, *SPLIT_MODES, *EXTERNAL_MODES, *SMG_MODES, ORACLE)

# Tables and suite runs list our strategies from the most cache-aware down; a policy not
# named here follows in the registry's order.
_LISTED_FIRST = (PROBE, "prefix_tree", "least_loaded", "round_robin")
_RANK = {m: i for i, m in enumerate(_LISTED_FIRST)}
TABLE_ORDER: tuple[str, ...] = tuple(sorted(ROUTER_MODES, key=lambda m: _RANK.get(m, len(_RANK))))
# The suite's default: the bound, every strategy of ours, probe with split always / never.
SUITE_MODES: tuple[str, ...] = (ORACLE, *TABLE_ORDER, *SPLIT_MODES)
