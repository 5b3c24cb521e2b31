"""The snapshot channel's wire (node_agent/snapshots/wire.py), pure: a request header's every
field checked, and what each MAC binds. No socket here (test_channel.py has those)."""

from __future__ import annotations

import json

import pytest

from node_agent.snapshots.wire import (
    MAX_HEADER,
    VERSION,
    BadRequest,
    Request,
    parse_request,
    reply_mac,
    request_mac,
)

LIMIT = 1 << 20
NONCE = "ab" * 16
SHA = "0f" * 32


def header(**fields: object) -> bytes:
    doc: dict[str, object] = {"v": VERSION, "op": "push", "rank": 3, "step": 7, "size": 10, "sha256": SHA}
    doc["nonce"] = NONCE
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


def test_a_push_and_a_pull_parse() -> None:
    assert parse_request(header(), LIMIT) == Request(op="push", rank=3, step=7, size=10, sha256=SHA)
    pull = header(op="pull", size=None, sha256=None)
    assert parse_request(pull, LIMIT) == Request(op="pull", rank=3, step=7)


def test_unknown_fields_are_a_newer_peers_and_ignored() -> None:
    assert parse_request(header(more="x"), LIMIT).rank == 3


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"x" * (MAX_HEADER + 1), "header over"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not an object"),
        (header(v=VERSION + 1), "speaks version"),
        (header(nonce=None), "nonce"),
        (header(nonce="zz" * 16), "nonce"),
        (header(nonce="ab"), "nonce"),
        (header(op="delete"), "op:"),
        (header(rank=-1), "rank"),
        (header(rank=True), "rank"),
        (header(rank=2**31), "rank"),
        (header(step="7"), "step"),
        (header(step=2**63), "step"),
        (header(size=None), "size"),
        (header(size=LIMIT + 1), "per-file limit"),
        (header(sha256="0F" * 32), "sha256"),
        (header(sha256="0f" * 31), "sha256"),
    ],
)
def test_a_bad_header_is_refused_with_the_field_named(raw: bytes, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        parse_request(raw, LIMIT)


def test_each_mac_binds_key_challenge_header_and_reply_position() -> None:
    key, other = "k" * 32, "o" * 32
    challenge, raw = b"c" * 32, header()
    base = request_mac(key, challenge, raw)
    assert base != request_mac(other, challenge, raw)
    assert base != request_mac(key, b"d" * 32, raw)
    assert base != request_mac(key, challenge, header(step=8))
    body = b'{"ok":true}'
    first = reply_mac(key, 0, challenge, raw, body)
    assert first != reply_mac(key, 1, challenge, raw, body)  # a reply cannot be replayed as the next
    assert first != base
    # The header's length is bound in: no byte can move between the header and the body.
    assert reply_mac(key, 0, challenge, raw + b"x", body) != reply_mac(key, 0, challenge, raw, b"x" + body)
