"""``TORCHELASTIC_HEALTH_CHECK_PORT``: a liveness endpoint for the agent itself.

torchrun reads the variable and hands the port to a health-check server, which open-source
torch leaves as a stub that logs "No health check server started" (its interface names only a
port, no address). Ours serves, on every interface (a Kubernetes probe comes to the pod's IP):
any HTTP request gets ``200`` and a JSON body with the time the agent's event loop last ran
(``alive``, Unix seconds) and its phase, so a Kubernetes or Slurm probe can tell a wedged agent
from a live one. It tells nothing else.

Bounded and always answered: each connection gets one answer and is closed, and has
``deadline`` seconds in all to send its request head (8 KiB at most) and take the answer. At
most ``MAX_CONNECTIONS`` wait at once; a newcomer past that closes the one that has waited
longest instead of being turned away, so idle connections, however many and however often
re-opened, cannot lock out a probe (a probe sends its request as it connects and is answered
at once; only a connection that waited while a cap's worth of others arrived is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

__all__ = ["HealthServer"]

MAX_HEAD = 8 * 1024
DEADLINE = 2.0  # a probe on a LAN takes milliseconds; an idle connection is closed after this
MAX_CONNECTIONS = 32


class HealthServer:
    def __init__(self, port: int, phase: Callable[[], str], *, deadline: float = DEADLINE) -> None:
        self.port = port
        self._phase = phase
        self._deadline = deadline
        self._server: asyncio.AbstractServer | None = None
        # Connections waiting for their request, oldest first (dicts keep insertion order).
        self._waiting: dict[asyncio.StreamWriter, None] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, host=None, port=self.port, reuse_address=True, limit=MAX_HEAD
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._waiting):
                writer.transport.abort()
            self._waiting.clear()
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) >= MAX_CONNECTIONS:
            # Make room by dropping the longest waiter, never the newcomer (likely a probe).
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()
        self._waiting[writer] = None
        try:
            async with asyncio.timeout(self._deadline):
                await reader.readuntil(b"\r\n\r\n")
                self._waiting.pop(writer, None)
                body = json.dumps({"alive": int(time.time()), "phase": self._phase()}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._waiting.pop(writer, None)
            writer.close()


async def start_liveness(
    port: int | None, phase: Callable[[], str], log: Callable[..., None]
) -> HealthServer | None:
    """The liveness server when TORCHELASTIC_HEALTH_CHECK_PORT names a port (None: none, or
    the port is taken: torchrun's own server is a stub, and a taken port must not stop the job)."""
    if port is None:
        return None
    server = HealthServer(port, phase)
    try:
        await server.start()
    except OSError as exc:
        log(f"TORCHELASTIC_HEALTH_CHECK_PORT={port}: cannot serve ({exc.strerror or exc})", "warning")
        return None
    log(f"health-check server on port {port} (TORCHELASTIC_HEALTH_CHECK_PORT)")
    return server
