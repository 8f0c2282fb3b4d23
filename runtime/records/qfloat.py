"""Burn's `QFloat` tensor bytes and scheme for kiln's quantized parameters (burn-notes §1.3-1.4, §2.8).

A quantized parameter (integer codes and their scales, `ir/ops/quant.py`) is one Burn tensor of dtype
`{"QFloat": scheme}` whose bytes are, in order:

1. the codes, two's complement, packed into little-endian u32 words along the innermost dimension
   (`PackedU32(0)`): 4 x 8-bit, 8 x 4-bit or 16 x 2-bit per word, element i of a word at bits `i * bits`;
   every line (run along the innermost dimension) is padded with zero codes to whole words separately;
2. padding to a 4-byte boundary (none: words are 4 bytes);
3. the scales, little-endian at their scale dtype (F32, F16 or BF16 bit patterns), one per block in
   row-major block order (one when per-tensor).

The scheme is Burn HEAD's (cubecl rev 48348968) `QuantScheme` map
`{value, store: {"PackedU32": 0}, mode: "Symmetric", tensor, block}`: per tensor `block` is null and `tensor`
the scale dtype (null for F32, as kiln has always written it, or "F16"/"BF16"); per block `tensor` is null and
`block` is `{"size": {"storage": [u8; 5], "len": n}, "dtype": <scale dtype>}` (the block dims first, padded with
1s, as cubecl's `BlockSize::new`). NF4 is kiln's own scheme, which Burn does not read: value "KilnNF4", mode
"Lookup", codes packed as 4-bit two's complement (code c names level NF4[c + 8]); double-quantized, its map
has a sixth key `"kiln_double_quant": 256` (the group size) and the scales part is the i8 scale codes, zero
padding to 4 bytes, the f32 group scales and the f32 offset (`quant.double_quantize`). `from_burn` refuses schemes
kiln cannot represent (Burn 0.21's fields, float values, other stores, the two-level form) with a RecordError;
a record keeps such a tensor opaque (`record.py`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.ir import DType, RecordError, ShapeError
from kiln.ir.ops.quant import (
    LOOKUP_TABLES,
    SCALE_DTYPES,
    SCALE_GROUP,
    VALUE_KINDS,
    check_double_quant,
    code_dtype,
    scale_groups,
    scales_shape,
    value_bits,
)

__all__ = ["QFloatScheme", "decode_codes", "decode_scales", "encode", "nbytes", "pack_codes", "unpack_codes",
           "value_bits"]

WORD_BITS = 32
MAX_BLOCK_DIMS = 5  # cubecl's BlockSize::MAX_DIMS
_BURN_VALUES = {value: "KilnNF4" if value == "nf4" else value.upper() for value in VALUE_KINDS}  # q8f -> Q8F
_KILN_VALUES = {burn: kiln for kiln, burn in _BURN_VALUES.items()}
_STORE = {"PackedU32": 0}
_BURN_SCALES = {DType.f32: "F32", DType.f16: "F16", DType.bf16: "BF16"}  # Burn's ScaleDtype names
_KILN_SCALES = {burn: kiln for kiln, burn in _BURN_SCALES.items()}
_FIELDS = {"value", "store", "mode", "tensor", "block"}
_DOUBLE = "kiln_double_quant"
_LE = {DType.f32: np.dtype("<f4"), DType.f16: np.dtype("<f2"), DType.bf16: np.dtype("<u2")}  # bf16 as its bits


@dataclass(frozen=True)
class QFloatScheme:
    """kiln's view of a Burn QuantScheme: the value kind, the block over the trailing dims (() per tensor) and
    the scale dtype."""

    value: str
    block: tuple[int, ...] = ()
    scale_dtype: DType = DType.f32
    double_quant: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "block", tuple(operator.index(b) for b in self.block))
        except TypeError:
            raise RecordError(f"QFloat block {list(self.block)} is not a list of integers") from None
        if self.value not in VALUE_KINDS:
            raise RecordError(f"QFloat value {self.value!r} is not one of {sorted(VALUE_KINDS)}")
        if self.double_quant:
            try:
                check_double_quant(self.value)
            except ShapeError as error:
                raise RecordError(f"QFloat: {error}") from None
            if self.scale_dtype is not DType.f32:
                raise RecordError(f"QFloat: double quantization codes f32 scales, not {self.scale_dtype.value}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise RecordError(f"QFloat scale dtype {self.scale_dtype.value} is not one of "
                              f"{[d.value for d in SCALE_DTYPES]}")
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

    def __str__(self) -> str:
        """e.g. `nf4 block [64] f16`, `q8s per tensor f32`: what `kiln inspect` shows."""
        layout = f"block {list(self.block)}" if self.block else "per tensor"
        scales = f"double-quantized ({SCALE_GROUP})" if self.double_quant else self.scale_dtype.value
        return f"{self.value} {layout} {scales}"

    @property
    def mode(self) -> str:
        """Burn's QuantMode: Lookup for a table of levels (kiln's NF4), else Symmetric."""
        return "Lookup" if self.value in LOOKUP_TABLES else "Symmetric"

    @property
    def scale_bytes(self) -> int:
        return self.scale_dtype.bits // 8

    def to_burn(self) -> dict:
        """The scheme as Burn HEAD serializes it (a map in field order), for BurnDType.qfloat."""
        block, tensor = None, None
        if self.block:
            storage = list(self.block) + [1] * (MAX_BLOCK_DIMS - len(self.block))
            block = {"size": {"storage": storage, "len": len(self.block)}, "dtype": _BURN_SCALES[self.scale_dtype]}
        elif self.scale_dtype is not DType.f32:
            tensor = _BURN_SCALES[self.scale_dtype]
        burn = {"value": _BURN_VALUES[self.value], "store": dict(_STORE), "mode": self.mode, "tensor": tensor,
                "block": block}
        return {**burn, _DOUBLE: SCALE_GROUP} if self.double_quant else burn

    @classmethod
    def from_burn(cls, scheme: object) -> QFloatScheme:
        """kiln's scheme for a decoded Burn scheme, or a RecordError saying what kiln cannot represent."""
        double = isinstance(scheme, Mapping) and scheme.get("value") == _BURN_VALUES["nf4"] and _DOUBLE in scheme
        if not isinstance(scheme, Mapping) or set(scheme) != (_FIELDS | {_DOUBLE} if double else _FIELDS):
            keys = sorted(map(repr, scheme)) if isinstance(scheme, Mapping) else type(scheme).__name__  # any key type
            raise RecordError(f"QFloat scheme with fields {keys} is not Burn HEAD's (value, store, mode, tensor, "
                              f"block); kiln cannot read it")
        if double and scheme[_DOUBLE] != SCALE_GROUP:
            raise RecordError(f"QFloat {_DOUBLE} = {scheme[_DOUBLE]!r} is not supported (only {SCALE_GROUP})")
        value = _KILN_VALUES.get(scheme["value"]) if isinstance(scheme["value"], str) else None
        if value is None:
            raise RecordError(f"QFloat value {scheme['value']!r} is not supported (only {sorted(_KILN_VALUES)})")
        if scheme["store"] != _STORE:
            raise RecordError(f"QFloat store {scheme['store']!r} is not supported (only {_STORE})")
        if scheme["mode"] != cls(value).mode:
            raise RecordError(f"QFloat mode {scheme['mode']!r} is not supported for {scheme['value']} "
                              f"(only {cls(value).mode!r})")
        block = scheme["block"]
        if block is None:
            tensor = _KILN_SCALES.get(scheme["tensor"] or "F32") if isinstance(scheme["tensor"], str | None) else None
            if tensor is None:
                raise RecordError(f"QFloat tensor scale dtype {scheme['tensor']!r} is not supported "
                                  f"(only {sorted(_KILN_SCALES)})")
            return cls(value, (), tensor, double)
        if scheme["tensor"] is not None:
            raise RecordError("QFloat two-level schemes (block and tensor scales) are not supported")
        try:
            size, dtype = block["size"], block["dtype"]
            dims = tuple(size["storage"])[: size["len"]]
        except (KeyError, TypeError) as error:
            raise RecordError(f"QFloat block {block!r} is malformed: {error}") from None
        if not isinstance(dtype, str) or dtype not in _KILN_SCALES:
            raise RecordError(f"QFloat block scale dtype {dtype!r} is not supported (only {sorted(_KILN_SCALES)})")
        return cls(value, dims, _KILN_SCALES[dtype], double)


