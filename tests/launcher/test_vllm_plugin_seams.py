"""The plugin's seams in vLLM's source, and the versions it accepts.

`test_every_seam_is_in_the_vllm_source` reads the installed vLLM's source, or the tree
named by CACHEHIT_VLLM_SOURCE (the directory holding a `vllm` package, e.g. the `.py`
files unzipped from a wheel this machine cannot run):

    CACHEHIT_VLLM_SOURCE=/tmp/vllm-src python -m pytest tests/launcher/test_vllm_plugin_seams.py
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest

from engine_launcher.vllm_plugin import seams, version
from support.requirements import missing_dependency

SOURCE_ENV = "CACHEHIT_VLLM_SOURCE"


def _vllm_source() -> Path:
    given = os.environ.get(SOURCE_ENV)
    if given:
        return Path(given)
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        missing_dependency(f"vLLM is not installed and {SOURCE_ENV} is not set")
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_every_seam_is_in_the_vllm_source() -> None:
    root = _vllm_source()
    assert seams.check(root) == []


def test_a_moved_or_reshaped_seam_is_reported(tmp_path: Path) -> None:
    sched = tmp_path / seams.SCHEDULER
    sched.parent.mkdir(parents=True)
    sched.write_text(
        textwrap.dedent("""
            class Scheduler:
                def __init__(self):
                    self.requests = {}
                def _ec_transfer_pending(self, req, tokens):
                    return False
                def schedule(self):
                    return self._ec_transfer_pending(None, 0)
        """)
    )
    problems = seams.check(tmp_path)
    assert f"{seams.SCHEDULER}: Scheduler._ec_transfer_pending: parameters ['req', 'tokens'], expected " in "\n".join(
        problems
    )
    assert f"{seams.SCHEDULER}: Scheduler.schedule: no call self._ec_transfer_pending(request, ...)" in problems
    assert f"{seams.SCHEDULER}: Scheduler.connector: no such attribute" in problems
    assert f"{seams.SCHEDULER}: Scheduler.requests: no such attribute" not in problems
    assert f"{seams.ENGINE}: missing or unreadable" in problems
    assert seams.main([str(tmp_path)]) == 1


def test_an_enum_member_with_another_value_is_reported(tmp_path: Path) -> None:
    engine = tmp_path / seams.ENGINE
    engine.parent.mkdir(parents=True)
    engine.write_text("class FinishReason:\n    STOP = 0\n    REPETITION = 5\n")
    assert f"{seams.ENGINE}: FinishReason.REPETITION: value 5, expected 4" in seams.check(tmp_path)


@pytest.mark.parametrize("release", ["0.32.0", "0.32.1", "0.33.0", "0.33.2rc1"])
def test_both_series_are_accepted(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    monkeypatch.setattr(version, "installed_vllm_version", lambda: release)
    assert version.check_vllm_version() == release


@pytest.mark.parametrize("release", ["0.31.2", "0.34.0", "1.0.0", "unknown"])
def test_any_other_release_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    monkeypatch.setattr(version, "installed_vllm_version", lambda: release)
    with pytest.raises(version.UnsupportedVLLMVersion, match=rf"0\.32\.x and 0\.33\.x only; this is vLLM {release}\."):
        version.check_vllm_version()
