"""`router --config router.toml` serves; `router check-config --config router.toml` validates."""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import ssl
import sys

import orjson

from .config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="router", description=(
        "cachehit-router: an OpenAI-compatible router that asks vLLM engines where the KV cache is."))
    p.add_argument("command", nargs="?", choices=("serve", "check-config"), default="serve",
                   help="serve (default) or check-config (validate and print the resolved configuration)")
    p.add_argument("--config", "-c", default="router.toml", help="path to router.toml (default: %(default)s)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.add_argument("--no-engines", action="store_true",
                   help="do not start the [[engines]] (they run elsewhere); still route to them")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(e.report("router"), file=sys.stderr)
        return 2
    if args.command == "check-config":
        sys.stdout.write(orjson.dumps(config.to_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
        print(f"router: {args.config} is valid ({len(config.all_backends())} backends, "
              f"{len(config.engines)} engines to start)", file=sys.stderr)
        return 0
    return serve(config, host=args.host, port=args.port, start_engines=not args.no_engines)


# Young-generation GC threshold once serving (CPython's default is 700). Under load the
# requests in flight keep more than 700 young container objects alive (64 connections: a
# few thousand), so the default ran a young collection every ~15 requests and a full one
# every ~1,500, about 20 us of CPU per request, collecting almost nothing: request objects
# are freed by reference counting. Cycles are still collected, less often.
_GC_GEN0_THRESHOLD = 10_000


async def _tune_gc(_app) -> None:
    """After startup (engines started, backends checked): move everything that exists now
    (modules, configuration, the app) out of the collector's reach (gc.freeze), so full
    collections only walk objects made since, and raise the young-generation threshold."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(_GC_GEN0_THRESHOLD, g1, g2)


def serve(config, *, host: str | None = None, port: int | None = None, start_engines: bool = True) -> int:
    from aiohttp import web

    from .app import build_app
    from .clientlog import ServerLogger

    from . import logs
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
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:  # uvloop is not available on every platform
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = build_app(config, start_engines=start_engines)
    scheme = "https" if ssl_ctx else "http"

    async def announce(_app) -> None:
        print(f"router: serving the OpenAI API on {scheme}://{host}:{port}\n"
              f"  try: curl -s {scheme}://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
              "-d '{\"prompt\": \"Hello, router\", \"max_tokens\": 16}'", flush=True)

    app.on_startup.append(announce)
    app.on_startup.append(_tune_gc)
    try:
        web.run_app(app, host=host, port=port, ssl_context=ssl_ctx, loop=loop, print=None,
                    access_log=None, shutdown_timeout=config.server.drain_timeout_s,
                    handler_cancellation=True, logger=ServerLogger())
    except Exception as e:  # startup failures (port taken, engines failed to start): say what
        print(f"router: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
