"""`router --config router.toml` serves; `router check-config --config router.toml` validates.

Flags and CACHEHIT_ROUTER_* environment variables override the file (router/config/overrides.py);
SIGHUP re-reads the file with the same overrides (router/server/reload.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import ssl
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from router.config import overrides
from router.config.schema import Config, ConfigError
from router.routing import policies
from router.server.settings import load_checked

if TYPE_CHECKING:  # aiohttp is imported when serving, not for --version or check-config
    from aiohttp import web

    from router.server.services import Reloadable


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router",
        description=("cachehit-router: an OpenAI-compatible router that asks vLLM engines where the KV cache is."),
    )
    p.add_argument(
        "command",
        nargs="?",
        choices=("serve", "check-config"),
        default="serve",
        help="serve (default) or check-config (validate and print the resolved configuration)",
    )
    p.add_argument(
        "--config",
        "-c",
        default=os.environ.get(overrides.CONFIG_PATH) or "router.toml",
        help=f"path to router.toml (default: ${overrides.CONFIG_PATH} or %(default)s)",
    )
    p.add_argument("--host", help="override server.host (and $CACHEHIT_ROUTER_HOST)")
    p.add_argument("--port", type=int, help="override server.port (and $CACHEHIT_ROUTER_PORT)")
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="override server.log_level (and $CACHEHIT_ROUTER_LOG_LEVEL)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument(
        "--no-engines",
        action="store_true",
        help="do not start the [[engines]] (they run elsewhere); still route to them",
    )
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"(cachehit-router) {version('cachehit-router')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(cachehit-router) unknown version"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    flags = {"server.host": args.host, "server.port": args.port, "server.log_level": args.log_level}

    def load() -> Config:
        return load_checked(args.config, os.environ, flags)

    try:
        config = load()
    except ConfigError as e:
        print(e.report("router"), file=sys.stderr)
        return 2
    if args.command == "check-config":
        shown = config.to_dict()
        # The chosen policy's keys with their defaults: what it will run with.
        shown["routing"] = {**dataclasses.asdict(policies.settings(config.routing)), **shown["routing"]}
        sys.stdout.write(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode() + "\n")
        print(
            f"router: {args.config} is valid ({len(config.all_backends())} backends, "
            f"{len(config.engines)} engines to start)",
            file=sys.stderr,
        )
        return 0
    return serve(config, start_engines=not args.no_engines, reload_config=load)


# Young-generation GC threshold once serving (CPython's default is 700). Under load the
# requests in flight keep more than 700 young container objects alive (64 connections: a
# few thousand), so the default ran a young collection every ~15 requests and a full one
# every ~1,500, about 20 us of CPU per request, collecting almost nothing: request objects
# are freed by reference counting. Cycles are still collected, less often.
_GC_GEN0_THRESHOLD = 10_000


async def _tune_gc(_app: web.Application) -> None:
    """After startup (engines started, backends checked): move everything that exists now
    (modules, configuration, the app) out of the collector's reach (gc.freeze), so full
    collections only walk objects made since, and raise the young-generation threshold."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(_GC_GEN0_THRESHOLD, g1, g2)


class _Reloads:
    """SIGHUP re-reads the configuration (router/server/reload.py); reloads run one at a
    time, in the order the signals came. The handler is installed before the router starts
    (starting engines can take minutes, and SIGHUP's default action ends the process): a
    SIGHUP that comes before the router is up is remembered, and one reload (of the file
    as it is then) runs as soon as it is."""

    def __init__(self, load: Callable[[], Config]):
        self.load = load
        self.state: Reloadable | None = None
        self.pending = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.lock = asyncio.Lock()  # bound to the loop at its first use
        self.log = logging.getLogger("cachehit_router.reload")

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGHUP, self.on_hup)

    def on_hup(self) -> None:
        if self.state is None:
            if not self.pending:
                self.log.info("SIGHUP while the router starts: the configuration is re-read once it is up")
            self.pending = True
            return
        task = asyncio.get_running_loop().create_task(self.one())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def ready(self, app: web.Application) -> None:
        """An on_startup hook, after the router started: from now on a SIGHUP reloads."""
        from router.server.app import ROUTER_KEY

        self.state = app[ROUTER_KEY]
        if self.pending:
            self.pending = False
            self.log.info("applying the reload asked for while the router started")
            self.on_hup()

    async def one(self) -> None:
        from router.server.reload import reload

        assert self.state is not None
        async with self.lock:
            try:
                await reload(self.state, self.load)
            except Exception:  # a reload must never take the router down
                self.log.exception("reload failed")


