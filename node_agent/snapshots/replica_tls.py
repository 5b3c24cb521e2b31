"""TLS for the snapshot replica channel without a CA of ours: an ephemeral certificate, pinned.

The agents have at most the rendezvous' CA (``--tls-ca``) and maybe a client certificate; they
have no certificate a peer could verify a replica server by, and no ``cryptography`` package. So
each agent makes its own, once, at start (:func:`make_server_tls`): a self-signed EC P-256
certificate and key from the ``openssl`` command line, valid a few days, written 0600 into a
folder of its own (0700) made inside the private directory the caller gives, loaded into a
server ``ssl.SSLContext`` and removed at once (the key lives on in the context's memory only).
What the agent announces is the certificate's fingerprint, the sha256 of its DER form; it
travels to the job's other agents through the rendezvous, which is TLS-protected when the
rendezvous uses TLS, as the replica key does.

A client (:func:`client_context`) verifies no chain and no name: it checks, right after the
handshake, that the peer's certificate has the fingerprint announced for it (``client.py`` does,
with :func:`peer_cert_sha256`), and refuses any other. Expiry is not checked either, so a job
that outlives the validity keeps replicating: the pin, not the dates, is what is trusted.

Without ``openssl`` (or when it fails) :func:`make_server_tls` raises :class:`ReplicaTLSError`;
the agent then says so and the channel stays HMAC-only: every request and reply authenticated,
the bytes checked by their sha256, but readable by anyone on the network path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DAYS",
    "ReplicaTLS",
    "ReplicaTLSError",
    "cert_sha256",
    "client_context",
    "make_server_tls",
    "peer_cert_sha256",
]

DAYS = 7  # the certificate's validity; a pinning client never checks it (see the header)
SUBJECT = "/CN=node-agent snapshot replica"
OPENSSL_TIMEOUT = 30.0


class ReplicaTLSError(Exception):
    """No certificate could be made (no ``openssl``, or it failed): the channel stays HMAC-only."""


@dataclass(frozen=True)
class ReplicaTLS:
    """This agent's replica server TLS: its context, and the fingerprint its peers pin."""

    context: ssl.SSLContext
    cert_sha256: str  # sha256 of the certificate's DER form, 64 lowercase hex digits


def cert_sha256(der: bytes) -> str:
    """A certificate's fingerprint: the sha256 of its DER form, lowercase hex."""
    return hashlib.sha256(der).hexdigest()


def peer_cert_sha256(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str:
    """The fingerprint of the certificate the peer of a TLS connection sent ("" when none)."""
    if ssl_object is None:
        return ""
    der = ssl_object.getpeercert(binary_form=True)
    return cert_sha256(der) if der else ""


def _private_file(path: Path) -> None:
    """Made empty and 0600 before openssl writes it: openssl keeps the mode of a file it truncates."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


def make_server_tls(folder: str | Path, *, days: int = DAYS, openssl: str | None = None) -> ReplicaTLS:
    """A fresh self-signed certificate and key for this agent's replica server, made with the
    ``openssl`` command (``openssl``: its path; default: the one on ``PATH``) in a new 0700
    folder inside ``folder`` (which must exist and be private to the agent), loaded, and removed.
    Takes tens of milliseconds: call it in a thread from an event loop. Raises
    :class:`ReplicaTLSError` saying why when no certificate can be made."""
    if days < 1:
        raise ValueError("days must be >= 1")
    exe = openssl or shutil.which("openssl")
    if exe is None:
        raise ReplicaTLSError("no openssl command on PATH to make the replica channel's certificate")
    try:
        work = Path(tempfile.mkdtemp(prefix="replica-tls-", dir=folder))  # 0700
    except OSError as exc:
        raise ReplicaTLSError(f"cannot make a private folder in {folder}: {exc}") from None
    try:
        cert, key = work / "cert.pem", work / "key.pem"
        _private_file(cert)
        _private_file(key)
        cmd = [
            exe, "req", "-x509", "-batch", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", str(days), "-subj", SUBJECT,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=OPENSSL_TIMEOUT, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise ReplicaTLSError(f"cannot run {exe}: {exc}") from None
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            why = said[-1][:200] if said else f"exit status {done.returncode}"
            raise ReplicaTLSError(f"{exe} could not make the replica channel's certificate: {why}")
        try:
            der = ssl.PEM_cert_to_DER_cert(cert.read_text())
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ValueError, ssl.SSLError) as exc:
            raise ReplicaTLSError(f"the certificate {exe} made cannot be used: {exc}") from None
        return ReplicaTLS(context=ctx, cert_sha256=cert_sha256(der))
    finally:
        shutil.rmtree(work, ignore_errors=True)


@functools.cache
def client_context() -> ssl.SSLContext:
    """A client's context for a pinned replica server: TLS 1.2 or newer, no chain or name
    verified (the caller checks the fingerprint right after the handshake); shared, read-only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