def _lines(shape: Sequence[int]) -> tuple[int, int]:
    """(number of lines, line length) along the innermost dim; a scalar is one line of one element."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def words_per_line(length: int, bits: int) -> int:
    return -(-length // (WORD_BITS // bits))


def nbytes(shape: Sequence[int], scheme: QFloatScheme) -> int:
    """Length of the QFloat bytes: packed words, then one scale per block at the scale dtype (double-quantized:
    one i8 code per block padded to 4 bytes, an f32 per group and the f32 offset)."""
    n_scales = math.prod(scales_shape("qfloat", tuple(shape), scheme.block))
    if scheme.double_quant:
        return _words_nbytes(shape, scheme) + _padded(n_scales) + 4 * (scale_groups(n_scales) + 1)
    return _words_nbytes(shape, scheme) + n_scales * scheme.scale_bytes


def _padded(n: int) -> int:
    """n bytes rounded up to a 4-byte boundary."""
    return -(-n // 4) * 4


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


def encode(codes: np.ndarray, scales: np.ndarray | Sequence[np.ndarray], scheme: QFloatScheme) -> np.ndarray:
    """The QFloat bytes of codes and their scales (as uint8): one array at the scheme's scale dtype, or under
    double quantization the (i8 codes, f32 group scales, f32 offset) triple."""
    codes = np.asarray(codes)
    parts = tuple(np.asarray(a) for a in scales) if scheme.double_quant else (np.asarray(scales),)
    want = scales_shape("qfloat", codes.shape, scheme.block)
    if parts[0].size != math.prod(want):
        raise RecordError(f"QFloat: {parts[0].size} scales for codes {list(codes.shape)} with block "
                          f"{list(scheme.block)}, which need {list(want)}")
    packed = pack_codes(codes, scheme.bits).reshape(-1).view(np.uint8)
    if scheme.double_quant:
        q, groups, offset = parts
        if q.dtype != np.int8 or groups.size != scale_groups(q.size) or offset.size != 1:
            raise RecordError(f"QFloat: double-quantized scales need i8 codes, {scale_groups(q.size)} f32 group "
                              f"scales and one f32 offset, got {q.dtype} {groups.size} {offset.size}")
        pad = np.zeros(_padded(q.size) - q.size, np.uint8)
        tail = np.concatenate([groups.reshape(-1), offset.reshape(-1)]).astype("<f4").view(np.uint8)
        return np.concatenate([packed, q.reshape(-1).view(np.uint8), pad, tail])
    (scales,) = parts
    if scales.dtype != scheme.scale_dtype.numpy:
        raise RecordError(f"QFloat: scales of dtype {scales.dtype} for a scheme with {scheme.scale_dtype.value} "
                          "scales")
    stored = scales.view(np.uint16) if scheme.scale_dtype is DType.bf16 else scales
    return np.concatenate([packed, stored.astype(_LE[scheme.scale_dtype]).reshape(-1).view(np.uint8)])


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


def decode_scales(data: memoryview | bytes | np.ndarray, shape: Sequence[int], scheme: QFloatScheme
                  ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scales of QFloat bytes in the scheme's scale dtype, shaped as `quantize` returns them ([1] per
    tensor); double-quantized, the (i8 codes, f32 group scales, f32 [1] offset) triple."""
    view = np.frombuffer(data, np.uint8)
    _check_length(view, shape, scheme)
    want = scales_shape("qfloat", tuple(shape), scheme.block)
    rest = view[_words_nbytes(shape, scheme):]
    if scheme.double_quant:
        n = math.prod(want)
        floats = rest[_padded(n):].view("<f4").astype(np.float32)
        return rest[:n].view(np.int8).reshape(want).copy(), floats[:-1].copy(), floats[-1:].copy()
    little = _LE[scheme.scale_dtype]
    stored = rest.view(little).astype(little.newbyteorder("="))
    scales = stored.view(scheme.scale_dtype.numpy) if scheme.scale_dtype is DType.bf16 else stored
    return scales.reshape(want)
