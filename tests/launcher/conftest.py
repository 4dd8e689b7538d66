"""Shared helpers for the launcher tests (`kill_leftovers` is in tests/conftest.py).

`fake_python` is a stand-in interpreter for failure paths the real simulator cannot be
made to show on demand (never healthy, ignores SIGTERM, leaves a grandchild). It is passed
as `Supervisor(python=...)`, ignores `-m module`, and behaves as FAKE_MODE says:
  serve        answer GET /health on every --port
  exit         print a message and exit 3 at once
  serve-once   serve on the first start; exit 3 on every later one (FAKE_MARKER file)
  hang         print a message and never listen
  stubborn     serve, ignore SIGTERM, and start a grandchild (same process group) that
               ignores SIGTERM too; both record their pids in FAKE_PID_FILE
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

FAKE_ENGINE = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys, threading, time
    mode = os.environ.get("FAKE_MODE", "serve")
    args = sys.argv[1:]
    ports = [int(args[i + 1]) for i, a in enumerate(args) if a == "--port"]
    print("fake engine", mode, "ports", ports, flush=True)
    if mode == "exit":
        print("fatal: simulated start-up failure", flush=True)
        sys.exit(3)
    if mode == "serve-once":
        # Healthy on the first start only: every later start fails like a broken restart.
        marker = os.environ["FAKE_MARKER"]
        if os.path.exists(marker):
            print("fatal: cannot start again", flush=True)
            sys.exit(3)
        open(marker, "w").close()
    if mode == "hang":
        while True:
            time.sleep(60)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        with open(os.environ["FAKE_PID_FILE"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", p), H) for p in ports]
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    servers[0].serve_forever()
""")


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake-python"
    body = tmp_path / "fake_engine.py"
    body.write_text(FAKE_ENGINE)
    # `python -m engine_launcher.sim ...` -> run fake_engine.py with the remaining args.
    script.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {body} "$@"\n')
    script.chmod(0o755)
    return str(script)
