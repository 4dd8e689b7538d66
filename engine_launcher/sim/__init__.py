"""A vLLM-compatible engine simulator (docs/SIMULATOR.md).

In-process API (stable; used by router tests, the launcher and the benchmarks)::

    from engine_launcher.sim import SimEngineConfig, start_sim_engine
    eng = await start_sim_engine(SimEngineConfig(model="sim-model", speed=1000.0),
                                 host="127.0.0.1", port=0)   # port 0: a free port
    eng.url       # "http://127.0.0.1:PORT"
    eng.port
    eng.engine    # the SimEngine, for white-box checks (num_running, kv.usage, ...)
    await eng.close()

Command line: `python -m engine_launcher.sim --port 8001 [--port 8002 ...] [options]`.
"""

from __future__ import annotations

from .config import FaultConfig, SimEngineConfig, TimingModel
from .engine import SimEngine
from .server import SimServer

__all__ = [
    "FaultConfig",
    "SimEngine",
    "SimEngineConfig",
    "SimEngineHandle",
    "SimServer",
    "TimingModel",
    "start_sim_engine",
]


class SimEngineHandle:
    """A running simulated engine: its address, the engine object, and `close()`."""

    def __init__(self, server: SimServer, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def engine(self) -> SimEngine:
        return self.server.engine

    @property
    def config(self) -> SimEngineConfig:
        return self.server.config

    async def close(self) -> None:
        await self.server.close()

    async def __aenter__(self) -> SimEngineHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_sim_engine(
    config: SimEngineConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> SimEngineHandle:
    """Start one simulated engine in the running event loop and return once it listens."""
    server = SimServer(config or SimEngineConfig())
    actual = await server.start(host, port)
    return SimEngineHandle(server, host, actual)
