"""QFloat packing (runtime/qfloat.py) against burn-notes §1.3-1.4: packed u32 words per line, then f32 scales."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import DType, RecordError
from kiln.ir.ops.quant import VALUE_RANGES, quantize
from kiln.runtime.records import qfloat
from kiln.runtime.records.burnpack import BurnDType
from kiln.runtime.records.burnpack_io import BurnpackFile
from kiln.runtime.records.qfloat import QFloatScheme
from kiln.runtime.records.record import ModuleRecord, RecordEntry

RNG = np.random.default_rng(7)


def _codes(value: str, shape: tuple[int, ...]) -> np.ndarray:
    a, b = VALUE_RANGES[value]
    return RNG.integers(a, b + 1, size=shape).astype(np.int8)


@pytest.mark.parametrize("value", sorted(VALUE_RANGES))
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 7), (2, 3, 17), (4, 32), (2, 33)])
def test_pack_unpack_is_the_identity_for_every_value_kind(value, shape):
    bits = qfloat.value_bits(value)
    codes = _codes(value, shape)
    words = qfloat.pack_codes(codes, bits)
    assert words.dtype == np.dtype("<u4")
    out = qfloat.unpack_codes(words, shape, bits, DType.i8)
    np.testing.assert_array_equal(out, codes)


@pytest.mark.parametrize(("bits", "length", "words"), [(8, 5, 2), (4, 9, 2), (2, 17, 2), (2, 16, 1), (8, 4, 1)])
def test_each_line_is_padded_to_whole_words_separately(bits, length, words):
    codes = np.full((3, length), -1, np.int8)
    packed = qfloat.pack_codes(codes, bits)
    assert packed.shape == (3, words)
    per_word = 32 // bits
    pad = words * per_word - length
    assert np.all(packed[:, -1] >> np.uint32(32 - pad * bits) == 0) if pad else True  # zero padding codes
    np.testing.assert_array_equal(qfloat.unpack_codes(packed, codes.shape, bits, DType.i8), codes)


def test_hand_computed_q4s_per_tensor_bytes():
    """[[1,-2,3],[-7,0,7]] in 4 bits: line 0 -> 0x000003E1, line 1 -> 0x00000709 (one word each), then 0.5 f32."""
    codes = np.array([[1, -2, 3], [-7, 0, 7]], np.int8)
    data = qfloat.encode(codes, np.array([0.5], np.float32), QFloatScheme("q4s"))
    assert data.tobytes() == bytes.fromhex("e1030000" "09070000" "0000003f")
    assert qfloat.nbytes((2, 3), QFloatScheme("q4s")) == 12
    np.testing.assert_array_equal(qfloat.decode_codes(data, (2, 3), QFloatScheme("q4s")), codes.astype(DType.i4.numpy))
    np.testing.assert_array_equal(qfloat.decode_scales(data, (2, 3), QFloatScheme("q4s")), [0.5])


def test_hand_computed_q8f_per_block_and_q2f_bytes():
    scheme = QFloatScheme("q8f", (2,))
    data = qfloat.encode(np.array([[-128, 127, 1, -1]], np.int8), np.array([[1.0, 2.0]], np.float32), scheme)
    assert data.tobytes() == bytes.fromhex("807f01ff" "0000803f" "00000040")
    # 2-bit: 1, -2, -1 at bits 0, 2, 4 -> 0b11_10_01 = 0x39; 17 codes take two words
    codes = np.zeros(17, np.int8)
    codes[:3] = [1, -2, -1]
    codes[16] = 1
    data = qfloat.encode(codes, np.array([0.25], np.float32), QFloatScheme("q2f"))
    assert data.tobytes() == bytes.fromhex("39000000" "01000000" "0000803e")


@pytest.mark.parametrize("value", sorted(VALUE_RANGES))
@pytest.mark.parametrize("block", [(), (4,), (2, 4)])
def test_encode_decode_round_trip_per_tensor_and_per_block(value, block):
    x = RNG.standard_normal((6, 12)).astype(np.float32)
    codes, scales = quantize(x, value, block, "minmax")
    scheme = QFloatScheme(value, block)
    data = qfloat.encode(codes, scales, scheme)
    assert len(data) == qfloat.nbytes(x.shape, scheme)
    np.testing.assert_array_equal(qfloat.decode_codes(data, x.shape, scheme).astype(np.int8), codes.astype(np.int8))
    np.testing.assert_array_equal(qfloat.decode_scales(data, x.shape, scheme), scales)


def test_scheme_cbor_matches_burn_head_field_order():
    """{value, store: {PackedU32: 0}, mode, tensor: null, block: null} as serde/ciborium writes the struct."""
    cbor = BurnDType.qfloat(QFloatScheme("q8f").to_burn()).scheme
    expected = (b"\xa5" + b"\x65value\x63Q8F" + b"\x65store\xa1\x69PackedU32\x00" + b"\x64mode\x69Symmetric"
                + b"\x66tensor\xf6" + b"\x65block\xf6")
    assert cbor == expected
    block = QFloatScheme("q4s", (1, 32)).to_burn()["block"]
    assert block == {"size": {"storage": [1, 32, 1, 1, 1], "len": 2}, "dtype": "F32"}
    assert QFloatScheme.from_burn(BurnDType.qfloat(QFloatScheme("q4s", (1, 32)).to_burn()).scheme_value) == \
        QFloatScheme("q4s", (1, 32))


@pytest.mark.parametrize("scheme", [
    {"value": "Q8F", "param": "F32", "store": "Native", "level": "Tensor", "mode": "Symmetric"},  # Burn 0.21
    {"value": "E4M3", "store": {"PackedU32": 0}, "mode": "Symmetric", "tensor": None, "block": None},
    {"value": "Q8F", "store": "Native", "mode": "Symmetric", "tensor": None, "block": None},
    {"value": "Q8F", "store": {"PackedU32": 0}, "mode": "Symmetric", "tensor": "F32",
     "block": {"size": {"storage": [4, 1, 1, 1, 1], "len": 1}, "dtype": "F16"}},
    {"value": "Q8F", 7: "x", b"raw": None},  # issue 15: mixed key types once raised TypeError while naming them
    {"value": "Q8F", "store": {"PackedU32": 0}, "mode": "Symmetric", "tensor": None,
     "block": {"size": {"storage": ["a", 1, 1, 1, 1], "len": 1}, "dtype": "F32"}},
])
def test_unsupported_schemes_are_refused(scheme):
    with pytest.raises(RecordError):
        QFloatScheme.from_burn(scheme)


def test_record_entry_is_one_qfloat_tensor_and_reads_back():
    x = RNG.standard_normal((4, 10)).astype(np.float32)
    codes, scales = quantize(x, "q4f", (2,), "minmax")
    scheme = QFloatScheme("q4f", (2,))
    record = ModuleRecord({"w": RecordEntry(9, DType.i4, x.shape, codes, scheme, scales)})
    data = record.to_bytes()
    pack = BurnpackFile.from_bytes(data)
    (entry,) = pack.entries.values()
    assert entry.dtype.kind == "QFloat" and entry.shape == (4, 10) and entry.param_id == 9
    assert bytes(pack.tensor_bytes("w")) == qfloat.encode(codes, scales, scheme).tobytes()
    back = ModuleRecord.from_bytes(data)["w"]
    assert back.scheme == scheme and back.dtype is DType.i4 and back.param_id == 9
    np.testing.assert_array_equal(back.array(), codes)
    np.testing.assert_array_equal(back.scale_array(), scales)


def test_a_qfloat_tensor_of_the_wrong_length_is_refused_on_read():
    scheme = QFloatScheme("q8s")
    record = ModuleRecord({"w": RecordEntry(1, DType.i8, (3,), np.zeros(3, np.int8), scheme,
                                            np.ones(1, np.float32))})
    pack = BurnpackFile.from_bytes(record.to_bytes())
    from kiln.runtime.records.burnpack import PackTensor
    from kiln.runtime.records.burnpack_io import to_bytes

    bad = to_bytes([PackTensor("w", pack.entries["w"].dtype, (5,), 1, bytes(8))])
    with pytest.raises(RecordError, match="needs 12"):
        ModuleRecord.from_bytes(bad)
