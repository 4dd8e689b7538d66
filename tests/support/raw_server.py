"""An HTTP/1.1 server that answers with the exact bytes a test scripts (the engine side of
the hand-written client's tests), and the pieces of such answers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# What the server does with one request: write to the connection; True keeps it open for
# the next request.
Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


class RawServer:
    """An HTTP/1.1 server that reads requests and answers with what a test scripts."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.requests: list[bytes] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.eofs = 0  # connections the client closed
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.eofs += 1
                    return
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.requests.append(head + await reader.readexactly(length))
                if not await self.answer(self.requests[-1], writer):
                    return
        except ConnectionError:
            self.eofs += 1
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def writes(*parts: bytes, keep: bool = True) -> Answer:
    async def answer(_: bytes, w: asyncio.StreamWriter) -> bool:
        for p in parts:
            w.write(p)
            await w.drain()
        return keep

    return answer
