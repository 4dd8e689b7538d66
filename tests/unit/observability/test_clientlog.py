"""Escaping what clients send before it reaches a log line; client events vs router bugs."""

from __future__ import annotations

import logging

import pytest
from aiohttp import http_exceptions, web

from router.observability.clientlog import ServerLogger, escape, is_client_event


def test_printable_text_is_kept_as_is() -> None:
    assert escape("cmpl-kunde-été-42") == "cmpl-kunde-été-42"


def test_control_and_invisible_characters_are_escaped() -> None:
    assert escape("a\r\nb\x00c\x7fd\x1b[31m\u202ee\u0085") == "a\\x0d\\x0ab\\x00c\\x7fd\\x1b[31m\\u202ee\\x85"


def test_a_backslash_cannot_forge_an_escape() -> None:
    assert escape("a\\x00") == "a\\\\x00"
    assert escape("a\\x00") != escape("a\x00")


def test_long_text_is_cut() -> None:
    assert escape("x" * 1000, limit=10) == "x" * 10 + "..."


def test_client_events_and_router_bugs() -> None:
    assert is_client_event(http_exceptions.BadHttpMessage("bad"))
    assert is_client_event(web.RequestPayloadError("bad gzip"))
    assert is_client_event(ConnectionResetError())
    assert not is_client_event(TypeError("a bug"))
    assert not is_client_event(None)


def test_server_logger_logs_client_events_on_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = ServerLogger(logging.getLogger("test.server"))
    with caplog.at_level(logging.INFO, logger="test.server"):
        logger.exception(
            "Error handling request from %s",
            "127.0.0.1",
            exc_info=http_exceptions.BadHttpMessage("Invalid header:\n b'\x00\x1b'"),
        )
        try:
            raise TypeError("a router bug")
        except TypeError as e:
            logger.exception("Unhandled exception", exc_info=e)
    info, error = caplog.records
    assert info.levelno == logging.INFO
    assert info.exc_info is None
    assert "\n" not in info.getMessage()
    assert "\x00" not in info.getMessage()
    assert "\x1b" not in info.getMessage()
    assert error.levelno == logging.ERROR
    assert error.exc_info is not None
