"""Load without the asyncio load generator, for measuring a proxy's own latency and
throughput: blocking HTTP/1.1 keep-alive clients (one request at a time, so the client adds
no queueing of its own) and wrk (many connections, C code, so the client is not the
bottleneck)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness.procs import pinned
from bench.harness.stats import percentile

SMALL = {"model": "sim-model", "prompt": "Hello router, this is a small request.", "max_tokens": 32}


def http_request(host: str, port: int, path: str, body: dict[str, Any]) -> bytes:
    b = json.dumps(body, separators=(",", ":")).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(b)}\r\n\r\n"
    ).encode() + b


class BlockingClient:
    """One keep-alive HTTP/1.1 connection; reads Content-Length or chunked answers."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.sock: socket.socket | None = None

    def connect(self) -> None:
        self.close()
        s = socket.create_connection((self.host, self.port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = s
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _recv(self) -> bytes:
        assert self.sock is not None
        d = self.sock.recv(65536)
        if not d:
            raise ConnectionError("connection closed")
        return d

    def roundtrip(self, req: bytes) -> tuple[float, float, int]:
        """(seconds to the whole answer, seconds to the first body byte, status)."""
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        t0 = time.perf_counter()
        self.sock.sendall(req)
        buf = self.buf
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        end = buf.index(b"\r\n\r\n")
        head = buf[:end].decode("latin-1")
        rest = buf[end + 4 :]
        status = int(head.split(" ", 2)[1])
        lower = head.lower()
        m = re.search(r"content-length:\s*(\d+)", lower)
        first = None
        if m:
            n = int(m.group(1))
            while len(rest) < n:
                rest += self._recv()
            first = time.perf_counter()
            self.buf = rest[n:]
        elif "transfer-encoding: chunked" in lower:
            while not rest:
                rest += self._recv()
            first = time.perf_counter()
            # Walk chunk frames until the zero-size one.
            pos = 0
            while True:
                while rest.find(b"\r\n", pos) < 0:
                    rest += self._recv()
                nl = rest.index(b"\r\n", pos)
                size = int(rest[pos:nl].split(b";")[0], 16)
                need = nl + 2 + size + 2
                while len(rest) < need:
                    rest += self._recv()
                pos = need
                if size == 0:
                    break
            self.buf = rest[pos:]
        else:  # read to close
            try:
                while True:
                    rest += self._recv()
            except ConnectionError:
                pass
            first = time.perf_counter()
            self.close()
        t1 = time.perf_counter()
        if "connection: close" in lower:
            self.close()
        return t1 - t0, (first or t1) - t0, status


def measure_latency(port: int, path: str, body: dict[str, Any], n: int) -> dict[str, Any]:
    c = BlockingClient(port)
    req = http_request("127.0.0.1", port, path, body)
    for _ in range(min(50, n)):  # warm-up: connections, pools, caches
        c.roundtrip(req)
    whole, first, bad = [], [], 0
    for _ in range(n):
        try:
            t, f, st = c.roundtrip(req)
        except (ConnectionError, OSError):
            c.connect()
            bad += 1
            continue
        if st != 200:
            bad += 1
        whole.append(t * 1e6)
        first.append(f * 1e6)
    c.close()
    return {
        "p50_us": percentile(whole, 50),
        "p99_us": percentile(whole, 99),
        "first_p50_us": percentile(first, 50),
        "errors": bad,
    }


WRK_LUA = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""


def run_wrk(
    port: int, body: dict[str, Any], connections: int, duration: float, cores: list[int] | None, tmp: Path
) -> dict[str, Any]:
    script = tmp / f"wrk_{abs(hash(json.dumps(body)))}.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(body, separators=(",", ":"))))
    cmd = pinned(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}/v1/completions",
        ],
        cores,
    )
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    out = p.stdout
    rps = re.search(r"Requests/sec:\s*([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(rps.group(1)) if rps else None,
        "requests": int(total.group(1)) if total else 0,
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(map(int, errs.groups())) if errs else 0,
        "raw": out if not rps else "",
    }
