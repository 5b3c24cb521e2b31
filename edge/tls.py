"""TLS files into ``ssl.SSLContext``: the server's port, and the clients that dial it.

What TLS means on our port (one port, agents' frames and HTTPS routed after the handshake; a
client CA makes the server ask for certificates and refuse a peer without one in the protocol
it speaks) is in ``protocol/tls.py``. This module only loads: the server's certificate chain,
key and optional client CA; a client's CA and optional certificate, from its flags or else
``RDZV_TLS_CA`` / ``RDZV_TLS_CERT`` / ``RDZV_TLS_KEY`` (an agent and ``rdzv-server
status``/``drain`` read the same variables; the server itself reads none).

Every problem with a file raises ``TLSConfigError`` naming the file, before anything listens or
connects. Keys must not be encrypted: nothing here may stop and prompt for a passphrase.
``ssl`` is imported only to build a context: an agent that finds no TLS flags never loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import ssl

__all__ = ["CLIENT_ENV", "ClientFiles", "TLSConfigError", "client_context", "client_files", "server_context"]

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARK = b"PRIVATE KEY-----"  # PKCS#8, "EC PRIVATE KEY", "RSA PRIVATE KEY", encrypted forms

# A client's files when its flags do not name them: "ca", "cert", "key" -> variable.
CLIENT_ENV: Mapping[str, str] = {"ca": "RDZV_TLS_CA", "cert": "RDZV_TLS_CERT", "key": "RDZV_TLS_KEY"}


class TLSConfigError(ValueError):
    """A certificate, key or CA file that cannot be used, or a client's files that do not go
    together; the message names the file or the flags."""


class ClientFiles(NamedTuple):
    """A client's TLS files, and where they were given (for messages: ``--tls-ca and RDZV_TLS_CERT``)."""

    ca: str
    cert: str | None
    key: str | None
    origins: str


def client_files(
    flags: Mapping[str, tuple[str | None, str]], environ: Mapping[str, str]
) -> ClientFiles | None:
    """A client's files: each of ``flags`` ("ca"/"cert"/"key" -> (the flag's value, how the
    flag is written)) else its ``CLIENT_ENV`` variable; None: no TLS. A certificate needs the
    CA (we would not know whom to trust) and its key; the files are not read here."""
    given: dict[str, tuple[str, str]] = {}  # "ca"/"cert"/"key" -> (path, where it came from)
    for name, var in CLIENT_ENV.items():
        value, flag = flags.get(name, (None, ""))
        if value:
            given[name] = (value, flag)
        elif environ.get(var):
            given[name] = (environ[var], var)
    if not given:
        return None
    origins = " and ".join(origin for _, origin in given.values())
    if "ca" not in given:
        raise TLSConfigError(f"{origins}: a client certificate needs --tls-ca (the CA of the server)")
    if ("cert" in given) != ("key" in given):
        raise TLSConfigError(f"{origins}: --tls-cert and --tls-key go together; give both or neither")
    cert, key = (given[name][0] if name in given else None for name in ("cert", "key"))
    return ClientFiles(ca=given["ca"][0], cert=cert, key=key, origins=origins)


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The listening side: our certificate chain, and optionally a CA for client certificates."""
    import ssl

    # Not create_default_context: it would also trust the system's CAs for client certificates.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key)
    if client_ca is not None:
        _load_ca(ctx, client_ca)
        # Not CERT_REQUIRED: the service refuses a certificate-less peer itself, with a message.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """The connecting side: trust only ``ca``; present ``cert``/``key`` when both are given."""
    if (cert is None) != (key is None):
        raise TLSConfigError("a client certificate needs both a certificate file and a key file")
    import ssl

    # Verifies the chain and the hostname; trusts ``ca`` alone, never the system's CAs.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, ca)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    return ctx


def _read(path: str, what: str, mark: bytes) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSConfigError(f"cannot read the TLS {what} {path!r}: {exc.strerror or exc}") from None
    if mark not in data:
        raise TLSConfigError(f"the TLS {what} {path!r} is not PEM (no {mark.decode().strip('-')!r} block)")


def _load_ca(ctx: ssl.SSLContext, path: str) -> None:
    import ssl

    _read(path, "CA file", _CERT_MARK)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot use the TLS CA file {path!r}: {exc.reason or exc}") from None


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    import ssl

    _read(cert, "certificate", _CERT_MARK)
    _read(key, "key", _KEY_MARK)

    def no_passphrase() -> bytes:
        raise TLSConfigError(f"the TLS key {key!r} is encrypted; give an unencrypted key (mode 0600)")

    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key, password=no_passphrase)
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"cannot use the TLS certificate {cert!r} with the key {key!r} "
            f"(does the key belong to the certificate?): {exc.reason or exc}"
        ) from None
