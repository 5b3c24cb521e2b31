"""TLS settings for both ends of the port: the server's context, the clients', and checks.

The server wraps its one listening port in TLS when given a certificate and key; the routing
by first bytes then happens on the decrypted stream, so agents' frames and HTTPS share the port
exactly as frames and HTTP do without TLS. Clients (agents, ``rdzv-server status``/``drain``)
verify the server against a CA file and check that its certificate names the host they dialled
(the ``--rdzv-endpoint`` / ``--endpoint`` host, a DNS name or an IP address).

With a client CA the server asks every peer for a certificate, but accepts a handshake without
one (``CERT_OPTIONAL``) and refuses the connection right after it, in the protocol the peer
speaks: an agent gets an ``Error`` frame and an HTTP client a 403 that say what is missing. A
TLS alert would reach the peer as a bare "connection closed". A certificate that is presented
but not signed by the client CA still fails the handshake.

Every problem with a file raises ``TLSConfigError`` naming the file, before anything listens or
connects. Keys must not be encrypted: nothing here may stop and prompt for a passphrase.
"""

from __future__ import annotations

import ssl

__all__ = ["TLSConfigError", "client_context", "server_context", "verify_failure"]

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARK = b"PRIVATE KEY-----"  # PKCS#8, "EC PRIVATE KEY", "RSA PRIVATE KEY", encrypted forms


class TLSConfigError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The listening side: our certificate chain, and optionally a CA for client certificates."""
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
    # Verifies the chain and the hostname; trusts ``ca`` alone, never the system's CAs.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, ca)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    return ctx


def verify_failure(exc: ssl.SSLCertVerificationError) -> str:
    """OpenSSL's reason ("IP address mismatch, ...", "unable to get local issuer certificate")."""
    return str(exc.verify_message or exc.reason or exc)


def _read(path: str, what: str, mark: bytes) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSConfigError(f"cannot read the TLS {what} {path!r}: {exc.strerror or exc}") from None
    if mark not in data:
        raise TLSConfigError(f"the TLS {what} {path!r} is not PEM (no {mark.decode().strip('-')!r} block)")


def _load_ca(ctx: ssl.SSLContext, path: str) -> None:
    _read(path, "CA file", _CERT_MARK)
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"cannot use the TLS CA file {path!r}: {exc.reason or exc}") from None


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
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
