"""The benchmark harness's processes (bench/harness/procs.py): a process that exits before
it answers is told apart (`ExitedBeforeReady`), with its log's tail, so a run whose cluster
never started can be started again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.harness.procs import ExitedBeforeReady, ProcessSet, free_ports, wait_http


async def test_a_process_that_exits_before_it_answers_says_so_with_its_log(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    with ProcessSet(tmp_path) as procs:
        proc = procs.start("sim", [sys.executable, "-c", "print('cannot bind: Address already in use'); exit(1)"])
        with pytest.raises(ExitedBeforeReady) as e:
            await wait_http(f"http://127.0.0.1:{port}/health", proc, 30)
    assert "sim exited (1)" in str(e.value)
    assert "Address already in use" in str(e.value)
