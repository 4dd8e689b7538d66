"""Log output: one pure JSON object per line (default) or text for humans.

`server.log_format = "json"`: every line is a JSON object written by python-json-logger
(its orjson formatter): `time`, `level`, `logger`, `message`, and for the per-request
line (`message: "request"`, logger `cachehit_router.requests`) the request's fields at the
top level (request_id, endpoint, model, route, winner, legs, probes, ttft_ms, status...:
router/observability/metrics.py). A log shipper reads them without parsing text.

`server.log_format = "text"`: `time LEVEL logger: message`, the per-request line's fields
as one JSON object in the message, as before.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

LOG_FORMATS = ("json", "text")
# The per-request record's fields travel in this LogRecord attribute.
REQUEST_FIELD = "request"


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.orjson import OrjsonFormatter

    class RequestJsonFormatter(OrjsonFormatter):
        def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
            fields = log_data.pop(REQUEST_FIELD, None)
            if isinstance(fields, dict):
                log_data.update(fields)
            return log_data

    return RequestJsonFormatter(
        ["asctime", "levelname", "name", "message"],
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )


class TextFormatter(logging.Formatter):
    """The human format; a request line shows its fields as JSON."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, REQUEST_FIELD, None)
        if isinstance(fields, dict):
            record = logging.makeLogRecord({**record.__dict__, "msg": orjson.dumps(fields).decode(), "args": None})
        return super().format(record)


def configure(level: str, fmt: str) -> None:
    """The root logger's one handler, on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_json_formatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
