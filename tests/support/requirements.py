"""Whether a missing dependency may skip a test: the one reader of CACHEHIT_REQUIRE_REAL_ENGINE.

CI sets CACHEHIT_REQUIRE_REAL_ENGINE=1 and installs everything (vLLM, NIXL, dnsmasq,
openssl): there a test that cannot run must fail, never skip silently. Elsewhere a missing
dependency skips with its reason.

The variable's value, stripped and lower-cased:

    "1", "true", "yes"              required: a missing dependency fails the test
    unset, "", "0", "false", "no"   not required: it skips the test
    anything else                   an error (a typo must not quietly mean "not required")
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "CACHEHIT_REQUIRE_REAL_ENGINE"
_REQUIRED = frozenset({"1", "true", "yes"})
_NOT_REQUIRED = frozenset({"", "0", "false", "no"})


def real_engine_required() -> bool:
    """True when CI requires every test to run (see the module's table)."""
    value = os.environ.get(REQUIRE_ENV, "").strip().lower()
    if value in _REQUIRED:
        return True
    if value in _NOT_REQUIRED:
        return False
    raise ValueError(f"{REQUIRE_ENV}={os.environ[REQUIRE_ENV]!r}: use 1/true/yes or 0/false/no")


def missing_dependency(reason: str) -> NoReturn:
    """Skip the test for `reason`, or fail it when real_engine_required()."""
    if real_engine_required():
        pytest.fail(f"{REQUIRE_ENV} is set but {reason}", pytrace=False)
    pytest.skip(reason)


def require_module(name: str, hint: str = "run `engine-launcher install-deps --cpu`") -> ModuleType:
    """`pytest.importorskip` that fails instead of skipping when real_engine_required()."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing_dependency(f"{name} cannot be imported ({exc}); {hint}")
