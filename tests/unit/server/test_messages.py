"""The `/v1/messages` route's own pieces: the body it converts, the errors it reshapes."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from router.errors import RouterError
from router.server.forward import Forwarder
from router.server.messages import MessagesApi, anthropic_shaped


def _api() -> MessagesApi:
    return MessagesApi(Forwarder.__new__(Forwarder))  # chat_body never touches the forwarder


def test_a_convertible_body_becomes_chat_bytes() -> None:
    raw = orjson.dumps({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    chat = _api().chat_body(raw)
    assert chat is not None
    assert orjson.loads(chat)["messages"] == [{"role": "user", "content": "hi"}]


def test_a_body_only_the_engine_converts_goes_whole() -> None:
    raw = orjson.dumps({"model": "m", "max_tokens": 3, "messages": [{"role": "system", "content": "x"}]})
    assert _api().chat_body(raw) is None


def test_bad_json_is_a_400() -> None:
    with pytest.raises(RouterError) as e:
        _api().chat_body(b"{")
    assert e.value.status == 400


def test_router_errors_are_reshaped_and_engine_errors_kept() -> None:
    resp = web.Response(status=429, body=orjson.dumps({"error": {"message": "busy", "type": "TooManyRequests"}}))
    shaped = anthropic_shaped(resp)
    assert isinstance(shaped, web.Response)
    assert isinstance(shaped.body, bytes)
    assert orjson.loads(shaped.body) == {"type": "error", "error": {"type": "TooManyRequests", "message": "busy"}}
    own = {"type": "error", "error": {"type": "BadRequestError", "message": "no"}}
    kept = anthropic_shaped(web.Response(status=400, body=orjson.dumps(own)))
    assert isinstance(kept, web.Response)
    assert isinstance(kept.body, bytes)
    assert orjson.loads(kept.body) == own
    ok = web.Response(status=200, body=b"{}")
    assert anthropic_shaped(ok) is ok
