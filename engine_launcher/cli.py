"""`engine-launcher`: start the engines a router.toml declares, and helper subcommands.

    engine-launcher --config router.toml [--dry-run] [--host-type auto|cpu|gpu] [--log-dir DIR]
    engine-launcher up --config router.toml ...        (same as the bare form)
    engine-launcher sim ...                            (the simulator: engine_launcher.sim.cli)
    engine-launcher install-deps ...                   (engine_launcher.install_deps)
    engine-launcher tiny-model DIR                     (engine_launcher.tiny_model)

Exit codes: 0 after a clean stop (SIGINT/SIGTERM) or a dry run; 1 when an engine does not
start or every engine was given up; 2 on a configuration error (the message names the key).
The forwarded subcommands return their own codes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from router.config.parse import load_config
from router.config.schema import Config, ConfigError

if TYPE_CHECKING:
    from .engine_status import ProgressEvent
    from .supervisor import Supervisor

# Subcommands forwarded to another module's main(argv); imported only when used, so the
# launcher works before (or without) the simulator or the vLLM dependencies.
FORWARDED: dict[str, tuple[str, str]] = {
    "sim": ("engine_launcher.sim.cli", "main"),
    "install-deps": ("engine_launcher.install_deps", "main"),
    "tiny-model": ("engine_launcher.tiny_model", "main"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine-launcher",
        description="Start the [[engines]] of a router.toml (vLLM with the cache-hit plugin, or "
        "the simulator), wait until each answers /health, restart crashed engines "
        "with backoff, stop them all on SIGINT/SIGTERM.",
        epilog="Other subcommands: `engine-launcher sim ...` (the simulator), "
        "`engine-launcher install-deps ...` (vLLM + NIXL for engine hosts), "
        "`engine-launcher tiny-model DIR` (a tiny random-weight model for tests).",
    )
    p.add_argument("--config", required=True, help="path to router.toml")
    p.add_argument(
        "--dry-run", action="store_true", help="print the exact command and environment of every engine and exit"
    )
    p.add_argument(
        "--host-type",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="command flavour: detect (auto), or force CPU build / GPU flags",
    )
    p.add_argument("--log-dir", help="override [launcher].log_dir")
    return p


def _forward(sub: str, rest: list[str]) -> int:
    import importlib

    module, func = FORWARDED[sub]
    rc = getattr(importlib.import_module(module), func)(rest)
    return int(rc or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in FORWARDED:
        return _forward(args_list[0], args_list[1:])
    if args_list and args_list[0] == "up":
        args_list = args_list[1:]
    args = build_parser().parse_args(args_list)
    err = Console(stderr=True, highlight=False)
    try:
        cfg = load_config(args.config)
        if not cfg.engines:
            raise ConfigError("engines: the configuration declares no [[engines]] to start")
        if args.log_dir:
            cfg = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, log_dir=args.log_dir))
        host_has_gpu = {"auto": None, "cpu": False, "gpu": True}[args.host_type]
        if args.dry_run:
            return dry_run(cfg, host_has_gpu)
        return asyncio.run(run(cfg, host_has_gpu, err))
    except ConfigError as e:
        err.print(e.report("engine-launcher"), markup=False, soft_wrap=True)
        return 2


def dry_run(cfg: Config, host_has_gpu: bool | None, out: Callable[[str], None] = print) -> int:
    """Print each process's engines and log file, then its command line (environment first).

    Plain print, not rich: the output is meant to be copied into a shell or a document, and
    rich would wrap long lines and read `[...]` in JSON as markup.
    """
    from .ports import ports_to_pick
    from .supervisor import Supervisor

    sup = Supervisor(cfg.engines, cfg.launcher, host_has_gpu=host_has_gpu)
    try:
        cmds = sup.plan()
    finally:
        # Drops the held ports; a real start picks its own.
        sup.release_ports()
    host = sup.host
    flavour = f"GPU host ({host.gpu_count} GPU)" if host.has_gpu else f"CPU host ({len(host.cpu_ids)} CPUs)"
    n = sum(len(c.engines) for c in cmds)
    out(f"# engine-launcher --dry-run: {len(cmds)} process(es) for {n} engine(s) on a {flavour}")
    picked = list(dict.fromkeys(name for name, _, _ in ports_to_pick(cfg.engines)))
    if picked:
        out(f"# free ports were picked now for {', '.join(picked)}; a real start picks again")
    for c in cmds:
        out("")
        out(f"# {c.name} ({c.kind}): " + ", ".join(f"{e} at {c.urls[e]}" for e in c.engines))
        for e, (stream, replay) in c.kv_events.items():
            out(f"# kv events of {e}: {stream}, replay {replay}")
        out(f"# log: {c.log_file}")
        out(c.shell_line())
    return 0


class ProgressView:
    """Rich progress while engines start; one line per event afterwards."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=False
        )
        self.tasks: dict[str, TaskID] = {}
        self.live = False

    def __call__(self, ev: ProgressEvent) -> None:
        label = ev.unit if len(ev.engines) == 1 else f"{ev.unit} (+{len(ev.engines) - 1})"
        text = f"{label}: {ev.state}" + (f" - {ev.detail}" if ev.detail else "")
        if self.live:
            if ev.unit not in self.tasks:
                self.tasks[ev.unit] = self.progress.add_task(text, total=1)
            done = ev.state in ("healthy", "failed", "stopped")
            self.progress.update(self.tasks[ev.unit], description=text, completed=1 if done else 0)
        else:
            style = {"healthy": "green", "failed": "bold red", "exited": "yellow", "restarting": "yellow"}.get(
                ev.state, ""
            )
            self.console.print(f"[{style}]{_escape(text)}[/]" if style else _escape(text))


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def status_table(sup: Supervisor) -> Table:
    t = Table(title="engines", title_justify="left")
    for col in ("name", "kind", "role", "URL", "PID", "state", "log file"):
        t.add_column(col, overflow="fold")
    log_dir = sup.launcher.log_dir
    for st in sup.status():
        for name in st.engines:
            log = st.log_file if name == st.name else f"{log_dir}/{name}.log -> {st.name}.log"
            t.add_row(name, st.kind, st.role, st.urls[name], str(st.pid or "-"), st.state, log)
    return t


