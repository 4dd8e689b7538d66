"""Helpers for the reliability tests: simulated engines and routers as real subprocesses.

Everything is started in its own process group and stopped by that group's id (never by
name: other engineers run engines on the same machine). Engines are the simulator's CLI
(`python -m engine_launcher.sim`), so SIGKILL is a real process death; the router is
`python -m router.cli --config X`, exactly what a user runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import tomli_w

from router.engine.sse import SSEDecoder
from support.ports import free_port
from support.processes import signal_group, start_group, stop_group

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (Linux /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SimProc:
    """One simulated engine in its own process (group)."""

    args: list[str] = field(default_factory=list)
    port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> SimProc:
        if not self.port:
            self.port = free_port()
        cmd = [
            PY,
            "-m",
            "engine_launcher.sim",
            "--port",
            str(self.port),
            "--model",
            MODEL,
            "--enable-admin",
            "--log-level",
            "warning",
            *self.args,
        ]
        # The child keeps its own copy of the log's descriptor.
        with open(self.log_path or os.devnull, "ab") as out:
            self.proc = start_group(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wait_http(self.url + "/health", timeout, self.proc)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, sig)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def restart(self, timeout: float = 30.0) -> SimProc:
        """Start again on the same port (a restarted engine keeps its URL)."""
        self.stop()
        deadline = time.monotonic() + timeout
        while True:  # the port may linger for a moment after the kill
            try:
                return self.start(timeout)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any] | None = None, ssl_ctx: Any = None) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=ssl_ctx) as r:
                if r.status == 200:
                    return
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s ({last!r})")


def to_toml(cfg: dict[str, Any]) -> str:
    return tomli_w.dumps(cfg)


@dataclass
class RouterProc:
    """`router --config X` as a subprocess."""

    config: dict[str, Any]
    workdir: Path
    extra_args: list[str] = field(default_factory=lambda: ["--no-engines"])
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The router's process (set by start())."""
        assert self.proc is not None, "the router was not started"
        return self.proc

    @property
    def log_path(self) -> Path:
        return self.workdir / "router.log"

    def start(self, timeout: float = 60.0, ssl_ctx: Any = None) -> RouterProc:
        server = self.config.setdefault("server", {})
        self.port = server.setdefault("port", free_port())
        server.setdefault("host", "127.0.0.1")
        if server.get("tls_cert"):
            self.scheme = "https"
        cfg_path = self.workdir / "router.toml"
        cfg_path.write_text(to_toml(self.config))
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = start_group(
                [PY, "-m", "router.cli", "--config", str(cfg_path), *self.extra_args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_http(self.url + "/health", timeout, self.proc, ssl_ctx=ssl_ctx)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError("router did not start:\n" + self.log_tail()) from e
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=15.0)

    def rss(self) -> int:
        assert self.proc is not None
        return rss_bytes(self.proc.pid)


def sim_backends(engines: dict[str, SimProc]) -> list[dict[str, Any]]:
    return [{"name": n, "url": e.url, "role": "decode", "models": [MODEL]} for n, e in engines.items()]


async def set_faults(session: aiohttp.ClientSession, engine_url: str, **faults: float) -> None:
    async with session.post(engine_url + "/_sim/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def sim_state(session: aiohttp.ClientSession, engine_url: str) -> dict[str, Any]:
    async with session.get(engine_url + "/_sim/state") as r:
        state: dict[str, Any] = orjson.loads(await r.read())
        return state


@dataclass
class Outcome:
    """What one client request ended as."""

    status: int
    kind: str  # "completed" | "error" | "lost"
    detail: str = ""
    tokens: int = 0


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    within: float,
    path: str = "/v1/completions",
    headers: dict[str, Any] | None = None,
) -> Outcome:
    """One streamed request, classified. `lost`: a hang past `within` seconds, a stream without
    [DONE], a wrong token count without an error, several ids: anything that is neither a
    correct answer nor a clear error."""
    max_tokens = body["max_tokens"]
    try:
        async with asyncio.timeout(within):
            async with session.post(
                url + path,
                data=orjson.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                headers={"Content-Type": "application/json", **(headers or {})},
            ) as r:
                if r.status != 200:
                    raw = await r.read()
                    try:
                        err = orjson.loads(raw)["error"]
                        assert isinstance(err["message"], str)
                        assert err["code"] == r.status
                    except Exception:
                        return Outcome(r.status, "lost", f"unparseable error body {raw[:200]!r}")
                    return Outcome(r.status, "error", err["message"])
                events: list[Any] = []  # parsed chunks, then "[DONE]"
                decoder = SSEDecoder()
                async for data in r.content.iter_any():
                    for p in decoder.feed(data):
                        events.append("[DONE]" if p == b"[DONE]" else orjson.loads(p))
    except TimeoutError:
        return Outcome(0, "lost", f"no end within {within} s")
    except aiohttp.ClientError as e:
        return Outcome(0, "lost", f"connection error {e!r}")
    if not events or events[-1] != "[DONE]":
        return Outcome(200, "lost", f"stream ended without [DONE] after {len(events)} events")
    chunks = events[:-1]
    errs = [c for c in chunks if "error" in c]
    if errs:
        error = errs[0]["error"]
        if chunks[-1] is not errs[0] or not isinstance(error.get("message"), str):
            return Outcome(200, "lost", f"malformed error event {errs[0]!r}")
        return Outcome(error.get("code", 0), "error", error["message"])
    ids = {c["id"] for c in chunks}
    usage = chunks[-1].get("usage") if chunks else None
    texts = sum(1 for c in chunks for ch in c.get("choices", []) if ch.get("text"))
    token_ids = sum(len(ch.get("token_ids") or ()) for c in chunks for ch in c.get("choices", []))
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    if len(ids) != 1:
        return Outcome(200, "lost", f"{len(ids)} ids in one answer")
    if not usage or usage.get("completion_tokens") != max_tokens:
        return Outcome(200, "lost", f"usage {usage!r}, expected {max_tokens} completion tokens")
    if finishes != ["length"]:
        return Outcome(200, "lost", f"finish reasons {finishes!r}")
    return Outcome(200, "completed", tokens=max(texts, token_ids))


async def unary_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, within: float, path: str = "/v1/completions"
) -> Outcome:
    """One non-streaming request, classified like `stream_request`."""
    max_tokens = body["max_tokens"]
    try:
        async with asyncio.timeout(within):
            async with session.post(
                url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
            ) as r:
                raw = await r.read()
                status = r.status
    except TimeoutError:
        return Outcome(0, "lost", f"no answer within {within} s")
    except aiohttp.ClientError as e:
        return Outcome(0, "lost", f"connection error {e!r}")
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Outcome(status, "lost", f"unparseable body {raw[:200]!r}")
    if status != 200:
        err = out.get("error") if isinstance(out, dict) else None
        if not isinstance(err, dict) or err.get("code") != status or not isinstance(err.get("message"), str):
            return Outcome(status, "lost", f"malformed error {raw[:200]!r}")
        return Outcome(status, "error", err["message"])
    choice = out["choices"][0]
    if out.get("usage", {}).get("completion_tokens") != max_tokens or choice.get("finish_reason") != "length":
        return Outcome(200, "lost", f"usage {out.get('usage')!r}, finish {choice.get('finish_reason')!r}")
    return Outcome(200, "completed", tokens=max_tokens)
