"""Fixtures of the reliability suite (engines that fail, stall and refuse).

- `make_cluster`: a router in this test's event loop in front of in-process simulated
  engines (support/cluster.py), for white-box checks (engine running counts).
- `procs`: engines and routers as real subprocesses (support/subprocess_cluster.py: SimProc, RouterProc), each
  stopped by its own process group at the end of the test, whatever happened.
- `fuzz_router`: one simulated engine and one router (real processes) per fuzzing module
  (support/fuzz_http.py).
- `stack`: the security tests' router, capture proxy and trap server (support/security_stack.py).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# A fixture is found by the name a test asks for: imported under its own name (an explicit
# re-export, which the linter keeps).
from support.cluster import make_cluster as make_cluster
from support.fuzz_http import fuzz_router as fuzz_router
from support.security_stack import stack as stack
from support.subprocess_cluster import RouterProc, SimProc


class Procs:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.all: list[SimProc | RouterProc] = []

    def sim(self, *args: str, port: int = 0) -> SimProc:
        s = SimProc(list(args), port=port, log_path=self.tmp_path / f"sim{len(self.all)}.log")
        self.all.append(s)
        return s.start()

    def router(
        self, config: dict[str, Any], extra_args: list[str] | None = None, ssl_ctx: ssl.SSLContext | None = None
    ) -> RouterProc:
        d = self.tmp_path / f"router{len(self.all)}"
        d.mkdir()
        r = RouterProc(config, d) if extra_args is None else RouterProc(config, d, extra_args=extra_args)
        self.all.append(r)
        return r.start(ssl_ctx=ssl_ctx)

    def stop_all(self) -> None:
        for p in reversed(self.all):
            p.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
