"""Stop NIXL's progress thread from spinning a core while the engine is idle.

NIXL 1.5's Python agent (`nixl_agent.__init__` in `nixl_<cuda>/_api.py`) always creates its
agent with `pthrDelay = 0`. The UCX backend's progress thread (`nixlUcxSharedThread::run`)
arms its UCX workers and then `poll()`s their event file descriptors with that delay as the
timeout: 0 makes it return at once, so the thread spins at 100% of a core even when no
transfer is in flight (seen with gdb: `poll(fds, 2, timeout=0)` in a loop). vLLM 0.32 does not
expose the delay (its `kv_connector_extra_config.num_threads` only sizes the UCX backend's
worker pool and does not touch the progress loop).

With a positive delay the thread sleeps in `poll()` until UCX signals an event on an armed
worker or the delay expires, so transfers still wake it at once (measured, docs/VLLM_PLUGIN.md).

Set by environment, read in the process that creates the NIXL agent (vLLM's worker):
`CACHEHIT_NIXL_PROGRESS_DELAY_US` = microseconds (an integer >= 0); unset or empty: NIXL's own
behaviour. The launcher sets it by default (engine_launcher/commands.py).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger("vllm.plugins.cachehit_threshold")

ENV = "CACHEHIT_NIXL_PROGRESS_DELAY_US"

_applied = False


def configured_delay_us(environ: dict[str, str] | None = None) -> int | None:
    """The delay from the environment; None when unset. Raises ValueError on a bad value."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer number of microseconds >= 0, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV} must be an integer number of microseconds >= 0, got {raw!r}")
    return value


class _BindingsWithDelay:
    """NIXL's `_bindings` module, except that `nixlAgent(name, config)` gets our delay."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False):
            config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def patch_nixl_api(api_module: Any, delay_us: int) -> bool:
    """Route `api_module`'s agent creation through `_BindingsWithDelay`; False if not NIXL's."""
    real = getattr(api_module, "nixlBind", None)
    if real is None:
        return False
    if isinstance(real, _BindingsWithDelay):
        real._delay_us = delay_us
        return True
    api_module.nixlBind = _BindingsWithDelay(real, delay_us)
    return True


def apply() -> None:
    """Install the lazy hook: NIXL is patched when vLLM first loads it (workers only)."""
    global _applied
    if _applied:
        return
    delay = configured_delay_us()
    if delay is None:
        return
    from vllm.distributed import nixl_utils

    original = nixl_utils._load_nixl_attr

    def load_nixl_attr(name: str) -> Any:
        value = original(name)
        if name == "NixlWrapper" and value is not None:
            module = sys.modules.get(getattr(value, "__module__", ""))
            if module is not None and patch_nixl_api(module, delay):
                logger.info("NIXL progress thread: poll delay %d us (%s)", delay, ENV)
        return value

    nixl_utils._load_nixl_attr = load_nixl_attr
    # vLLM caches a loaded attribute in the module's globals; one loaded before us is patched now.
    loaded = nixl_utils.__dict__.get("NixlWrapper")
    if loaded is not None:
        module = sys.modules.get(getattr(loaded, "__module__", ""))
        if module is not None:
            patch_nixl_api(module, delay)
    _applied = True
