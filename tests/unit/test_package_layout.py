"""The layout rules the codebase keeps: the router never imports the launcher (it reaches it
through the engine-starter entry point), every router module says what it is for, none
outgrows what a reader can hold (about 400 lines), and the unit tests mirror the modules:
router/<package>/<module>.py is tested in tests/unit/<package>/test_<module>.py, unless it
is listed below with where it is tested instead."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"


MODULES = sorted(ROUTER.rglob("*.py"))


MAX_LINES = 400
UNIT = Path(__file__).resolve().parent

# Modules without a unit test file of their own, and why. Each is exercised by the suites
# that run a router (tests/integration, tests/reliability); a unit test added for one
# removes it from this list (the test below fails while it is still listed).
NO_UNIT_TEST = {
    "admission/body.py": "reads an aiohttp request: tests/reliability/test_hostile_input.py",
    "cli.py": "the process entry point: tests/integration/test_cli_env_and_sighup.py",
    "config/checks.py": "through parse_config: tests/integration/test_config.py",
    "config/event_sockets.py": "loopback engines' ipc paths: tests/launcher/test_launcher_ports.py, test_config.py",
    "config/kv_events.py": "through parse_config: tests/integration/test_config.py",
    "fleet/kv_events.py": "subscribes to real ZMQ publishers: tests/integration/test_kv_events_subscriber.py",
    "observability/kv_metrics.py": "scraped in tests/integration/test_kv_events_subscriber.py",
    "config/parse.py": "tests/integration/test_config.py, tests/unit/config/test_discovery.py",
    "config/schema.py": "dataclasses read through parse_config: tests/integration/test_config.py",
    "config/launch.py": "[[engines]] and [launcher] read through parse_config: tests/integration/test_config.py, tests/launcher",
    "engine/errors.py": "an exception type, read by every leg test",
    "engine/stream.py": "a streamed leg over HTTP: tests/integration/test_upstream_stream.py",
    "fleet/capability.py": "asks a running engine: tests/integration/test_capability.py",
    "fleet/discovery.py": "DNS look-ups: tests/integration/test_discovery_dns.py",
    "fleet/engine_starter.py": "starts engines through the launcher: tests/launcher",
    "fleet/adapters.py": "loads adapters on running engines: tests/integration/test_lora_adapters.py",
    "fleet/health.py": "checks running engines: tests/reliability/test_health.py",
    "fleet/kubernetes.py": "the Kubernetes API: tests/integration/test_discovery_kubernetes.py",
    "fleet/lookup.py": "a protocol, no behaviour of its own",
    "names.py": "enumerations, no behaviour of their own",
    "observability/record.py": "filled in by the Dispatcher: tests/unit/dispatch/test_pipeline.py",
    "observability/tracing.py": "spans of a running router: tests/integration/test_tracing.py",
    "server/admin.py": "tests/integration/test_fleet_admin.py, test_admin_drain.py",
    "server/app.py": "the application every integration test starts",
    "server/forward.py": "tests/integration/test_forward.py",
    "server/generation.py": "the generation routes every integration test calls",
    "server/lora_routes.py": "tests/integration/test_lora_adapters.py",
    "server/relay.py": "tests/integration/test_forward.py",
    "server/reload.py": "tests/integration/test_reload.py, test_cli_env_and_sighup.py",
    "server/services.py": "protocols, no behaviour of their own",
    "server/state.py": "the running router every integration test starts",
}


def _imported(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_router_modules_were_found() -> None:
    assert len(MODULES) > 30


def test_the_router_never_imports_the_launcher() -> None:
    offenders = {
        str(p.relative_to(ROUTER)): sorted(
            n for n in _imported(ast.parse(p.read_text())) if n.split(".")[0] == "engine_launcher"
        )
        for p in MODULES
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_router_module_says_what_it_is_for() -> None:
    missing = [str(p.relative_to(ROUTER)) for p in MODULES if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_no_module_anywhere_is_over_the_line_budget() -> None:
    """The router, the launcher and simulator, the bench and the tests alike."""
    repo = ROUTER.parent
    files = [p for d in ("router", "engine_launcher", "bench", "tests") for p in sorted((repo / d).rglob("*.py"))]
    assert len(files) > 200
    long = {str(p.relative_to(repo)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _unit_test_of(module: Path) -> Path:
    rel = module.relative_to(ROUTER)
    return UNIT / rel.parent / f"test_{rel.name}"


def test_every_router_module_has_a_unit_test_or_says_where_it_is_tested() -> None:
    modules = [p for p in MODULES if p.name not in ("__init__.py", "__main__.py")]
    untested = sorted(str(p.relative_to(ROUTER)) for p in modules if not _unit_test_of(p).exists())
    assert untested == sorted(NO_UNIT_TEST)


def test_unit_test_directories_mirror_router_packages() -> None:
    packages = {p.relative_to(ROUTER) for p in ROUTER.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    test_dirs = {p.relative_to(UNIT) for p in UNIT.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert test_dirs <= packages
