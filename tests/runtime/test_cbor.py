"""Tests for kiln.runtime.records.cbor, the codec on its own: ciborium's bytes (minimal heads, shortest-width
floats), generic values and tags round-tripping, and the depth, size, duplicate-key and UTF-8 checks."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import pytest

from kiln.ir.errors import RecordError
from kiln.runtime.records.cbor import MAX_DEPTH, CborTag, Decoder, Encoder, utf8


def encode(value: object) -> bytes:
    encoder = Encoder("<test>")
    encoder.value(value, 0)
    return bytes(encoder.out)


def decode(data: bytes) -> object:
    return Decoder(data, "<test>").single_item(keep=True)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, b"\x00"),
        (23, b"\x17"),
        (24, b"\x18\x18"),
        (256, b"\x19\x01\x00"),
        (2**32, b"\x1b" + (2**32).to_bytes(8, "big")),
        (-1, b"\x20"),
        (-(2**64), b"\x3b" + b"\xff" * 8),
        (1.5, b"\xf9\x3e\x00"),
        (65520.0, b"\xfa" + struct.pack(">f", 65520.0)),
        (0.1, b"\xfb" + struct.pack(">d", 0.1)),
        (math.inf, b"\xf9\x7c\x00"),
        ("é", b"\x62\xc3\xa9"),
        (b"\x01", b"\x41\x01"),
        (None, b"\xf6"),
        (True, b"\xf5"),
        ([1, [2]], b"\x82\x01\x81\x02"),
        ({"b": 1, "a": 2}, b"\xa2\x61b\x01\x61a\x02"),  # insertion order, as serde writes a struct
        (CborTag(7, 5), b"\xc7\x05"),
    ],
    ids=repr,
)
def test_values_encode_minimally_and_round_trip(value: object, encoded: bytes) -> None:
    assert encode(value) == encoded
    assert decode(encoded) == value


@pytest.mark.parametrize("bad", [2**64, -(2**64) - 1, object(), "\ud800"], ids=repr)
def test_unencodable_values_are_record_errors_naming_the_source(bad: object) -> None:
    with pytest.raises(RecordError, match="<test>"):
        encode(bad)


def nested(depth: int) -> object:
    """`depth` arrays around a 0, the shape the decoder's limit counts."""
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def empty_nest(depth: int, container: Callable[[object], object]) -> object:
    """`depth` containers with nothing inside the innermost one (tags wrap an empty array)."""
    value: object = []
    for _ in range(depth - 1):
        value = container(value)
    return value


def test_encoding_refuses_what_decoding_would_refuse() -> None:
    assert decode(encode(nested(MAX_DEPTH))) == nested(MAX_DEPTH)
    with pytest.raises(RecordError, match=f"deeper than {MAX_DEPTH}"):
        encode(nested(MAX_DEPTH + 1))


@pytest.mark.parametrize("container", [lambda v: [v], lambda v: {"k": v}, lambda v: CborTag(6, v)])
def test_empty_containers_count_as_nesting_both_ways(container) -> None:
    """An empty innermost container is one level too: what the encoder writes, the decoder reads back."""
    assert decode(encode(empty_nest(MAX_DEPTH, container))) == empty_nest(MAX_DEPTH, container)
    too_deep = empty_nest(MAX_DEPTH + 1, container)
    with pytest.raises(RecordError, match=f"deeper than {MAX_DEPTH}"):
        encode(too_deep)


@pytest.mark.parametrize(("depth", "accepted"), [(MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_decoding_refuses_nesting_past_the_limit(depth: int, accepted: bool) -> None:
    data = b"\x81" * depth + b"\x00"
    if accepted:
        assert Decoder(data, "<test>").single_item() is None
    else:
        with pytest.raises(RecordError, match=f"deeper than {MAX_DEPTH}"):
            Decoder(data, "<test>").single_item()


def test_indefinite_lengths_decode_like_definite_ones() -> None:
    assert decode(b"\x9f\x01\x02\xff") == [1, 2]
    assert decode(b"\xbf\x61a\x01\xff") == {"a": 1}
    assert decode(b"\x7f\x61a\x61b\xff") == "ab"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xa2\x61a\x01\x61a\x02", "duplicate key 'a'"),
        (b"\xa1\x81\x01\x02", "array or map"),
        (b"\x9b" + b"\xff" * 8, "claims"),
        (b"\x7b" + b"\xff" * 8, "ends inside an item"),
        (b"\x62\xc3", "ends inside an item"),
        (b"\x61\xff", "UTF-8"),
        (b"\x1c", "malformed item head"),
        (b"\xff", "unexpected break"),
        (b"\xf7", "simple value"),
        (b"\x7f\x41a\xff", "chunk"),
        (b"\x00\x00", "1 trailing byte"),
    ],
    ids=repr,
)
def test_malformed_data_is_a_record_error_naming_source_label_and_position(data: bytes, match: str) -> None:
    with pytest.raises(RecordError, match=match) as info:
        Decoder(data, "<test>", "scheme").single_item(keep=True)
    assert str(info.value).startswith("<test>: bad scheme at byte ")


def test_serde_struct_skips_unknown_fields_and_refuses_duplicates() -> None:
    dec = Decoder(b"\xa3\x61a\x01\x61z\x82\x00\x00\x01\x02", "<test>")  # {"a": 1, "z": [0, 0], 1: 2}
    assert dec.struct("s", {"a": lambda: dec.uint("a")}) == {"a": 1}
    dec.finish()
    dup = Decoder(b"\xa2\x61a\x01\x61a\x02", "<test>")
    with pytest.raises(RecordError, match="duplicate field 'a'"):
        dup.struct("s", {"a": lambda: dup.uint("a")})


def test_utf8_refuses_non_strings_and_lone_surrogates() -> None:
    assert utf8("é", "<test>") == b"\xc3\xa9"
    with pytest.raises(RecordError, match="expected a string"):
        utf8(b"x", "<test>")
    with pytest.raises(RecordError, match="not valid Unicode"):
        utf8("\ud800", "<test>")
