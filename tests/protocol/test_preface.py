"""classify_preface: routing a connection by its first bytes."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import HTTP_METHODS, MAGIC, PREFACE_LEN, Hello, PrefaceKind, classify_preface, encode

KINDS = set(typing.get_args(PrefaceKind))


def test_magic_is_eight_bytes_that_no_http_request_or_tls_record_starts_with():
    assert len(MAGIC) == 8 == PREFACE_LEN
    assert not chr(MAGIC[0]).isalpha()
    assert MAGIC[0] != 0x16
    assert KINDS == {"rdzv", "http", "tls", "unknown", "more"}


@pytest.mark.parametrize(
    "data", [MAGIC, MAGIC + encode(Hello(versions=(1,), software="x")), MAGIC + b"\x00"], ids=repr
)
def test_rdzv(data):
    assert classify_preface(data) == "rdzv"


@pytest.mark.parametrize("size", range(len(MAGIC)))
def test_prefix_of_magic_needs_more(size):
    assert classify_preface(MAGIC[:size]) == "more"


@pytest.mark.parametrize("method", HTTP_METHODS, ids=bytes.decode)
def test_http_methods(method):
    assert classify_preface(method + b" / HTTP/1.1\r\nHost: x\r\n\r\n") == "http"
    assert classify_preface(method + b" ") == "http"
    for size in range(1, len(method) + 1):
        assert classify_preface(method[:size]) == "more", method[:size]


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1",
        b"HEAD /healthz",
        b"POST /v1",
        b"PUT x",
        b"DELETE /x",
        b"OPTIONS * HTTP/1.1",
        b"PATCH /x",
        b"CONNECT host:443 HTTP/1.1",
        b"TRACE /",
    ],
    ids=repr,
)
def test_http_request_lines(data):
    assert classify_preface(data) == "http"


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS 1.0-1.3 ClientHello record
        b"\x16\x03\x03",
        b"\x16\x03",
    ],
    ids=repr,
)
def test_tls(data):
    assert classify_preface(data) == "tls"


def test_lone_tls_record_byte_needs_more():
    assert classify_preface(b"\x16") == "more"


@pytest.mark.parametrize(
    "data",
    [
        b"GETX / HTTP/1.1",  # no space after the method
        b"GET\t/",
        b"get / HTTP/1.1",  # methods are case-sensitive
        b"BREW /pot HTTP/1.1",
        b"SSH-2.0-OpenSSH_9.6",
        b"PRI * HTTP/2.0",  # an h2 preface: not one of the methods we route
        b"\x00\x00\x00\x10\x81\xa1t",  # a frame without the magic
        b"\x89RDZX\r\n\x1a",
        MAGIC[:7] + b"\x1b",
        b"\x89PNG\r\n\x1a\n",
        b"\x16\x02\x00",
        b"\x15\x03\x01",  # a TLS alert, not a handshake
        b" GET /",
        b"X",
    ],
    ids=repr,
)
def test_unknown(data):
    assert classify_preface(data) == "unknown"


def test_accepts_any_bytes_like():
    assert classify_preface(bytearray(MAGIC)) == "rdzv"
    assert classify_preface(memoryview(b"GET /")) == "http"


@given(data=st.binary(max_size=32))
def test_property_always_a_kind_and_decided_by_eight_bytes(data):
    kind = classify_preface(data)
    assert kind in KINDS
    if len(data) >= PREFACE_LEN:
        assert kind != "more"
    assert classify_preface(data[:PREFACE_LEN]) == kind


@given(data=st.binary(max_size=12), extra=st.binary(min_size=1, max_size=12))
def test_property_a_decision_never_changes_with_more_bytes(data, extra):
    kind = classify_preface(data)
    if kind != "more":
        assert classify_preface(data + extra) == kind


@given(
    start=st.sampled_from([MAGIC, b"\x16\x03", *(m + b" " for m in HTTP_METHODS)]),
    extra=st.binary(max_size=12),
    data=st.data(),
)
def test_property_every_prefix_of_a_known_start_needs_more(start, extra, data):
    size = data.draw(st.integers(0, len(start) - 1))
    assert classify_preface(start[:size]) == "more"
    assert classify_preface(start + extra) in {"rdzv", "tls", "http"}