def serve(
    config: Config,
    *,
    host: str | None = None,
    port: int | None = None,
    start_engines: bool = True,
    reload_config: Callable[[], Config] | None = None,
) -> int:
    from router.observability import logs
    from router.observability.clientlog import ServerLogger
    from router.server.app import ROUTER_KEY, build_app
    from router.server.connections import HeadLimits, LimitedAppRunner

    logs.configure(config.server.log_level, config.server.log_format)
    # The logging HOWTO's "Optimization": no caller frame, thread or process lookups for
    # fields the format does not print (a third of the cost of each request's log line).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    host = host or config.server.host
    port = config.server.port if port is None else port
    ssl_ctx = None
    if config.server.tls_cert:
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(config.server.tls_cert, config.server.tls_key)
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # uvloop is not available on every platform
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = build_app(config, start_engines=start_engines)
    scheme = "https" if ssl_ctx else "http"

    async def announce(_app: web.Application) -> None:
        print(
            f"router: serving the OpenAI API on {scheme}://{host}:{port}\n"
            f"  try: curl -s {scheme}://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
            '-d \'{"prompt": "Hello, router", "max_tokens": 16}\'',
            flush=True,
        )

    app.on_startup.append(announce)
    app.on_startup.append(_tune_gc)
    reloads = None if reload_config is None else _Reloads(reload_config)
    if reloads is not None:
        app.on_startup.append(reloads.ready)
    runner = LimitedAppRunner(
        app,
        # Request heads held to server.header_timeout_s and max_header_bytes; idle
        # keep-alive connections closed after server.keepalive_timeout_s.
        limits=HeadLimits.of(config.server, on_dropped=app[ROUTER_KEY].connection_dropped),
        keepalive_timeout=config.server.keepalive_timeout_s,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,
        logger=ServerLogger(),
        shutdown_timeout=config.server.drain_timeout_s,
    )
    try:
        serving = _serve_until_signalled(runner, host, port, ssl_ctx, reloads, reuse_port=config.server.reuse_port)
        loop.run_until_complete(serving)
    except Exception as e:  # startup failures (port taken, engines failed to start): say what
        print(f"router: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        _cancel_remaining_tasks(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return 0


# After the in-flight requests of a drain, how long no request must have arrived before
# the open connections are closed (bounded by server.drain_timeout_s).
DRAIN_QUIET_S = 0.5


async def _serve_until_signalled(
    runner: web.AppRunner,
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None,
    reloads: _Reloads | None = None,
    *,
    reuse_port: bool = False,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain (SIGHUP: `_Reloads`, from before the
    engines start). Unlike web.run_app, which closes the
    open keep-alive connections before the drain, the connections stay served while the
    drain runs: a request a client sends on one meanwhile gets a 503 (and Connection:
    close) instead of a reset."""
    from aiohttp import web

    from router.server.app import ROUTER_KEY

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if reloads is not None:
        reloads.install(loop)
    await runner.setup()  # starts the engines and checks the backends (on_startup)
    try:
        # reuse_port: several router processes bind the same port, and the kernel spreads
        # new connections over them (docs/ARCHITECTURE.md, "Several router processes").
        site = web.TCPSite(runner, host, port, ssl_context=ssl_ctx, reuse_port=reuse_port or None)
        await site.start()
        await stop.wait()
        await site.stop()  # no new connections
        await runner.app[ROUTER_KEY].drain(quiet_s=DRAIN_QUIET_S)
    finally:
        await runner.cleanup()  # closes the connections, stops the engines


def _cancel_remaining_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


if __name__ == "__main__":
    sys.exit(main())