async def run(cfg: Config, host_has_gpu: bool | None, console: Console) -> int:
    from .engine_status import EngineStartError
    from .supervisor import Supervisor

    sup = Supervisor(cfg.engines, cfg.launcher, host_has_gpu=host_has_gpu)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    view = ProgressView(console)
    stopper = asyncio.create_task(stop.wait())
    try:
        cmds = sup.plan()
        console.print(
            f"starting {sum(len(c.engines) for c in cmds)} engine(s) in {len(cmds)} "
            f"process(es); logs in {cfg.launcher.log_dir}/"
        )
        view.live = True
        with view.progress:
            starter = asyncio.create_task(sup.start(progress=view))
            await asyncio.wait({starter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not starter.done():
                starter.cancel()  # start() stops what it started before re-raising
                await asyncio.gather(starter, return_exceptions=True)
                view.live = False
                console.print("signal received: stopped before every engine was healthy")
                return 0
        view.live = False
        try:
            starter.result()
        except (EngineStartError, OSError) as e:
            console.print(f"[bold red]engine-launcher: {_escape(str(e))}[/]")
            return 1
        console.print(status_table(sup))
        console.print("all engines healthy; Ctrl-C or SIGTERM stops them")
        gave_up = asyncio.create_task(sup.wait())
        await asyncio.wait({gave_up, stopper}, return_when=asyncio.FIRST_COMPLETED)
        gave_up.cancel()
        if not stop.is_set():
            console.print("[bold red]every engine was given up; exiting[/]")
            await sup.stop()
            return 1
        console.print("stopping engines ...")
        await sup.stop()
        console.print("stopped")
        return 0
    finally:
        stopper.cancel()
        view.live = False
        await sup.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


if __name__ == "__main__":
    sys.exit(main())
