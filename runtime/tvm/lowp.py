"""Precision modes of a CPU build (`kiln.compile(..., precision=...)`): a lowering choice, never a graph rewrite.

`f32` computes as the graph says. `bf16` lowers every f32 matmul and convolution to bf16 operands with f32
accumulation (a bound weight is cast once, by constant folding at build time; activations are cast in front of the
kernel; on a CPU with `vdpbf16ps` convs are left to `conv_regions.py`'s bf16 kernel) and leaves every other op in
f32; on a CPU without AVX512-BF16 it falls back to f32 with one notice, unless asked for as `bf16!` (emulated: the
same kernels, bf16 widened to f32 by shifts). `int8` lowers a matmul whose weight is a Q8 `dequantize` to an int8 x
int8 product accumulated in int32: the activation is quantized per row on the fly (scale max|row| / 127), the codes
are read as stored, and the two scales multiply in the epilogue. Error bounds and the instructions each CPU gets:
docs/precision.md.
"""

from __future__ import annotations

import warnings

from tvm import relax
from tvm.relax import op as R
from tvm.target import Target

from kiln.ir import KilnError, PrecisionWarning

from .activation_products import deferred_product
from .amx import AMX_BF16, amx_matmul, bf16_products
from .conv_bf16 import bf16_convs
from .cpu import cpu_model
from .dot_bf16 import DOT_BF16
from .quant_matmul import decoded_weight
from .rule import OpCall

PRECISIONS = ("f32", "bf16", "bf16!", "int8")
INT8_VALUES = ("q8s", "q8f")  # Burn's 8-bit kinds: codes that fit int8 as stored
INT8_MIN_SEGMENT = 16  # fewer K rows per weight scale than this and int32 sums buy nothing: decode in f32 instead
ACT_LEVELS = 127.0  # an activation row codes symmetrically in [-127, 127]

_noticed: set[str] = set()


def cpu_features(target: Target) -> frozenset[str]:
    """The LLVM features of `target`'s CPU (its `-mcpu` and `-mattr`, from the CPU model); empty for a non-LLVM
    target."""
    return cpu_model(target).features if target.kind.name == "llvm" else frozenset()


def native_bf16(target: Target) -> bool:
    """Whether the target's CPU has bf16 dot products (AVX512-BF16's vdpbf16ps or AMX-BF16 tiles)."""
    return bool({DOT_BF16, AMX_BF16} & cpu_features(target))


def resolve_precision(precision: str, target: Target) -> str:
    """The precision a build lowers with: "f32", "bf16" or "int8" (bf16 without native support falls back to f32
    with one notice; "bf16!" forces emulated bf16); an unknown mode or a non-CPU target is a KilnError."""
    if precision not in PRECISIONS:
        raise KilnError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "f32":
        return precision
    if target.kind.name != "llvm":
        raise KilnError(f"precision {precision!r} is for CPU (llvm) targets, not {target.kind.name}")
    if precision == "bf16" and not native_bf16(target):
        cpu = str(target.attrs.get("mcpu", "")) or "this CPU"
        if cpu not in _noticed:
            _noticed.add(cpu)
            warnings.warn(f"kiln.compile: {cpu} has no AVX512-BF16 or AMX-BF16, so precision='bf16' builds in f32 "
                          "(precision='bf16!' emulates bf16)", PrecisionWarning, stacklevel=4)
        return "f32"
    return precision.rstrip("!")


def _bf16(call: OpCall, i: int) -> relax.Expr:
    return call.emit(R.astype(call.args[i], "bfloat16"))


def bf16_operands(call: OpCall, count: int = 2) -> tuple[list[relax.Expr], str | None]:
    """(the first `count` operands, the output dtype) of a matmul/conv: bf16 operands and "float32" under bf16,
    else the operands as they are and None (the operands' dtype)."""
    if call.precision != "bf16" or any(call.dtype(i) != "float32" for i in range(count)):
        return list(call.args[:count]), None
    return [_bf16(call, i) for i in range(count)], "float32"


