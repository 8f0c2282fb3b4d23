"""Packs and helpers shared by the burnpack format and I/O tests: hand-made CBOR, metadata surgery, re-encoding."""

from __future__ import annotations

import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from kiln.runtime.records.burnpack import BurnDType, IntScalar, UIntScalar
from kiln.runtime.records.burnpack_io import BurnpackFile, to_bytes

FIXTURE = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "burn" / "mnist-model.bpk"

# Burn HEAD's default QuantScheme, as serde would spell it.
DEFAULT_SCHEME = {
    "value": "Q8F",
    "store": {"PackedU32": 0},
    "mode": "Symmetric",
    "tensor": None,
    "block": None,
}


def text(value: str) -> bytes:
    """A short CBOR text string, for hand-made metadata."""
    raw = value.encode()
    assert len(raw) < 24
    return bytes([0x60 + len(raw)]) + raw


def metadata_of(pack: bytes) -> bytes:
    """The CBOR metadata of a pack."""
    (size,) = struct.unpack_from("<I", pack, 6)
    return pack[10 : 10 + size]


def with_metadata(pack: bytes, metadata: bytes) -> bytes:
    """The same pack with its metadata replaced: header size fixed, data section kept after new padding."""
    old_start = -(-(10 + len(metadata_of(pack))) // 256) * 256
    head = pack[:6] + struct.pack("<I", len(metadata)) + metadata
    return head + bytes(-len(head) % 256) + pack[old_start:]


def edit_metadata(pack: bytes, old: bytes, new: bytes) -> bytes:
    """Replace the one occurrence of `old` in the metadata."""
    metadata = metadata_of(pack)
    assert metadata.count(old) == 1, old
    return with_metadata(pack, metadata.replace(old, new))


def read_everything(data: bytes) -> BurnpackFile:
    """Parse a pack and touch every tensor the way a loader would."""
    with BurnpackFile.from_bytes(data) as pack:
        for name, entry in pack.entries.items():
            start, end = entry.data_offsets
            assert len(pack.tensor_bytes(name)) == end - start
            if entry.dtype.kind == "QFloat":
                entry.dtype.scheme_value  # noqa: B018 - decoding is the check
            else:
                assert pack.array(name).shape == entry.shape
    return pack


def rewrite(pack: BurnpackFile) -> bytes:
    """Re-encode a parsed pack with its tensors in file order."""
    ordered = sorted(pack.entries.values(), key=lambda e: e.data_offsets)
    tensors = [(e.name, e.dtype, e.shape, e.param_id, pack.tensor_bytes(e.name)) for e in ordered]
    return to_bytes(tensors, pack.metadata, pack.scalars)


BASE = to_bytes(
    [
        ("a", "F32", [64], 1, np.arange(64, dtype=np.float32)),
        ("b", "F32", [64], 2, np.ones(64, dtype=np.float32)),
    ]
)
RICH = to_bytes(
    [
        ("w", "BF16", [2, 3], 11, np.arange(6).astype(ml_dtypes.bfloat16)),
        ("mask", {"Bool": "Native"}, [3], None, np.array([True, False, True])),
        ("q", BurnDType.qfloat(DEFAULT_SCHEME), [4], 12, bytes(8)),
        ("empty", "I64", [0, 5], None, b""),
        ("u", {"Bool": "U32"}, [1], 13, np.array([1], dtype="<u4")),
    ],
    metadata={"producer": "kiln", "format": "burnpack"},
    scalars={"i": IntScalar(-3), "u": UIntScalar(3), "f": 0.1, "h": 1.5, "b": True},
)
EMPTY = to_bytes([])
SCALAR_S = b"\xa2" + text("tensors") + b"\xa0" + text("scalars") + b"\xa1" + text("s")  # scalar "s" next
