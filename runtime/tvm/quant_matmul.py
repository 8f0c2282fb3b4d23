"""A matmul whose weight is a `dequantize` (or its transpose, as in `dy @ W^T`) lowers to ONE kernel that decodes
codes and scales where it multiplies, through `quant_ops.decoder`, so no float copy of the weight is ever stored.

The plain dequantize the driver emitted is then unused and removed by dead-code elimination in the pipeline.
"""

from __future__ import annotations

from tvm import relax, te, tirx
from tvm.relax import op as R

from kiln.ir.ops.shape import transpose_perm

from .quant_ops import decoder
from .rule import OpCall


def decoded_weight(call: OpCall) -> tuple[OpCall, bool] | None:
    """(the dequantize call behind operand 1, whether it is read transposed), or None if operand 1 is no 2-D one."""
    if call.types[1].rank != 2:
        return None
    found = call.producer(1, "dequantize")
    if found is not None:
        return found, False
    flipped = call.producer(1, "transpose")
    found = flipped.producer(0, "dequantize") if flipped is not None else None
    return (found, True) if found is not None and transpose_perm(flipped.attrs["perm"], 2) == (1, 0) else None


def quant_matmul(call: OpCall) -> relax.Expr | None:
    """`x @ W` for x of rank >= 2 and a dequantized 2-D W, decoding W inside the matmul kernel; None otherwise.

    `x @ W^T` (the backward's `dy @ W^T`) is computed as `(W @ x^T)^T` over x's rows flattened: W's rows then stream
    as the broadcast operand and the small activation is the vector one, the register-blocked form `CPUMatmul`
    schedules (read as `x @ W^T` directly, neither operand has unit stride along the output columns).
    """
    found = decoded_weight(call)
    if found is None or call.types[0].rank < 2:
        return None
    dq, transposed = found
    dec = decoder(dq)
    x, n = call.args[0], call.shape(1)[1]
    if not transposed:
        def compute(xs: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
            *rows, depth = xs.shape
            k = te.reduce_axis((0, depth), "k")
            return te.compute([*rows, n], lambda *i: te.sum(
                xs[(*i[:-1], k)] * dec.element(tensors, (k, i[-1])).astype(xs.dtype), axis=k), name="matmul")

        return call.bb.call_te(compute, x, *dec.operands, primfunc_name_hint="dequantize_matmul")

    def flipped(xt: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
        depth, m = xt.shape
        k = te.reduce_axis((0, depth), "k")
        return te.compute([n, m], lambda j, i: te.sum(
            dec.element(tensors, (j, k)).astype(xt.dtype) * xt[k, i], axis=k), name="matmul")

    *rows, depth = call.shape(0)
    count = tirx.const(1, "int64")
    for d in rows:
        count = count * d
    xt = call.emit(R.permute_dims(call.emit(R.reshape(x, [count, depth])), [1, 0]))
    out = call.bb.call_te(flipped, xt, *dec.operands, primfunc_name_hint="dequantize_matmul_t")
    return R.reshape(call.emit(R.permute_dims(out, [1, 0])), [*rows, n])
