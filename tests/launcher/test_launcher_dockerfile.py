"""The router image's Dockerfile essentials (no Docker engine is needed to check them)."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def test_final_stage_is_slim_python_and_runs_as_non_root() -> None:
    stage = final_stage()
    assert stage[0] == ("FROM", "python:3.11-slim")
    users = [a for w, a in stage if w == "USER"]
    assert users, "the runtime stage must switch to an unprivileged user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # The uid the USER names is created in the same stage.
    assert any(w == "RUN" and f"--uid {user}" in a for w, a in stage)


def test_entrypoint_cmd_expose_and_healthcheck() -> None:
    stage = dict((w, a) for w, a in final_stage() if w in ("ENTRYPOINT", "CMD", "EXPOSE"))
    assert json.loads(stage["ENTRYPOINT"]) == ["router"]
    cmd = json.loads(stage["CMD"])
    assert cmd[:2] == ["--config", "/etc/cachehit-router/router.toml"]
    assert stage["EXPOSE"] == "8000"
    # `router` is the project's console script.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["router"] == "router.cli:main"

    (health,) = [a for w, a in final_stage() if w == "HEALTHCHECK"]
    argv = json.loads(health[health.index("CMD") + 3 :].strip())
    assert argv[:2] == ["python", "-c"]  # slim images have no curl
    compile(argv[2], "<healthcheck>", "exec")
    env = " ".join(a for w, a in final_stage() if w == "ENV")
    assert "ROUTER_HEALTH_URL=http://127.0.0.1:8000/health" in env


def test_project_installed_without_engine_extras() -> None:
    runs = " ".join(a for w, a in instructions() if w == "RUN")
    assert "pip wheel" in runs
    assert "pip install" in runs
    for extra in ("[gpu]", "[cpu]", "vllm", "nixl"):
        assert extra not in runs


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]

    def included(path: str) -> bool:
        # Docker semantics: the last matching pattern wins; "!" re-includes.
        keep = True
        for p in patterns:
            neg = p.startswith("!")
            pat = p[1:] if neg else p
            pat = pat.rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*") or pat == "**":
                keep = neg
        return keep

    for w, a in instructions():
        if w == "COPY" and "--from" not in a:
            for src in a.split()[:-1]:
                assert (REPO / src).exists(), src
                assert included(src), f"{src} is excluded by .dockerignore"
    assert not included(".venv")
    assert not included("tests")
    assert not included(".git")


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: it comes with the test extra (pip install -e '.[test]')"
    return subprocess.run(
        [exe, "--no-color", "--failure-threshold", "info", str(path)], capture_output=True, text=True, timeout=120
    )


def test_hadolint_finds_nothing_in_the_dockerfile(tmp_path: Path) -> None:
    # The linter is live: a Dockerfile with known faults is flagged...
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN cd /app\n")
    flagged = _hadolint(bad)
    assert flagged.returncode != 0
    assert "DL3007" in flagged.stdout, flagged.stdout
    assert "DL3008" in flagged.stdout, flagged.stdout
    # ...and ours has no finding at any level.
    r = _hadolint(REPO / "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not r.stdout.strip(), r.stdout + r.stderr