def conv_operands(call: OpCall) -> tuple[list[relax.Expr], str | None]:
    """`bf16_operands` of a conv, except in a bf16 build for a CPU with bf16 conv kernels: there the conv stays f32
    for the conv-region pass, which computes the ones its kernel takes in bf16 (`conv_bf16.py`); the rest run
    faster in f32 than with bf16 widened to f32 FMAs."""
    if call.precision == "bf16" and bf16_convs(call.target):
        return list(call.args[:2]), None
    return bf16_operands(call)


def _segment(block: tuple[int, ...], depth: int) -> int:
    """How many consecutive K rows of a [K, N] weight share one scale: all of them per tensor, `block[0]` for a
    2-D block, one for a 1-D block (which runs along N)."""
    return depth if not block else block[0] if len(block) == 2 else 1


def int8_matmul(call: OpCall) -> relax.Expr | None:
    """`x @ W` for a Q8-dequantized [K, N] W under int8 as an int8 product with int32 sums (on VNNI CPUs the
    pipeline's `vnni_matmul` pass computes it with vpdpbusd); None where it does not apply (another precision,
    another kind, a transposed read, a double-quantized scale, short scale segments)."""
    found = decoded_weight(call) if call.precision == "int8" and call.dtype(0) == "float32" else None
    if found is None or found[1] or found[0].attrs["value"] not in INT8_VALUES or len(found[0].args) != 2:
        return None
    dq = found[0]
    codes, scales = dq.args
    depth, n = (int(d) for d in call.types[1].shape)
    block = tuple(dq.attrs["block"])
    segment = _segment(block, depth)
    if segment < INT8_MIN_SEGMENT:
        return None
    *rows, _ = call.shape(0)
    x = call.args[0]
    peak = call.emit(R.max(R.abs(x), axis=-1, keepdims=True))
    one = relax.const(1.0, "float32")
    row_scale = call.emit(R.where(R.greater(peak, relax.const(0.0, "float32")),
                                  R.divide(peak, relax.const(ACT_LEVELS, "float32")), one))
    xq = call.emit(R.astype(R.clip(R.round(R.divide(x, row_scale)), -ACT_LEVELS, ACT_LEVELS), "int8"))
    w_scale = call.emit(R.astype(scales, "float32"))  # [1] per tensor, else [K / segment, N / block[1]]
    if len(block) == 2 and block[1] > 1:
        w_scale = call.emit(R.repeat(w_scale, block[1], axis=1))  # one scale per column
    parts = depth // segment
    if parts == 1:
        acc = call.emit(R.matmul(xq, codes, out_dtype="int32"))
        column = call.emit(R.reshape(w_scale, [n])) if block else w_scale
        return R.multiply(call.emit(R.multiply(R.astype(acc, "float32"), column)), row_scale)
    flat = call.emit(R.permute_dims(R.reshape(xq, [-1, parts, segment]), [1, 0, 2]))
    acc = call.emit(R.matmul(flat, R.reshape(codes, [parts, segment, n]), out_dtype="int32"))
    summed = R.sum(R.multiply(R.astype(acc, "float32"), R.reshape(w_scale, [parts, 1, n])), axis=0)
    return R.multiply(call.emit(R.reshape(summed, [*rows, n])), row_scale)


def lowp_matmul(call: OpCall) -> relax.Expr | None:
    """The matmul of `call` in its build's precision (int8 for Q8 weights; bf16 on the CPU's bf16 product kernel for
    a bound weight; f32 for two activations there, which `activation_products.py` computes in bf16 after attention
    fusion; else bf16 operands), or None for f32."""
    fused = int8_matmul(call)
    if fused is not None or call.precision != "bf16" or decoded_weight(call) is not None:
        return fused
    if bf16_products(call.target):
        tiled = amx_matmul(call)
        if tiled is not None or deferred_product(*call.args[:2]):
            return tiled
    (x, w), out = bf16_operands(call)
    return R.matmul(x, w, out_dtype=out) if out is not None else None
