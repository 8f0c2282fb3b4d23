"""Burn's `QFloat` tensor bytes and scheme for kiln's quantized parameters (burn-notes §1.3-1.4, §2.8).

A quantized parameter (integer codes and f32 scales, `ir/ops/quant.py`) is one Burn tensor of dtype
`{"QFloat": scheme}` whose bytes are, in order:

1. the codes, two's complement, packed into little-endian u32 words along the innermost dimension
   (`PackedU32(0)`): 4 x 8-bit, 8 x 4-bit or 16 x 2-bit per word, element i of a word at bits `i * bits`;
   every line (run along the innermost dimension) is padded with zero codes to whole words separately;
2. padding to a 4-byte boundary (none: words are 4 bytes);
3. the scales as little-endian f32, one per block in row-major block order (one when per-tensor).

The scheme is Burn HEAD's (cubecl rev 48348968) `QuantScheme` map
`{value, store: {"PackedU32": 0}, mode: "Symmetric", tensor: null, block}`, with `block` null per tensor
or `{"size": {"storage": [u8; 5], "len": n}, "dtype": "F32"}` per block (the block dims first, padded with
1s, as cubecl's `BlockSize::new`). Schemes kiln cannot represent (Burn 0.21's fields, float values,
other stores, the two-level form) are refused with a RecordError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.ir import DType, RecordError
from kiln.ir.ops.quant import VALUE_RANGES, code_dtype, scales_shape

__all__ = ["QFloatScheme", "decode_codes", "decode_scales", "encode", "nbytes", "pack_codes", "unpack_codes"]

WORD_BITS = 32
MAX_BLOCK_DIMS = 5  # cubecl's BlockSize::MAX_DIMS
_BURN_VALUES = {value: value.upper() for value in VALUE_RANGES}  # q8f -> Q8F
_KILN_VALUES = {burn: kiln for kiln, burn in _BURN_VALUES.items()}
_STORE = {"PackedU32": 0}


def value_bits(value: str) -> int:
    """Bits per code of a value kind (q8f: 8, q4s: 4, q2f: 2)."""
    return int(value[1])


@dataclass(frozen=True)
class QFloatScheme:
    """kiln's view of a Burn QuantScheme: the value kind and the block over the trailing dims (() per tensor)."""

    value: str
    block: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        if self.value not in VALUE_RANGES:
            raise RecordError(f"QFloat value {self.value!r} is not one of {sorted(VALUE_RANGES)}")
        if len(self.block) > MAX_BLOCK_DIMS or any(not 1 <= b <= 255 for b in self.block):
            raise RecordError(f"QFloat block {list(self.block)} does not fit Burn's BlockSize "
                              f"(at most {MAX_BLOCK_DIMS} dims of 1..255)")

    @property
    def bits(self) -> int:
        return value_bits(self.value)

    @property
    def code_dtype(self) -> DType:
        """The kiln dtype codes load as: i8 for 8-bit values, i4 for 4- and 2-bit ones."""
        return code_dtype(self.value)

    def to_burn(self) -> dict:
        """The scheme as Burn HEAD serializes it (a map in field order), for BurnDType.qfloat."""
        block = None
        if self.block:
            storage = list(self.block) + [1] * (MAX_BLOCK_DIMS - len(self.block))
            block = {"size": {"storage": storage, "len": len(self.block)}, "dtype": "F32"}
        return {"value": _BURN_VALUES[self.value], "store": dict(_STORE), "mode": "Symmetric", "tensor": None,
                "block": block}

    @classmethod
    def from_burn(cls, scheme: object) -> QFloatScheme:
        """kiln's scheme for a decoded Burn scheme, or a RecordError saying what kiln cannot represent."""
        if not isinstance(scheme, Mapping) or set(scheme) != {"value", "store", "mode", "tensor", "block"}:
            keys = sorted(scheme) if isinstance(scheme, Mapping) else type(scheme).__name__
            raise RecordError(f"QFloat scheme with fields {keys} is not Burn HEAD's (value, store, mode, tensor, "
                              f"block); kiln cannot read it")
        value = _KILN_VALUES.get(scheme["value"]) if isinstance(scheme["value"], str) else None
        if value is None:
            raise RecordError(f"QFloat value {scheme['value']!r} is not supported (only {sorted(_KILN_VALUES)})")
        if scheme["store"] != _STORE:
            raise RecordError(f"QFloat store {scheme['store']!r} is not supported (only {_STORE})")
        if scheme["mode"] != "Symmetric":
            raise RecordError(f"QFloat mode {scheme['mode']!r} is not supported (only 'Symmetric')")
        block = scheme["block"]
        if block is None:
            if scheme["tensor"] not in (None, "F32"):
                raise RecordError(f"QFloat tensor scale dtype {scheme['tensor']!r} is not supported (only F32)")
            return cls(value)
        if scheme["tensor"] is not None:
            raise RecordError("QFloat two-level schemes (block and tensor scales) are not supported")
        try:
            size, dtype = block["size"], block["dtype"]
            dims = tuple(size["storage"])[: size["len"]]
        except (KeyError, TypeError) as error:
            raise RecordError(f"QFloat block {block!r} is malformed: {error}") from None
        if dtype != "F32":
            raise RecordError(f"QFloat block scale dtype {dtype!r} is not supported (only F32)")
        return cls(value, dims)


