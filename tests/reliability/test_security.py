"""Security: what a hostile client must not reach.

- client API keys (Authorization: Bearer, 401), the separate admin key, body limit (413);
- internal fields stripped and hop-by-hop / client headers never forwarded: a capture
  proxy in front of a simulated engine records exactly what the router sends upstream;
- backend API keys come from the configuration only;
- no request can make the router contact a host outside its configuration (a trap server
  that must never be hit, for every vector: body fields, model names, Host header,
  absolute-URI request lines, forwarding headers);
- optional TLS, with a certificate generated at test time.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import ipaddress
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from engine_launcher.sim import SimEngineConfig, start_sim_engine
from router.config.parse import parse_config
from router.fleet.capability import CHECK_PROMPT_PREFIX
from router.server.app import build_app
from support.cluster import MakeCluster
from support.ports import site_port
from support.requirements import missing_dependency
from support.subprocess_cluster import MODEL, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value

CLIENT_KEY = "sk-client-1"
OTHER_CLIENT_KEY = "sk-client-two-longer"
ADMIN_KEY = "sk-admin"
BACKEND_KEY = "be-secret"


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site_port(site)


class Capture:
    """A proxy in front of a simulated engine that records each request's method, path,
    headers and body, and streams the engine's answer back untouched."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.seen: list[dict[str, Any]] = []
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if CHECK_PROMPT_PREFIX.encode() not in body:  # the router's own capability check
            self.seen.append(
                {"method": request.method, "path": request.path_qs, "headers": list(request.raw_headers), "body": body}
            )
        assert self.session is not None
        async with self.session.request(
            request.method,
            self.engine_url + request.path_qs,
            data=body or None,
            headers={"Content-Type": "application/json"},
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "application/json")}
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


class Trap:
    def __init__(self) -> None:
        self.hits: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(f"{request.method} {request.path_qs}")
        return web.json_response({})


@dataclass
class Stack:
    url: str  # the router's
    port: int
    cap: Capture
    trap: Trap
    trap_port: int
    session: aiohttp.ClientSession
    cap_host: str  # the capture proxy's host:port


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    """sim engine <- capture proxy <- router (in this loop); plus a trap server."""
    closers: list[Callable[[], Awaitable[None]]] = []
    eng = await start_sim_engine(SimEngineConfig(model=MODEL, speed=50.0), port=0)
    closers.append(eng.close)
    cap = Capture(eng.url)
    cap.session = aiohttp.ClientSession()
    closers.append(cap.session.close)
    capp = web.Application()
    capp.router.add_route("*", "/{tail:.*}", cap.handle)
    crunner, cport = await _serve(capp)
    closers.append(crunner.cleanup)
    trap = Trap()
    tapp = web.Application()
    tapp.router.add_route("*", "/{tail:.*}", trap.handle)
    trunner, tport = await _serve(tapp)
    closers.append(trunner.cleanup)
    config = parse_config(
        {
            "server": {
                "port": 0,
                "api_keys": [CLIENT_KEY, OTHER_CLIENT_KEY],
                "admin_api_key": ADMIN_KEY,
                "max_body_bytes": 64 * 1024,
            },
            "health": {"scrape_interval_s": 0.5, "check_interval_s": 1.0},
            "backends": [{"name": "d0", "url": f"http://127.0.0.1:{cport}", "role": "decode", "api_key": BACKEND_KEY}],
        }
    )
    rrunner, rport = await _serve(build_app(config, start_engines=False))
    closers.append(rrunner.cleanup)
    session = aiohttp.ClientSession()
    closers.append(session.close)
    ns = Stack(
        url=f"http://127.0.0.1:{rport}",
        port=rport,
        cap=cap,
        trap=trap,
        trap_port=tport,
        session=session,
        cap_host=f"127.0.0.1:{cport}",
    )
    try:
        yield ns
    finally:
        for close in reversed(closers):
            await close()


def _auth(key: str = CLIENT_KEY) -> dict[str, Any]:
    return {"Authorization": f"Bearer {key}"}


