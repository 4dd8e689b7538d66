"""Fixtures of the reliability suite (engines that fail, stall and refuse).

- `make_cluster`: a router in this test's event loop in front of in-process simulated
  engines (tests/router/cluster_util.py), for white-box checks (engine running counts).
- `procs`: engines and routers as real subprocesses (relutil.SimProc / RouterProc), each
  stopped by its own process group at the end of the test, whatever happened.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for p in (_HERE, _HERE.parent / "router"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from cluster_util import make_cluster  # noqa: F401 - a fixture, used by name
from relutil import RouterProc, SimProc


class Procs:
    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.all: list = []

    def sim(self, *args: str, port: int = 0) -> SimProc:
        s = SimProc(list(args), port=port, log_path=self.tmp_path / f"sim{len(self.all)}.log")
        self.all.append(s)
        return s.start()

    def router(self, config: dict, extra_args: list[str] | None = None, ssl_ctx=None) -> RouterProc:
        d = self.tmp_path / f"router{len(self.all)}"
        d.mkdir()
        r = RouterProc(config, d, **({"extra_args": extra_args} if extra_args is not None else {}))
        self.all.append(r)
        return r.start(ssl_ctx=ssl_ctx)

    def stop_all(self) -> None:
        for p in reversed(self.all):
            p.stop()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
