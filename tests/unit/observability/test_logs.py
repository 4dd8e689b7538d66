"""Log output (router/observability/logs.py): the per-request line written without the
logging module is the line the logging module writes, and goes through the logging module
whenever anything else could see it."""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.observability import logs

REQUESTS = "cachehit_router.requests"

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
)
_fields = st.dictionaries(
    st.text(min_size=1).filter(lambda k: k not in ("time", "level", "logger", "message")),
    st.one_of(_values, st.lists(_values, max_size=4), st.dictionaries(st.text(), _values, max_size=3)),
    max_size=8,
)
# Times from 2001 to 2286, fractions of a second included.
_created = st.floats(min_value=1e9, max_value=1e10, allow_nan=False)


class Logged:
    """The root logger as `logs.configure` leaves it, writing to `stream`."""

    def __init__(self, stream: io.StringIO) -> None:
        self.stream = stream
        self.logger = logging.getLogger(REQUESTS)

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`configure(fmt)` on a captured stderr; the root logger and the module's state put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    own = logs._own

    def configure(fmt: str) -> Logged:
        stream = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        logs.configure("info", fmt)
        return Logged(stream)

    try:
        yield configure
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        logs._own = own


def _record(logger: str, fields: dict[str, Any], created: float) -> logging.LogRecord:
    """The per-request line's LogRecord, as if made at `created`."""
    rec = logging.getLogger(logger).makeRecord(
        logger, logging.INFO, __file__, 1, logs.REQUEST_MESSAGE, (), None, extra={logs.REQUEST_FIELD: fields}
    )
    rec.created = created
    rec.msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord.__init__ computes it
    return rec


@pytest.mark.parametrize("fmt", logs.LOG_FORMATS)
@settings(max_examples=200, deadline=None)
@given(fields=_fields, created=_created)
def test_the_request_line_is_what_the_formatter_writes_of_its_record(
    fmt: str, fields: dict[str, Any], created: float
) -> None:
    formatter = logs._json_formatter() if fmt == "json" else logs.TextFormatter()
    line = formatter.request_line(REQUESTS, fields, created)  # type: ignore[attr-defined]
    assert line == formatter.format(_record(REQUESTS, fields, created))


@pytest.mark.parametrize("fmt", logs.LOG_FORMATS)
def test_the_line_goes_to_the_router_s_handler_without_a_log_record(configured: Any, fmt: str) -> None:
    out = configured(fmt)
    made: list[logging.LogRecord] = []
    factory = logging.getLogRecordFactory()

    def counting(*args: Any, **kwargs: Any) -> logging.LogRecord:
        rec = factory(*args, **kwargs)
        made.append(rec)
        return rec

    logging.setLogRecordFactory(counting)
    try:
        before = time.time()
        logs.write_request_line(out.logger, {"request_id": "r1", "status": 200})
    finally:
        logging.setLogRecordFactory(factory)
    assert made == []  # the fast path
    (line,) = out.lines()
    if fmt == "json":
        obj = orjson.loads(line)
        assert obj["logger"] == REQUESTS
        assert obj["level"] == "INFO"
        assert obj["message"] == "request"
        assert (obj["request_id"], obj["status"]) == ("r1", 200)
        stamp = obj["time"]
    else:
        stamp, _, rest = line.partition(" INFO ")
        assert orjson.loads(rest.removeprefix(f"{REQUESTS}: ")) == {"request_id": "r1", "status": 200}
    assert stamp[:19] >= time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(before)))


def test_a_log_capture_sees_the_record(configured: Any, caplog: pytest.LogCaptureFixture) -> None:
    out = configured("json")
    caplog.set_level(logging.INFO, logger=REQUESTS)
    root = logging.getLogger()
    root.addHandler(caplog.handler)  # as pytest's capture does (configure removed it)
    try:
        logs.write_request_line(out.logger, {"request_id": "r2"})
    finally:
        root.removeHandler(caplog.handler)
    (rec,) = [r for r in caplog.records if r.name == REQUESTS]
    assert rec.__dict__[logs.REQUEST_FIELD] == {"request_id": "r2"}
    assert orjson.loads(out.lines()[0])["request_id"] == "r2"  # and the router's own line too


def test_a_filter_or_a_logger_that_does_not_propagate_gets_its_say(configured: Any) -> None:
    out = configured("json")
    dropping = logging.Filter("nothing-matches")
    out.logger.addFilter(dropping)
    try:
        logs.write_request_line(out.logger, {"request_id": "filtered"})
    finally:
        out.logger.removeFilter(dropping)
    assert out.lines() == []
    out.logger.propagate = False
    try:
        logs.write_request_line(out.logger, {"request_id": "kept-here"})
    finally:
        out.logger.propagate = True
    assert out.lines() == []  # no handler of its own, no propagation: not the root's line


def test_a_failing_stream_is_reported_as_the_logging_module_does(
    configured: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = configured("json")

    def broken(_text: str) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(out.stream, "write", broken)
    reported: list[logging.LogRecord] = []
    handler = logging.getLogger().handlers[0]
    monkeypatch.setattr(handler, "handleError", reported.append)
    logs.write_request_line(out.logger, {"request_id": "r3"})
    (rec,) = reported
    assert rec.__dict__[logs.REQUEST_FIELD] == {"request_id": "r3"}
