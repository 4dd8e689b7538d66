"""`readonly` records (router/readonly.py): dataclasses at run time, frozen to strict mypy."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

from mypy import api

from router.readonly import readonly


@readonly
class Point:
    x: int
    y: int = 0


def test_a_readonly_record_is_a_slotted_dataclass() -> None:
    p = Point(1)
    assert dataclasses.is_dataclass(p)
    assert (p, repr(p)) == (Point(1, 0), "Point(x=1, y=0)")
    assert dataclasses.replace(p, y=2) == Point(1, 2)
    assert not hasattr(p, "__dict__")  # slots: no per-instance dict


def test_strict_mypy_refuses_an_assignment_to_a_field(tmp_path: Path) -> None:
    # The guarantee a frozen dataclass gave at run time, given by the type checker instead:
    # the project's mypy (strict, code and tests) is what stands between a planner and a view.
    src = tmp_path / "assigns.py"
    src.write_text(
        textwrap.dedent(
            """
            from router.routing.snapshot import BackendView

            def planner(view: BackendView) -> None:
                view.queued_tokens = 0.0
            """
        )
    )
    out, _err, status = api.run(["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"), str(src)])
    assert status == 1
    assert 'Property "queued_tokens" defined in "BackendView" is read-only' in out
