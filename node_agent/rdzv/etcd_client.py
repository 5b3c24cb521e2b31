"""A small client for etcd's v3 API through its JSON gateway (``/v3/...``), over aiohttp.

etcd 3.4+ serves the v3 API as JSON on its client port, so one HTTP client covers what the
rendezvous needs (ranges, compare-and-swap transactions, leases and watches) without a gRPC
stack. Keys and values travel base64-encoded; 64-bit numbers arrive as JSON strings, and
fields equal to their zero value (``false``, ``0``, a PUT event's type) are left out.

Only this module knows the gateway's wire format; callers see bytes, ints and the small
records below. Every transport problem becomes :class:`EtcdUnavailable`; an answer that
says the request itself was wrong becomes :class:`EtcdError`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from protocol.records import record


class EtcdUnavailable(Exception):
    """etcd could not be reached, or the connection broke: worth retrying."""


class EtcdError(Exception):
    """etcd answered with an error (a bad request, a missing lease, …)."""


@record(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@record(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "PUT" | "DELETE"
    kv: KeyValue


class WatchCompacted(Exception):
    """The watch's start revision was compacted away: read the range again."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with prefix (etcd's convention)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease=int(raw.get("lease", 0)),
    )


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def delete_range_op(key: bytes, range_end: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key), "range_end": _b64(range_end)}}


def absent(key: bytes) -> dict[str, Any]:
    """A transaction guard: the key does not exist."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}


def unchanged_since(key: bytes, range_end: bytes, revision: int) -> dict[str, Any]:
    """A transaction guard: no key in [key, range_end) was written after revision."""
    return {
        "key": _b64(key),
        "range_end": _b64(range_end),
        "result": "LESS",
        "target": "MOD",
        "mod_revision": str(revision + 1),
    }


class EtcdClient:
    """One aiohttp session to one etcd endpoint (``http(s)://host:port``)."""

    def __init__(
        self, base_url: str, *, ssl_context: ssl.SSLContext | None = None, timeout: float = 5.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        limit = aiohttp.ClientTimeout(total=timeout or self._timeout)
        try:
            async with self._http().post(
                self.base_url + path, json=body, timeout=limit, ssl=self._ssl
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EtcdUnavailable(_describe(exc)) from None
        try:
            answer = json.loads(text)
        except ValueError:
            raise EtcdError(f"etcd answered {path} with non-JSON ({text[:80]!r})") from None
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd answered {path} with {text[:80]!r}")
        if "error" in answer or resp.status >= 400:
            message = answer.get("message") or answer.get("error") or text[:200]
            if resp.status >= 500 and "lease not found" not in str(message):
                raise EtcdUnavailable(f"etcd: {message}")
            raise EtcdError(f"etcd: {message}")
        return answer

    async def range(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under prefix, oldest first, and the store revision of the read."""
        answer = await self._call(
            "/v3/kv/range",
            {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
            },
        )
        revision = int(answer["header"]["revision"])
        return revision, [_kv(raw) for raw in answer.get("kvs", [])]

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        answer = await self._call("/v3/kv/put", put_op(key, value, lease)["request_put"])
        return int(answer["header"]["revision"])

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        """Apply success if every guard holds; True when they held (and it was applied)."""
        answer = await self._call("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(answer.get("succeeded", False))

    async def grant(self, ttl: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": ttl})
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh a lease; its remaining TTL, 0 when etcd no longer has it."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes under prefix from start_revision on, until the stream breaks."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        # No total timeout: a watch is open for as long as the job runs.
        limit = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout)
        try:
            async with self._http().post(
                self.base_url + "/v3/watch", json=body, timeout=limit, ssl=self._ssl
            ) as resp:
                if resp.status >= 400:
                    raise EtcdError(f"etcd refused the watch: HTTP {resp.status}")
                # The gateway streams one JSON object per line.
                async for line in resp.content:
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise WatchCompacted(int(result["compact_revision"]))
                    if result.get("canceled"):
                        raise EtcdUnavailable(f"etcd cancelled the watch: {result.get('cancel_reason', '')}")
                    events = [
                        WatchEvent(kind=raw.get("type", "PUT"), kv=_kv(raw.get("kv", {})))
                        for raw in result.get("events", [])
                    ]
                    if events:
                        yield events
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise EtcdUnavailable(_describe(exc)) from None
        raise EtcdUnavailable("etcd closed the watch stream")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "request timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        if err.errno:
            return os.strerror(err.errno).lower()  # "connection refused", not "Connect call failed (…)"
        return str(err.strerror or err).lower()
    return str(exc) or type(exc).__name__
