"""``TORCHELASTIC_HEALTH_CHECK_PORT``: a liveness endpoint for the agent itself.

torchrun reads the variable and hands the port to a health-check server, which open-source
torch leaves as a stub that logs "No health check server started". Ours serves: any HTTP
request on the port gets ``200`` and a JSON body with the time the agent's event loop last ran
(``alive``, Unix seconds) and its phase, so a Kubernetes or Slurm probe can tell a wedged agent
from a live one. It reads at most one request head per connection, bounded in size and time,
and serves a bounded number of connections at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

__all__ = ["HealthServer"]

MAX_HEAD = 8 * 1024
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 32


class HealthServer:
    def __init__(self, port: int, phase: Callable[[], str]) -> None:
        self.port = port
        self._phase = phase
        self._server: asyncio.AbstractServer | None = None
        self._open = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, host=None, port=self.port, reuse_address=True, limit=MAX_HEAD
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._open += 1
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            body = json.dumps({"alive": int(time.time()), "phase": self._phase()}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open -= 1
            writer.close()
