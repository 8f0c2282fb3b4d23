"""CBOR (RFC 8949) as Rust's ciborium and serde write and read it, hand-written rather than taken from cbor2.

Only a hand-written codec gives serde's exact bytes (definite lengths, minimal heads, shortest-width floats that
round-trip), checks depth, lengths and duplicate keys before allocating anything, and can keep an item's bytes
verbatim. Knows nothing about burnpack: callers name the data (`source`, `label`) that errors should mention.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple, NoReturn

from kiln.ir.errors import RecordError

__all__ = ["MAX_DEPTH", "CborTag", "Decoder", "Encoder", "utf8"]

MAX_DEPTH = 128  # serde_cbor's and Burn's recursion limit


class CborTag(NamedTuple):
    """A tagged CBOR item inside an opaque value such as a QFloat scheme."""

    tag: int
    value: object


class Encoder:
    """CBOR as ciborium writes it: definite lengths, minimal heads, shortest round-tripping floats."""

    def __init__(self, source: str):
        """Write into `out`; errors name `source`."""
        self.out = bytearray()
        self.source = source

    def fail(self, reason: str) -> NoReturn:
        """Raise a RecordError naming the destination."""
        raise RecordError(f"{self.source}: {reason}")

    def head(self, major: int, argument: int) -> None:
        """Write a major type with its argument in the fewest bytes."""
        if not 0 <= argument < 2**64:
            self.fail(f"integer {argument} does not fit CBOR's 64-bit argument")
        if argument < 24:
            self.out.append(major << 5 | argument)
            return
        width = 1 if argument < 2**8 else 2 if argument < 2**16 else 4 if argument < 2**32 else 8
        self.out.append(major << 5 | (24 + width.bit_length() - 1))
        self.out += argument.to_bytes(width, "big")

    def integer(self, value: int) -> None:
        """Write a signed integer as major type 0 or 1."""
        if value >= 0:
            self.head(0, value)
        else:
            self.head(1, -1 - value)

    def floating(self, value: float) -> None:
        """Write a float at the narrowest IEEE width whose bits round-trip, as ciborium does."""
        bits = struct.pack(">d", value)
        for initial, fmt in ((0xF9, ">e"), (0xFA, ">f")):
            try:
                narrow = struct.pack(fmt, value)
            except OverflowError:
                continue
            if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == bits:
                self.out.append(initial)
                self.out += narrow
                return
        self.out.append(0xFB)
        self.out += bits

    def text(self, value: str) -> None:
        """Write a text string; strings that are not valid Unicode are refused."""
        self.raw_text(utf8(value, self.source))

    def raw_text(self, encoded: bytes) -> None:
        """Write a text string already encoded as UTF-8."""
        self.head(3, len(encoded))
        self.out += encoded

    def value(self, value: object, depth: int) -> None:
        """Write a generic Python value (for opaque schemes); dicts keep their insertion order. `depth` counts the
        containers around it; a container (array, map or tag) past MAX_DEPTH is refused, as the decoder would."""
        if depth >= MAX_DEPTH and isinstance(value, CborTag | list | tuple | Mapping):
            self.fail(f"value nests deeper than {MAX_DEPTH}")
        if value is None or isinstance(value, bool):
            self.out.append({None: 0xF6, False: 0xF4, True: 0xF5}[value])
        elif isinstance(value, int):
            self.integer(value)
        elif isinstance(value, float):
            self.floating(value)
        elif isinstance(value, str):
            self.text(value)
        elif isinstance(value, bytes | bytearray):
            self.head(2, len(value))
            self.out += value
        elif isinstance(value, CborTag):
            self.head(6, value.tag)
            self.value(value.value, depth + 1)
        elif isinstance(value, list | tuple):
            self.sequence(value, depth)
        elif isinstance(value, Mapping):
            self.mapping(value, depth)
        else:
            self.fail(f"cannot encode {type(value).__name__} as CBOR")

    def sequence(self, items: list | tuple, depth: int) -> None:
        """Write an array of generic values."""
        self.head(4, len(items))
        for item in items:
            self.value(item, depth + 1)

    def mapping(self, items: Mapping, depth: int) -> None:
        """Write a map of generic values in insertion order."""
        self.head(5, len(items))
        for key, item in items.items():
            self.value(key, depth + 1)
            self.value(item, depth + 1)


class Decoder:
    """A bounded CBOR reader: depth, lengths and UTF-8 are checked before anything is built from them."""

    def __init__(self, data: bytes, source: str, label: str = "CBOR"):
        """Read `data`, whose errors name `source` and call the data `label` (e.g. "metadata")."""
        self.data = data
        self.source = source
        self.label = label
        self.pos = 0
        self.depth = 0

    def fail(self, reason: str) -> NoReturn:
        """Raise a RecordError naming the source, the reason and where in the data it was found."""
        raise RecordError(f"{self.source}: bad {self.label} at byte {self.pos}: {reason}")

    def take(self, count: int) -> bytes:
        """Consume `count` bytes, refusing to run past the end."""
        if count > len(self.data) - self.pos:
            self.fail(f"{self.label} ends inside an item")
        chunk = self.data[self.pos : self.pos + count]
        self.pos += count
        return chunk

    def peek(self) -> int:
        """The next initial byte, not consumed."""
        if self.pos >= len(self.data):
            self.fail(f"{self.label} ends inside an item")
        return self.data[self.pos]

    def head(self) -> tuple[int, int, int | None]:
        """Consume an item head: major type, additional info, argument (None for indefinite length)."""
        initial = self.take(1)[0]
        major, info = initial >> 5, initial & 0x1F
        if info < 24:
            return major, info, info
        if info < 28:
            return major, info, int.from_bytes(self.take(1 << (info - 24)), "big")
        if info == 31 and major in (2, 3, 4, 5, 7):
            return major, info, None
        self.fail(f"malformed item head 0x{initial:02x}")

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """Count one level of container nesting, refusing more than MAX_DEPTH."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"CBOR nests deeper than {MAX_DEPTH}")
        yield
        self.depth -= 1

    def members(self, count: int | None, min_size: int) -> Iterator[int]:
        """Yield once per member of a definite or indefinite container, consuming the closing break."""
        if count is not None:
            if count * min_size > len(self.data) - self.pos:
                self.fail(f"container claims {count} members, more than the {self.label} holds")
            yield from range(count)
            return
        index = 0
        while self.peek() != 0xFF:
            yield index
            index += 1
        self.pos += 1

    def container(self, major: int, what: str) -> int | None:
        """Consume the head of an array (4) or map (5) and return its length (None if indefinite)."""
        found, _, count = self.head()
        if found != major:
            self.fail(f"{what} is not {'a map' if major == 5 else 'an array'}")
        return count

    def string(self, major: int, count: int | None) -> bytes:
        """The payload of a byte or text string whose head was consumed, joining indefinite chunks."""
        if count is not None:
            return self.take(count)
        chunks = []
        for _ in self.members(None, 1):
            chunk_major, _, size = self.head()
            if chunk_major != major or size is None:
                self.fail("malformed chunk in an indefinite-length string")
            chunks.append(self.take(size))
        return b"".join(chunks)

    def decode_text(self, raw: bytes, what: str) -> str:
        """Text payload as str; invalid UTF-8 is refused, as Rust's String is."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def text(self, what: str) -> str:
        """Consume a text string."""
        major, _, count = self.head()
        if major != 3:
            self.fail(f"{what} is not a text string")
        return self.decode_text(self.string(3, count), what)

    def uint(self, what: str) -> int:
        """Consume an unsigned integer (u64)."""
        major, _, value = self.head()
        if major != 0:
            self.fail(f"{what} is not an unsigned integer")
        return value

    def int64(self, what: str) -> int:
        """Consume a signed integer that fits i64."""
        major, _, value = self.head()
        if major not in (0, 1) or value >= 2**63:
            self.fail(f"{what} is not a 64-bit signed integer")
        return value if major == 0 else -1 - value

    def floating(self, what: str) -> float:
        """Consume a float of any IEEE width (f16, f32, f64)."""
        major, info, bits = self.head()
        if major != 7 or info not in (25, 26, 27):
            self.fail(f"{what} is not a float")
        return _float_from_bits(info, bits)

    def boolean(self, what: str) -> bool:
        """Consume `true` or `false`."""
        major, info, _ = self.head()
        if major != 7 or info not in (20, 21):
            self.fail(f"{what} is not a bool")
        return info == 21

    def optional_uint(self, what: str) -> int | None:
        """Consume an Option<u64>: null or an unsigned integer."""
        if self.peek() == 0xF6:
            self.pos += 1
            return None
        return self.uint(what)

    def uint_array(self, what: str, limit: int) -> list[int]:
        """Consume an array of unsigned integers holding at most `limit` members."""
        count = self.container(4, what)
        values: list[int] = []
        with self.nested():
            for index in self.members(count, 1):
                if index >= limit:
                    self.fail(f"{what} has more than {limit} members")
                values.append(self.uint(what))
        return values

    def variant(self, what: str) -> str:
        """Consume the head and name of a one-entry map `{variant: value}`, serde's externally tagged enum."""
        major, _, count = self.head()
        if major != 5 or count != 1:
            self.fail(f"{what} is not a one-entry map")
        return self.text(f"{what} variant")

    def struct(self, what: str, readers: Mapping[str, Callable[[], object]]) -> dict[str, object]:
        """Consume a serde struct: known fields via their readers, unknown ones skipped, no duplicates."""
        count = self.container(5, what)
        fields: dict[str, object] = {}
        with self.nested():
            for _ in self.members(count, 2):
                if self.peek() >> 5 != 3:
                    self.item(False)
                    self.item(False)
                    continue
                key = self.text(f"field name in {what}")
                if key in fields:
                    self.fail(f"{what} has duplicate field {key!r}")
                reader = readers.get(key)
                if reader is None:
                    self.item(False)
                else:
                    fields[key] = reader()
        return fields

    def text_map(
        self, what: str, read_value: Callable[[str], object], limit: int | None = None
    ) -> dict[str, object]:
        """Consume a BTreeMap<String, _>: text keys, no duplicates, at most `limit` entries if given."""
        count = self.container(5, what)
        if limit is not None and count is not None and count > limit:
            self.fail(f"{what} has {count} entries, more than {limit}")
        result: dict[str, object] = {}
        with self.nested():
            for index in self.members(count, 2):
                if limit is not None and index >= limit:
                    self.fail(f"{what} has more than {limit} entries")
                key = self.text(f"key in {what}")
                if key in result:
                    self.fail(f"{what} has duplicate key {key!r}")
                result[key] = read_value(key)
        return result

    def item(self, keep: bool) -> object:
        """Consume any well-formed item; build its Python value only when `keep`, else just validate it."""
        major, info, argument = self.head()
        if major == 0:
            return argument
        if major == 1:
            return -1 - argument
        if major in (2, 3):
            raw = self.string(major, argument)
            return raw if major == 2 else self.decode_text(raw, "text string")
        if major == 7:
            return self.simple(info, argument)
        with self.nested():
            if major == 4:
                return self.array_items(argument, keep)
            if major == 5:
                return self.map_items(argument, keep)
            return CborTag(argument, self.item(keep))

    def array_items(self, count: int | None, keep: bool) -> list | None:
        """Members of an array whose head was consumed."""
        values = []
        for _ in self.members(count, 1):
            value = self.item(keep)
            if keep:
                values.append(value)
        return values if keep else None

    def map_items(self, count: int | None, keep: bool) -> dict | None:
        """Entries of a map whose head was consumed; duplicate or unhashable keys refused when kept."""
        result: dict = {}
        for _ in self.members(count, 2):
            key, value = self.item(keep), self.item(keep)
            if not keep:
                continue
            try:
                duplicate = key in result
            except TypeError:
                self.fail("map key contains an array or map")
            if duplicate:
                self.fail(f"map has duplicate key {key!r}")
            result[key] = value
        return result if keep else None

    def simple(self, info: int, argument: int | None) -> object:
        """A major-type-7 item: false, true, null or a float; other simple values and stray breaks refused."""
        if info in (20, 21, 22):
            return {20: False, 21: True, 22: None}[info]
        if info in (25, 26, 27):
            return _float_from_bits(info, argument)
        self.fail("unsupported CBOR simple value" if info != 31 else "unexpected break")

    def single_item(self, keep: bool = False) -> object:
        """Consume exactly one item spanning all the data."""
        value = self.item(keep)
        self.finish()
        return value

    def finish(self) -> None:
        """Refuse bytes left over after the top-level item."""
        if self.pos != len(self.data):
            self.fail(f"{len(self.data) - self.pos} trailing byte(s) after the {self.label}")


def _float_from_bits(info: int, bits: int) -> float:
    """Decode an f16 (info 25), f32 (26) or f64 (27) argument."""
    fmt, width = {25: (">e", 2), 26: (">f", 4), 27: (">d", 8)}[info]
    return struct.unpack(fmt, bits.to_bytes(width, "big"))[0]


def utf8(text: str, source: str) -> bytes:
    """Encode a name as UTF-8, refusing non-str values and lone surrogates with a RecordError."""
    if not isinstance(text, str):
        raise RecordError(f"{source}: expected a string, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(f"{source}: {text!r} is not valid Unicode") from None