async def _post(
    st: Stack, body: dict[str, Any] | bytes, headers: dict[str, Any] | None = None, path: str = "/v1/completions"
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with st.session.post(
        st.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        return r.status, r.headers, raw


def _err(raw: bytes, status: int) -> dict[str, Any]:
    err: dict[str, Any] = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    return err


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
    status, h, raw = await _post(stack, {"model": MODEL, "prompt": "x", "max_tokens": 1}, headers)
    if len(header or "") > 8190:  # past aiohttp's header line limit: its parser answers 400
        assert status == 400
        return
    assert status == 401, raw
    _err(raw, 401)
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
        status, _, raw = await _post(
            stack, {"model": MODEL, "prompt": "x", "max_tokens": 2}, {"Authorization": f"{scheme} {key}"}
        )
        assert status == 200, raw


async def test_models_need_a_key_probes_do_not(stack: Stack) -> None:
    async with stack.session.get(stack.url + "/v1/models") as r:
        assert r.status == 401
    async with stack.session.get(stack.url + "/v1/models", headers=_auth()) as r:
        assert r.status == 200
    for path in ("/health", "/ready", "/metrics"):
        async with stack.session.get(stack.url + path) as r:
            assert r.status == 200, path


async def test_admin_route_needs_the_admin_key_and_never_shows_secrets(stack: Stack) -> None:
    for headers in ({}, _auth(), _auth(OTHER_CLIENT_KEY), {"Authorization": "Bearer sk-admi"}):
        async with stack.session.get(stack.url + "/admin/backends", headers=headers) as r:
            assert r.status == 401
            _err(await r.read(), 401)
    async with stack.session.get(stack.url + "/admin/backends", headers=_auth(ADMIN_KEY)) as r:
        assert r.status == 200
        raw = await r.read()
    assert orjson.loads(raw)[0]["name"] == "d0"
    assert BACKEND_KEY.encode() not in raw
    # The admin key is not a client key.
    status, _, _ = await _post(stack, {"model": MODEL, "prompt": "x", "max_tokens": 1}, _auth(ADMIN_KEY))
    assert status == 401


async def test_admin_route_is_absent_without_an_admin_key(make_cluster: MakeCluster) -> None:
    c = await make_cluster(decoders=1)
    async with c.session.get(c.url + "/admin/backends", headers={"Authorization": "Bearer "}) as r:
        assert r.status == 404


# --- body limit ----------------------------------------------------------------------------


async def test_body_limit_with_and_without_content_length(stack: Stack) -> None:
    big = orjson.dumps({"model": MODEL, "prompt": "y" * 100_000, "max_tokens": 1})
    status, _, raw = await _post(stack, big, _auth())
    assert status == 413
    assert "65536" in _err(raw, 413)["message"]

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with stack.session.post(
        stack.url + "/v1/completions", data=chunked(), headers={**_auth(), "Content-Type": "application/json"}
    ) as r:
        assert r.status == 413
        _err(await r.read(), 413)
    # Not even an unauthenticated client can make the router read a big body.
    status, _, _ = await _post(stack, big)
    assert status in (401, 413)
    assert all(s["path"] != "/v1/completions" for s in stack.cap.seen)


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
        status, _, raw = await _post(stack, body, {**_auth(), **headers}, path=path)
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


# --- TLS ------------------------------------------------------------------------------------


async def _plain_http_get(s: aiohttp.ClientSession, url: str) -> None:
    """GET over plain HTTP from a TLS server: a ClientError, whether the connection fails or
    the server answers an error status (some answer 400 to plain HTTP: never 200)."""
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        await r.read()
        assert r.status >= 400
        raise aiohttp.ClientError("plain HTTP answered")


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 made now: with the `cryptography` package, else with
    the `openssl` command."""
    if importlib.util.find_spec("cryptography") is None:
        return _self_signed_openssl(tmp_path)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return str(cert_path), str(key_path)


def _self_signed_openssl(tmp_path: Path) -> tuple[str, str]:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        missing_dependency("neither the cryptography package nor the openssl command is available")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key_path),
            "-out",
            str(cert_path),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert_path), str(key_path)


async def test_tls_with_a_self_signed_certificate(procs: Procs, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(cafile=cert)
    engines = {"d0": procs.sim("--speed", "20")}
    router = procs.router(
        {"server": {"tls_cert": cert, "tls_key": key, "api_keys": [CLIENT_KEY]}, "backends": sim_backends(engines)},
        ssl_ctx=ctx,
    )
    assert router.url.startswith("https://")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            router.url + "/v1/completions",
            ssl=ctx,
            headers=_auth(),
            json={"model": MODEL, "prompt": "over tls", "max_tokens": 4, "stream": True},
        ) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.rstrip().endswith(b"data: [DONE]")
        # An unverified client fails the handshake; plain HTTP gets no HTTP answer.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(router.url + "/health"):
                pass
        with pytest.raises(aiohttp.ClientError):
            await _plain_http_get(s, f"http://127.0.0.1:{router.port}/health")
    assert router.process.poll() is None
