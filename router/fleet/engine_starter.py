"""Starting the engines `[[engines]]` declares, through the launcher registered as a plugin.

The router never imports engine_launcher (the launcher imports the router's configuration,
so the dependency runs one way): the launcher registers its Supervisor under the
`cachehit_router.engine_starter` entry point (pyproject.toml), and a router whose
configuration declares engines loads it from there. A router without `[[engines]]` needs
no launcher at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

from router.config.schema import EngineConfig, LauncherConfig

ENTRY_POINT_GROUP = "cachehit_router.engine_starter"


class EngineStarter(Protocol):
    async def start(self, progress: Callable[[Any], None] | None = None) -> dict[str, str]:
        """Start every engine; their base URLs by name once all are healthy."""
        ...

    def kv_event_endpoints(self) -> dict[str, tuple[str, str]]:
        """Engine name -> (stream, replay) endpoints of the KV-event streams the started
        engines publish, as the router connects to them; engines without one are absent."""
        ...

    async def stop(self) -> None: ...


def engine_starter(engines: Sequence[EngineConfig], launcher: LauncherConfig) -> EngineStarter:
    """The registered launcher, set up for these engines."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        raise RuntimeError(
            f"[[engines]] needs the engine launcher, and no {ENTRY_POINT_GROUP!r} entry point is "
            "installed: install this package with pip (pip install -e .) or remove [[engines]]"
        )
    factory = next(iter(found)).load()
    starter: EngineStarter = factory(engines, launcher)
    return starter
