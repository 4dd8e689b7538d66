"""What a `[[discovery]]` look-up is (DNS: router/fleet/discovery.py; Kubernetes:
router/fleet/kubernetes.py): a call that returns the backends found, or fails."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from router.config.schema import BackendConfig, DiscoveryConfig

Lookup = Callable[[], Awaitable[dict[str, BackendConfig]]]


class LookupFailed(Exception):
    """The directory did not answer: keep the engines as they are."""


def backend_for(d: DiscoveryConfig, address: str, label: str) -> BackendConfig:
    """The backend of one address found by table `d`; `label` makes the name readable
    (the DNS name, or the pod's name)."""
    host = f"[{address}]" if ":" in address else address
    return BackendConfig(
        name=f"{label}@{host}:{d.port}",
        url=f"{d.scheme}://{host}:{d.port}",
        role=d.role,
        models=d.models,
        api_key=d.api_key,
        kv_events_endpoint=f"tcp://{host}:{d.kv_events_port}" if d.kv_events_port else "",
        kv_events_replay_endpoint=f"tcp://{host}:{d.kv_events_replay_port}" if d.kv_events_replay_port else "",
        kv_events_topic=d.kv_events_topic,
    )
