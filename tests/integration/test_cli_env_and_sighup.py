"""The `router` command: configuration from the environment and flags, `--version`, and
SIGHUP re-reading the file in a real router process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.config.overrides import layer
from router.config.schema import ConfigError
from router.server.settings import load_checked as load
from support.cluster import MODEL
from support.polling import eventually
from support.ports import free_port
from support.processes import start_group

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def toml(backends: list[tuple[str, str]], extra: str = "") -> str:
    return extra + "".join(f'[[backends]]\nname = "{n}"\nurl = "{u}"\nrole = "decode"\n' for n, u in backends)


def test_environment_and_flags_override_the_file(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text(toml([("a", "http://127.0.0.1:9")], '[server]\nport = 1111\napi_keys = ["in-file"]\n'))
    env = {
        "CACHEHIT_ROUTER_API_KEYS": "k1, k2",
        "CACHEHIT_ROUTER_ADMIN_API_KEY": "adm",
        "CACHEHIT_ROUTER_PORT": "2222",
        "CACHEHIT_ROUTER_HOST": "0.0.0.0",
        "CACHEHIT_ROUTER_LOG_LEVEL": "warning",
        "CACHEHIT_ROUTER_STRATEGY": "prefix_tree",
        "CACHEHIT_ROUTER_BACKEND_API_KEY": "engine-key",
    }
    cfg = load(f, env)
    assert cfg.server.api_keys == ("k1", "k2")
    assert cfg.server.admin_api_key == "adm"
    assert (cfg.server.host, cfg.server.port, cfg.server.log_level) == ("0.0.0.0", 2222, "warning")
    assert cfg.routing.strategy == "prefix_tree"
    assert cfg.backends[0].api_key == "engine-key"
    # A flag beats the environment; an empty variable is unset (auth is not switched off).
    cfg = load(f, {**env, "CACHEHIT_ROUTER_API_KEYS": ""}, {"server.port": 3333, "server.host": None})
    assert cfg.server.port == 3333
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.api_keys == ("in-file",)
    # Bad values name the variable (type) or the key they set (range).
    with pytest.raises(ConfigError) as e:
        load(f, {"CACHEHIT_ROUTER_PORT": "eighty"})
    assert str(e.value) == "CACHEHIT_ROUTER_PORT: expected an integer, got 'eighty'"
    with pytest.raises(ConfigError) as e:
        load(f, {"CACHEHIT_ROUTER_STRATEGY": "random"})
    assert "routing.strategy: expected one of" in str(e.value)
    assert layer({}, {}) == {}


def test_check_config_shows_the_environment_without_printing_secrets(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text(toml([("a", "http://127.0.0.1:9")]))
    r = run_cli(
        "check-config",
        env={"CACHEHIT_ROUTER_CONFIG": str(f), "CACHEHIT_ROUTER_API_KEYS": "sk-env", "CACHEHIT_ROUTER_PORT": "4321"},
    )
    assert r.returncode == 0, r.stderr
    out = orjson.loads(r.stdout)
    assert out["server"]["port"] == 4321
    assert out["server"]["api_keys"] == ["***"]
    assert "sk-env" not in r.stdout


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0
    from importlib.metadata import version

    assert r.stdout.strip() == f"router (cachehit-router) {version('cachehit-router')}"


async def test_sighup_reloads_backends_and_names_fixed_keys_in_a_running_router(tmp_path: Path) -> None:
    a = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0, role="consumer"), port=0)
    b = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0, role="consumer"), port=0)
    port = free_port()
    f = tmp_path / "router.toml"
    f.write_text(toml([("a", a.url)], "[health]\nscrape_interval_s = 0.2\ncheck_interval_s = 0.4\n"))
    # In its own process group (support/processes.py), like every process a test starts.
    proc = start_group(
        [sys.executable, "-m", "router.cli", "--config", str(f), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "CACHEHIT_ROUTER_ADMIN_API_KEY": "adm"},
    )
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": "Bearer adm"}
    try:
        async with aiohttp.ClientSession() as s:

            async def names() -> set[str] | bool:
                try:
                    async with s.get(url + "/admin/backends", headers=admin) as r:
                        return r.status == 200 and {
                            x["name"] for x in await r.json() if x["healthy"] and not x["removing"]
                        }
                except aiohttp.ClientError:  # not listening yet
                    return False

            assert await eventually(names, 30, "the router to start") == {"a"}
            # b replaces a; a timeout cannot change while running (a warning names it). The
            # port in the file does not count: the --port flag still overrides it.
            f.write_text(
                toml(
                    [("b", b.url)],
                    "[health]\nscrape_interval_s = 0.2\ncheck_interval_s = 0.4\n"
                    "[server]\nport = 1\n[timeouts]\nidle_s = 7\n",
                )
            )
            proc.send_signal(signal.SIGHUP)
            await eventually(lambda: _eq(names, {"b"}), 30, "the reload")
            async with s.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200  # still serving on the same port
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        await a.close()
        await b.close()
    assert proc.returncode == 0, err
    # The router logs JSON lines by default: one message each.
    messages = [json.loads(line)["message"] for line in err.decode().splitlines() if line.startswith("{")]
    assert any(
        m.endswith("cannot change while the router runs, restart it to apply them: timeouts.idle_s") for m in messages
    ), messages
    assert any(m.startswith("reload applied: backends") for m in messages), messages


async def _eq(fn: Callable[[], Awaitable[object]], expected: object) -> bool:
    return await fn() == expected


async def test_sighup_while_the_engines_start_is_applied_once_the_router_is_up(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process: the handler is there before the engines
    start, and a reload asked for meanwhile runs once the router is up."""
    port = free_port()
    f = tmp_path / "router.toml"
    engines = (
        f'[launcher]\nlog_dir = "{tmp_path / "logs"}"\nstartup_timeout_s = 60\n'
        f'[[engines]]\nname = "e0"\nkind = "sim"\nrole = "both"\nmodel = "{MODEL}"\n'
    )
    f.write_text(engines)
    proc = start_group(
        [sys.executable, "-m", "router", "--config", str(f), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    lines: list[str] = []
    stderr = proc.stderr
    assert stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in stderr), daemon=True)
    reader.start()

    def logged(text: str) -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited ({proc.returncode}): {''.join(lines)}")
        return any(text in line for line in lines)

    url = f"http://127.0.0.1:{port}"
    try:
        await eventually(lambda: logged("starting 1 engine(s)"), 30, "the engines to start")
        f.write_text('[routing]\nstrategy = "round_robin"\n' + engines)
        proc.send_signal(signal.SIGHUP)
        await eventually(lambda: logged("reload applied: routing"), 60, "the reload once the router is up")
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        stderr.close()
    assert proc.returncode == 0, "".join(lines)
    messages = [json.loads(line)["message"] for line in lines if line.startswith("{")]
    started = next(i for i, m in enumerate(messages) if m.startswith("router ready"))
    asked = next(i for i, m in enumerate(messages) if m.startswith("SIGHUP while the router starts"))
    assert asked < started  # it came while the engines started
