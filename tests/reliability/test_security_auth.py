"""Security: client API keys (Authorization: Bearer, 401), the separate admin key, and the
body limit (413). The stack (router, capture proxy, trap) is support/security_stack.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from support.cluster import MakeCluster
from support.security_stack import ADMIN_KEY, BACKEND_KEY, CLIENT_KEY, OTHER_CLIENT_KEY, Stack, auth, error_body, post
from support.subprocess_cluster import MODEL

# --- authentication ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer sk-client",
        "Bearer sk-client-1x",
        "Basic c2stY2xpZW50LTE=",
        "Bearer sk-admin",
        "Bearer " + "x" * 10000,
        "Bearer sk-client-1\u00e9",
        "Token sk-client-1",
    ],
)
async def test_generation_needs_a_client_key(stack: Stack, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    status, h, raw = await post(stack, {"model": MODEL, "prompt": "x", "max_tokens": 1}, headers)
    if len(header or "") > 8190:  # past aiohttp's header line limit: its parser answers 400
        assert status == 400
        return
    assert status == 401, raw
    error_body(raw, 401)
    assert h["WWW-Authenticate"] == "Bearer"
    assert stack.cap.seen == [] or all(s["path"] != "/v1/completions" for s in stack.cap.seen)


async def test_non_ascii_authorization_bytes_are_a_401_not_a_crash(stack: Stack) -> None:
    """Raw header bytes that are not UTF-8 (the server decodes them with surrogateescape)."""
    for path, method in (("/v1/completions", b"POST"), ("/v1/models", b"GET"), ("/admin/backends", b"GET")):
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        body = b'{"prompt": "x"}' if method == b"POST" else b""
        writer.write(
            method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readline()
        writer.close()
        assert head.split()[1] == b"401", (path, head)


@pytest.mark.parametrize("key", [CLIENT_KEY, OTHER_CLIENT_KEY])
async def test_each_client_key_works_and_the_scheme_is_case_insensitive(stack: Stack, key: str) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, _, raw = await post(
            stack, {"model": MODEL, "prompt": "x", "max_tokens": 2}, {"Authorization": f"{scheme} {key}"}
        )
        assert status == 200, raw


async def test_models_need_a_key_probes_do_not(stack: Stack) -> None:
    async with stack.session.get(stack.url + "/v1/models") as r:
        assert r.status == 401
    async with stack.session.get(stack.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200
    for path in ("/health", "/ready", "/metrics"):
        async with stack.session.get(stack.url + path) as r:
            assert r.status == 200, path


async def test_admin_route_needs_the_admin_key_and_never_shows_secrets(stack: Stack) -> None:
    for headers in ({}, auth(), auth(OTHER_CLIENT_KEY), {"Authorization": "Bearer sk-admi"}):
        async with stack.session.get(stack.url + "/admin/backends", headers=headers) as r:
            assert r.status == 401
            error_body(await r.read(), 401)
    async with stack.session.get(stack.url + "/admin/backends", headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200
        raw = await r.read()
    assert orjson.loads(raw)[0]["name"] == "d0"
    assert BACKEND_KEY.encode() not in raw
    # The admin key is not a client key.
    status, _, _ = await post(stack, {"model": MODEL, "prompt": "x", "max_tokens": 1}, auth(ADMIN_KEY))
    assert status == 401


async def test_admin_route_is_absent_without_an_admin_key(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    async with c.session.get(c.url + "/admin/backends", headers={"Authorization": "Bearer "}) as r:
        assert r.status == 404


# --- body limit ----------------------------------------------------------------------------


async def test_body_limit_with_and_without_content_length(stack: Stack) -> None:
    big = orjson.dumps({"model": MODEL, "prompt": "y" * 100_000, "max_tokens": 1})
    status, _, raw = await post(stack, big, auth())
    assert status == 413
    assert "65536" in error_body(raw, 413)["message"]

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with stack.session.post(
        stack.url + "/v1/completions", data=chunked(), headers={**auth(), "Content-Type": "application/json"}
    ) as r:
        assert r.status == 413
        error_body(await r.read(), 413)
    # Not even an unauthenticated client can make the router read a big body.
    status, _, _ = await post(stack, big)
    assert status in (401, 413)
    assert all(s["path"] != "/v1/completions" for s in stack.cap.seen)
