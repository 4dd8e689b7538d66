"""The layout rules the codebase keeps: the router never imports the launcher (it reaches it
through the engine-starter entry point), every router module says what it is for, and none
outgrows what a reader can hold (about 400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"
MODULES = sorted(ROUTER.rglob("*.py"))
MAX_LINES = 400


def _imported(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_router_modules_were_found():
    assert len(MODULES) > 30


def test_the_router_never_imports_the_launcher():
    offenders = {
        str(p.relative_to(ROUTER)): sorted(
            n for n in _imported(ast.parse(p.read_text())) if n.split(".")[0] == "engine_launcher"
        )
        for p in MODULES
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_router_module_says_what_it_is_for():
    missing = [str(p.relative_to(ROUTER)) for p in MODULES if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_no_router_module_is_over_the_line_budget():
    long = {str(p.relative_to(ROUTER)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
