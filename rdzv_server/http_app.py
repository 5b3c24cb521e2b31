"""The HTTP side of the server's port: health now, status and metrics later.

Connections arrive already accepted (``service.py`` routes them by their first bytes), so we
use aiohttp's server protocol without a site of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .service import RendezvousService


SERVICE: web.AppKey[RendezvousService] = web.AppKey("service")


async def make_http_runner(service: RendezvousService) -> web.AppRunner:
    """An aiohttp runner whose ``server`` is a protocol factory for handed-over connections."""
    app = web.Application()
    app[SERVICE] = service

    async def healthz(request: web.Request) -> web.Response:
        m = service.machine
        return web.json_response({"status": "ok", "jobs": len(m.jobs), "connections": len(m.conns)})

    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    return runner
