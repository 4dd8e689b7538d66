"""Log output: one pure JSON object per line (default) or text for humans.

`server.log_format = "json"`: every line is a JSON object written by python-json-logger
(its orjson formatter): `time`, `level`, `logger`, `message`, and for the per-request
line (`message: "request"`, logger `cachehit_router.requests`) the request's fields at the
top level (request_id, endpoint, model, route, winner, legs, probes, ttft_ms, status...:
router/observability/metrics.py). A log shipper reads them without parsing text.

`server.log_format = "text"`: `time LEVEL logger: message`, the per-request line's fields
as one JSON object in the message, as before.

The per-request line is written by `write_request_line`: one a request, so its cost
counts. Through the logging module (a LogRecord, python-json-logger's formatter, the
handler) it took ~25-30 us of CPU, a tenth of a short streamed request; while the
router's own handler is the only place the line can go (no other handler, filter or
non-propagating logger on its way, as `configure` leaves it), the same bytes are written
to that handler's stream directly (~5 us). Anything else (a test's log capture, a handler
an embedding program added) gets the LogRecord as before.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

LOG_FORMATS = ("json", "text")
# The per-request record's fields travel in this LogRecord attribute.
REQUEST_FIELD = "request"
REQUEST_MESSAGE = "request"


class _Asctime:
    """`Formatter.formatTime` of a record created at a time, with the default formats,
    the strftime of the current second kept (one strftime a second, not one a line)."""

    def __init__(self, formatter: logging.Formatter):
        self._formatter = formatter
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        f = self._formatter
        second = int(created)
        if second != self._second:
            self._second, self._text = second, time.strftime(f.default_time_format, f.converter(created))
        # LogRecord's msecs (see logging.LogRecord.__init__)
        return (f.default_msec_format or "%s,%03d") % (self._text, int((created - second) * 1000) + 0.0)


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.orjson import OrjsonFormatter

    class RequestJsonFormatter(OrjsonFormatter):
        def __init__(self) -> None:
            super().__init__(
                ["asctime", "levelname", "name", "message"],
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
            self.asctime = _Asctime(self)

        def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
            fields = log_data.pop(REQUEST_FIELD, None)
            if isinstance(fields, dict):
                log_data.update(fields)
            return log_data

        def request_line(self, logger: str, fields: dict[str, Any], created: float) -> str:
            """What `format` makes of the per-request line's LogRecord (INFO)."""
            data = {"time": self.asctime(created), "level": "INFO", "logger": logger, "message": REQUEST_MESSAGE}
            data.update(fields)
            return self.serialize_log_record(data)

    return RequestJsonFormatter()


class TextFormatter(logging.Formatter):
    """The human format; a request line shows its fields as JSON."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.asctime = _Asctime(self)

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, REQUEST_FIELD, None)
        if isinstance(fields, dict):
            record = logging.makeLogRecord({**record.__dict__, "msg": orjson.dumps(fields).decode(), "args": None})
        return super().format(record)

    def request_line(self, logger: str, fields: dict[str, Any], created: float) -> str:
        """What `format` makes of the per-request line's LogRecord (INFO)."""
        return f"{self.asctime(created)} INFO {logger}: {orjson.dumps(fields).decode()}"


# The handler `configure` installed and its formatter's `request_line`: where the
# per-request line may be written without the logging module.
_own: tuple[logging.StreamHandler[Any], Callable[[str, dict[str, Any], float], str]] | None = None


def configure(level: str, fmt: str) -> None:
    """The root logger's one handler, on stderr."""
    global _own
    handler = logging.StreamHandler(sys.stderr)
    formatter = _json_formatter() if fmt == "json" else TextFormatter()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _own = (handler, formatter.request_line)  # type: ignore[attr-defined]  # both formatters have it


def _sole_handler(logger: logging.Logger) -> logging.StreamHandler[Any] | None:
    """The router's own handler if an INFO record of `logger` would reach it and nothing
    else: no filter and no other handler on the way (a log capture adds one to the root)."""
    if _own is None:
        return None
    own = _own[0]
    if own.filters or own.level > logging.INFO:
        return None
    c = logger
    while c.parent is not None:  # up to the root
        if c.handlers or c.filters or not c.propagate:
            return None
        c = c.parent
    if c.filters or len(c.handlers) != 1 or c.handlers[0] is not own:
        return None
    return own


def write_request_line(logger: logging.Logger, fields: dict[str, Any]) -> None:
    """The per-request line (INFO, message "request", `fields` as the line's own) to
    wherever `logger`'s records go; the caller checked that INFO is enabled."""
    handler = _sole_handler(logger)
    if handler is not None and _own is not None:
        line = _own[1](logger.name, fields, time.time()) + handler.terminator
        try:
            handler.acquire()  # as Handler.handle does around StreamHandler.emit
            try:
                handler.stream.write(line)
                handler.flush()
            finally:
                handler.release()
            return
        except Exception:  # the logging module reports a failing stream its own way, below
            pass
    logger.info(REQUEST_MESSAGE, extra={REQUEST_FIELD: fields})
