"""Plain routing inputs for the pure planners: backend views and cluster snapshots at one
known engine speed, so each expected choice can be worked out by hand from the cost model
(router/routing/costmodel.py)."""

from __future__ import annotations

from router.config.schema import RoutingConfig
from router.fleet.registry import BackendRegistry
from router.routing.costmodel import EngineSpeed, TransferSpeed
from router.routing.planning import RouteQuery
from router.routing.snapshot import BackendView, ClusterSnapshot


def registry_view(r: BackendRegistry, name: str) -> BackendView:
    """What a planner sees of a configured backend `name` of registry `r` now."""
    view = r.snapshot().get(name)
    assert view is not None  # a configured backend
    return view


# 10 ms per step, 100 us per prompt token (10k tokens/s), 1 ms per decoding sequence.
SPEED = EngineSpeed(intercept_s=0.01, per_token_s=1e-4, per_decode_s=1e-3)


def view(
    name: str,
    *,
    decodes: bool = True,
    prefills: bool = False,
    available: bool = True,
    inflight: int = 0,
    running: float = 0.0,
    waiting: float = 0.0,
    kv: float = 0.0,
    models: tuple[str, ...] = ("m",),
    queued: float = 0.0,
    decoding: float = 0.0,
    speed: EngineSpeed = SPEED,
) -> BackendView:
    return BackendView(
        name=name,
        url=f"http://{name}",
        decodes=decodes,
        prefills=prefills,
        models=models,
        available=available,
        inflight=inflight,
        running=running,
        waiting=waiting,
        kv_usage=kv,
        queued_tokens=queued,
        decoding=decoding,
        speed=speed,
    )


TRANSFER = TransferSpeed(0.005, 1e-5)


def snap(
    *views: BackendView,
    transfer: TransferSpeed = TRANSFER,
    race_wait_s: float = 0.002,
    race_saving_share: float = 0.5,
) -> ClusterSnapshot:
    # Races measured alike for prompts the memory places and prompts it does not.
    return ClusterSnapshot(
        tuple(views),
        transfer=transfer,
        chars_per_token=4.0,
        race_wait_s=race_wait_s,
        race_saving_share=race_saving_share,
        race_saving_share_unplaced=race_saving_share,
    )


Q = RouteQuery(model="m", text="hello world " * 100, prompt_tokens=1000)


R = RoutingConfig()