def _lines(shape: Sequence[int]) -> tuple[int, int]:
    """(number of lines, line length) along the innermost dim; a scalar is one line of one element."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def words_per_line(length: int, bits: int) -> int:
    return -(-length // (WORD_BITS // bits))


def nbytes(shape: Sequence[int], scheme: QFloatScheme) -> int:
    """Length of the QFloat bytes: packed words, then one f32 scale per block."""
    lines, length = _lines(shape)
    n_scales = math.prod(scales_shape("qfloat", tuple(shape), scheme.block))
    return lines * words_per_line(length, scheme.bits) * 4 + n_scales * 4


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes as little-endian u32 words, shape [lines, words per line]; each line is zero-padded separately."""
    per_word = WORD_BITS // bits
    lines, length = _lines(codes.shape)
    flat = np.asarray(codes).astype(np.int8).reshape(lines, length)
    words = words_per_line(length, bits)
    padded = np.zeros((lines, words * per_word), np.uint32)
    padded[:, :length] = flat.view(np.uint8) & np.uint8((1 << bits) - 1)
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(bits))
    packed = np.bitwise_or.reduce(padded.reshape(lines, words, per_word) << shifts, axis=2)
    return packed.astype("<u4")


def unpack_codes(words: np.ndarray, shape: Sequence[int], bits: int, dtype: DType) -> np.ndarray:
    """The inverse of pack_codes: codes of `shape` in `dtype` (sign-extended from `bits`)."""
    per_word = WORD_BITS // bits
    lines, length = _lines(shape)
    words = np.asarray(words, "<u4").reshape(lines, -1)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    fields = ((words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(lines, -1)[:, :length]
    sign = np.int16(1 << (bits - 1))
    codes = ((fields.astype(np.int16) ^ sign) - sign).astype(np.int8)
    return codes.reshape(tuple(shape)).astype(dtype.numpy)


def encode(codes: np.ndarray, scales: np.ndarray, scheme: QFloatScheme) -> np.ndarray:
    """The QFloat bytes of codes and their scales (as uint8)."""
    codes = np.asarray(codes)
    want = scales_shape("qfloat", codes.shape, scheme.block)
    scales = np.asarray(scales, np.float32)
    if scales.size != math.prod(want):
        raise RecordError(f"QFloat: {scales.size} scales for codes {list(codes.shape)} with block "
                          f"{list(scheme.block)}, which need {list(want)}")
    packed = pack_codes(codes, scheme.bits).reshape(-1).view(np.uint8)
    return np.concatenate([packed, scales.astype("<f4").reshape(-1).view(np.uint8)])


def _words_nbytes(shape: Sequence[int], scheme: QFloatScheme) -> int:
    lines, length = _lines(shape)
    return lines * words_per_line(length, scheme.bits) * 4


def _check_length(data: memoryview | np.ndarray, shape: Sequence[int], scheme: QFloatScheme) -> None:
    expected = nbytes(shape, scheme)
    if len(data) != expected:
        raise RecordError(f"QFloat {scheme.value} {list(shape)} block {list(scheme.block)} needs {expected} bytes, "
                          f"got {len(data)}")


def decode_codes(data: memoryview | bytes | np.ndarray, shape: Sequence[int], scheme: QFloatScheme) -> np.ndarray:
    """The codes of QFloat bytes, in the scheme's code dtype."""
    view = np.frombuffer(data, np.uint8)
    _check_length(view, shape, scheme)
    words = view[: _words_nbytes(shape, scheme)].view("<u4")
    return unpack_codes(words, shape, scheme.bits, scheme.code_dtype)


def decode_scales(data: memoryview | bytes | np.ndarray, shape: Sequence[int], scheme: QFloatScheme) -> np.ndarray:
    """The f32 scales of QFloat bytes, shaped as `quantize` returns them ([1] per tensor)."""
    view = np.frombuffer(data, np.uint8)
    _check_length(view, shape, scheme)
    scales = view[_words_nbytes(shape, scheme):].view("<f4").astype(np.float32)
    return scales.reshape(scales_shape("qfloat", tuple(shape), scheme.block))
