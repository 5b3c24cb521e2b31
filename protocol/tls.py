"""TLS on the rendezvous port: what it means for both ends, and the words for a failed check.

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

Loading the PEM files into contexts is I/O, so it happens at each program's edge
(``edge/tls.py``); this package reads no files.
"""

from __future__ import annotations

import ssl

__all__ = ["verify_failure"]


def verify_failure(exc: ssl.SSLCertVerificationError) -> str:
    """OpenSSL's reason ("IP address mismatch, ...", "unable to get local issuer certificate")."""
    return str(exc.verify_message or exc.reason or exc)
