"""Security: what reaches the engine and what the router may contact.

- internal fields stripped and hop-by-hop / client headers never forwarded: a capture
  proxy in front of a simulated engine records exactly what the router sends upstream;
- backend API keys come from the configuration only;
- no request can make the router contact a host outside its configuration (a trap server
  that must never be hit, for every vector: body fields, model names, Host header,
  absolute-URI request lines, forwarding headers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson

from support.security_stack import BACKEND_KEY, CLIENT_KEY, Stack, auth, post
from support.subprocess_cluster import MODEL

# --- what reaches the engine ---------------------------------------------------------------

CLIENT_HEADERS = {
    "Authorization": f"Bearer {CLIENT_KEY}",
    "Proxy-Authorization": "Basic Zm9vOmJhcg==",
    "Cookie": "session=stolen",
    "X-Forwarded-For": "6.6.6.6",
    "X-Forwarded-Host": "evil.example",
    "X-Forwarded-Proto": "https",
    "X-Real-IP": "6.6.6.6",
    "Forwarded": "for=6.6.6.6;host=evil.example",
    "Via": "1.1 evil",
    "Connection": "keep-alive, X-Custom-Hop",
    "X-Custom-Hop": "hop",
    "Keep-Alive": "timeout=999",
    "TE": "trailers",
    "Trailer": "X-Evil",
    "Upgrade": "websocket",
    "X-Request-Id": "client-chosen",
    "X-Evil": "1",
    "Origin": "http://evil.example",
    "Referer": "http://evil.example/",
    "Accept-Encoding": "br",
    "User-Agent": "evil-client/1.0",
}
_ALLOWED_UPSTREAM = {
    "host",
    "content-type",
    "content-length",
    "authorization",
    "accept",
    "accept-encoding",
    "user-agent",
}


async def test_client_headers_and_internal_fields_never_reach_the_engine(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": "headers",
        "max_tokens": 3,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": stack.trap_port,
            "remote_engine_id": "evil",
        },
        "ec_transfer_params": {"remote_host": "127.0.0.1"},
        "cache_hit_threshold": 0.0,
        "vllm_xargs": {"cache_hit_threshold": 0.0, "mine": 1},
        "request_id": "client-request-id",
    }
    for stream in (False, True):
        n_before = len(stack.cap.seen)

        async def chunked(stream: bool = stream) -> AsyncIterator[bytes]:
            yield orjson.dumps({**body, "stream": stream})

        # A chunked body (Transfer-Encoding: chunked from the client) on top of the headers.
        async with stack.session.post(
            stack.url + "/v1/completions",
            data=chunked(),
            headers={**CLIENT_HEADERS, "Content-Type": "application/json"},
        ) as r:
            assert r.status == 200, await r.read()
            await r.read()
        gens = [s for s in stack.cap.seen[n_before:] if s["path"] == "/v1/completions"]
        assert gens, stack.cap.seen
        for s in gens:
            names = {k.decode().lower() for k, _ in s["headers"]}
            assert names <= _ALLOWED_UPSTREAM, names - _ALLOWED_UPSTREAM
            hdr = {k.decode().lower(): v.decode() for k, v in s["headers"]}
            assert hdr["authorization"] == f"Bearer {BACKEND_KEY}"  # the configured key only
            assert hdr["user-agent"].startswith("Python/")
            assert "evil" not in hdr["user-agent"]
            assert hdr["host"] == stack.cap_host
            assert "evil" not in repr(s["headers"]).lower()
            assert "6.6.6.6" not in repr(s["headers"])
            sent = orjson.loads(s["body"])
            assert "kv_transfer_params" not in sent
            assert "ec_transfer_params" not in sent
            assert sent.get("request_id") in (None,) or sent["request_id"] != "client-request-id"
            assert sent["vllm_xargs"]["mine"] == 1  # the client's own xargs pass
            # The threshold is the router's own (the probe's T), never the client's 0.0.
            assert sent["cache_hit_threshold"] == sent["vllm_xargs"]["cache_hit_threshold"]
    # Health checks and scrapes carry the backend key and nothing of any client.
    for s in stack.cap.seen:
        hdr = {k.decode().lower(): v.decode() for k, v in s["headers"]}
        assert hdr.get("authorization") == f"Bearer {BACKEND_KEY}", s["path"]
    assert stack.trap.hits == []


# --- no foreign host ----------------------------------------------------------------------


async def test_no_request_makes_the_router_contact_a_host_outside_its_configuration(stack: Stack) -> None:
    trap = f"127.0.0.1:{stack.trap_port}"
    vectors = [
        ({"model": f"http://{trap}/v1", "prompt": "x", "max_tokens": 1}, {}),
        ({"model": f"//{trap}", "prompt": "x", "max_tokens": 1}, {}),
        ({"model": MODEL, "prompt": f"http://{trap}/v1/completions", "max_tokens": 1}, {}),
        (
            {
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 1,
                "vllm_xargs": {"url": f"http://{trap}"},
                "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": stack.trap_port},
            },
            {},
        ),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1}, {"Host": trap}),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1}, {"X-Forwarded-Host": trap, "Forwarded": f"host={trap}"}),
        (
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"http://{trap}/img.png"}}]}
                ],
                "max_tokens": 1,
            },
            {},
        ),
    ]
    for body, headers in vectors:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, _, raw = await post(stack, body, {**auth(), **headers}, path=path)
        assert status < 500 or b"Upstream engine" in raw, (body, status, raw)
    # Request lines the router must not treat as a proxy request.
    for target in (
        f"http://{trap}/v1/completions",
        f"//{trap}/v1/completions",
        f"http://{trap}/health",
        f"/v1/completions?url=http://{trap}",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        payload = orjson.dumps({"model": MODEL, "prompt": "abs", "max_tokens": 1})
        writer.write(
            f"POST {target} HTTP/1.1\r\nHost: {trap}\r\nAuthorization: Bearer {CLIENT_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        async with asyncio.timeout(10):
            raw = await reader.read()
        writer.close()
        assert raw.startswith(b"HTTP/1.1 "), raw[:100]
    # Kept as a fixed grace period: it checks that something never happens, and no event
    # marks that a wrongly sent request will not land later.
    await asyncio.sleep(0.3)
    assert stack.trap.hits == []
    # Every upstream call went to the one configured backend (the capture proxy).
    assert stack.cap.seen
