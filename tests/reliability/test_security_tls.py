"""Security: optional TLS, with a certificate generated at test time."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from support.requirements import missing_dependency
from support.security_stack import CLIENT_KEY, auth
from support.subprocess_cluster import MODEL, sim_backends

if TYPE_CHECKING:
    from reliability.conftest import Procs  # the `procs` fixture's value


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
            headers=auth(),
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
