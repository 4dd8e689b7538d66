"""A real DNS server for discovery tests: dnsmasq on loopback, answering from a hosts file
the test rewrites (scripts/test.sh installs dnsmasq)."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import dns.asyncresolver
import dns.nameserver
import dns.resolver
import pytest

from support.ports import free_port
from support.requirements import missing_dependency


def _dnsmasq_binary() -> str | None:
    return shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None
    )


class DnsServer:
    def __init__(self, binary: str, workdir: Path) -> None:
        self.hosts = workdir / "hosts"
        self.hosts.write_text("")
        self.hosts.chmod(0o644)
        self.port = free_port(udp=True)  # dnsmasq listens on both
        self.proc = subprocess.Popen(
            [
                binary,
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts}",
                "--local=/test/",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                f"--port={self.port}",
                "--pid-file=",
                "--local-ttl=0",
                "--log-facility=-",
                # Stay the test's user (dnsmasq drops root to "nobody", who cannot read pytest's tmp dirs).
                f"--user={pwd.getpwuid(os.getuid()).pw_name}",
                f"--group={grp.getgrgid(os.getgid()).gr_name}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def resolve(self, name: str) -> set[str] | None:
        """The A records the server gives now (None: it did not answer)."""
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", self.port)]
        try:
            return {a.address for a in await r.resolve(name, "A", lifetime=1.0, search=False)}
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return set()
        except dns.exception.DNSException:
            return None

    async def publish(self, records: dict[str, list[str]], within: float = 10.0) -> None:
        """Rewrite the hosts file, make dnsmasq re-read it, and return once it answers so."""
        self.hosts.write_text("".join(f"{a} {n}\n" for n, addrs in records.items() for a in addrs))
        self.proc.send_signal(signal.SIGHUP)
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        for name, addrs in records.items():
            while await self.resolve(name) != set(addrs):
                if self.proc.poll() is not None:
                    assert self.proc.stderr is not None
                    raise RuntimeError(f"dnsmasq exited: {self.proc.stderr.read().decode()}")
                if loop.time() >= end:
                    raise AssertionError(f"dnsmasq never answered {name} -> {addrs}")
                await asyncio.sleep(0.02)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:  # read only when it failed to start: closed here
            self.proc.stderr.close()


@pytest.fixture
async def dns_server(tmp_path: Path) -> AsyncIterator[DnsServer]:
    binary = _dnsmasq_binary()
    if binary is None:
        message = "dnsmasq is not installed (scripts/test.sh installs it: apt-get install dnsmasq-base)"
        missing_dependency(message)
    server = await _start(binary, tmp_path)
    try:
        yield server
    finally:
        server.close()


async def _start(binary: str, workdir: Path, attempts: int = 5) -> DnsServer:
    """Start dnsmasq and wait until it answers; another process may take the free port between
    choosing it and dnsmasq binding it, so a bind failure tries a new port."""
    loop = asyncio.get_running_loop()
    for attempt in range(attempts):
        server = DnsServer(binary, workdir)
        end = loop.time() + 10.0
        while await server.resolve("nothing.test") is None:  # up and answering (NXDOMAIN)
            if server.proc.poll() is not None or loop.time() >= end:
                server.close()
                assert server.proc.stderr is not None
                error = server.proc.stderr.read().decode()
                if "Address already in use" in error and attempt + 1 < attempts:
                    break
                raise RuntimeError(f"dnsmasq did not start: {error}")
            await asyncio.sleep(0.02)
        else:
            return server
    raise AssertionError("unreachable")
