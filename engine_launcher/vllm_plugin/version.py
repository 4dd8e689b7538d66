"""The vLLM versions this plugin is written against.

The plugin patches private vLLM APIs (docs/VLLM_PLUGIN.md lists them, `seams` checks them
in a vLLM source tree); they change between minor releases, so a release whose seams have
not been checked is refused at engine start rather than misbehaving at request time. The
version is read from the installed package at start, so one plugin serves either series.
"""

from __future__ import annotations

SUPPORTED_SERIES = ("0.32.", "0.33.")


class UnsupportedVLLMVersion(RuntimeError):
    pass


def installed_vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def is_supported(version: str) -> bool:
    return any(version.startswith(series) for series in SUPPORTED_SERIES)


def check_vllm_version() -> str:
    version = installed_vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMVersion(
            f"cachehit-router's cache-hit threshold plugin supports vLLM "
            f"{' and '.join(s + 'x' for s in SUPPORTED_SERIES)} only; this is vLLM {version}. "
            f"Install a supported version (`engine-launcher install-deps --cpu|--gpu`) or "
            f"start vLLM without `--scheduler-cls engine_launcher.vllm_plugin.scheduler.*` and "
            f"with VLLM_PLUGINS set to exclude `cachehit_threshold`."
        )
    return version
