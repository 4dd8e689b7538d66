"""The one reader of CACHEHIT_REQUIRE_REAL_ENGINE (support/requirements.py): its truth
table, and a missing dependency that fails instead of skipping when CI requires it."""

from __future__ import annotations

import pytest

from support.requirements import REQUIRE_ENV, missing_dependency, real_engine_required, require_module


@pytest.mark.parametrize("value", ["1", "true", "yes", " TRUE ", "Yes"])
def test_required(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(REQUIRE_ENV, value)
    assert real_engine_required() is True


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", " No "])
def test_not_required(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(REQUIRE_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_ENV, value)
    assert real_engine_required() is False


@pytest.mark.parametrize("value", ["2", "on", "required"])
def test_anything_else_is_an_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(ValueError, match=REQUIRE_ENV):
        real_engine_required()


def test_a_missing_dependency_fails_when_required_and_skips_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no such thing"):
        missing_dependency("no such thing")
    with pytest.raises(pytest.fail.Exception, match="cachehit_no_such_module"):
        require_module("cachehit_no_such_module")
    monkeypatch.setenv(REQUIRE_ENV, "0")
    with pytest.raises(pytest.skip.Exception, match="no such thing"):
        missing_dependency("no such thing")
    assert require_module("json").__name__ == "json"
