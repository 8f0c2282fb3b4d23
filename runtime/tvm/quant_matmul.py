"""A matmul whose weight is a `dequantize` (or its transpose, as in `dy @ W^T`) lowers to ONE kernel that decodes
codes and scales where it multiplies, through `quant_ops.decoder`, so no float copy of the weight is ever stored.

The plain dequantize the driver emitted is then unused and removed by dead-code elimination in the pipeline.
"""

from __future__ import annotations

from tvm import relax, te

from .quant_ops import decoder
from .rule import OpCall


def _decoded_weight(call: OpCall) -> tuple[OpCall, bool] | None:
    """(the dequantize call behind operand 1, whether it is read transposed), or None if operand 1 is no 2-D one."""
    if call.types[1].rank != 2:
        return None
    found = call.producer(1, "dequantize")
    if found is not None:
        return found, False
    flipped = call.producer(1, "transpose")
    found = flipped.producer(0, "dequantize") if flipped is not None else None
    return (found, True) if found is not None and tuple(flipped.attrs["perm"] or (1, 0)) == (1, 0) else None


def quant_matmul(call: OpCall) -> relax.Expr | None:
    """`x @ W` for x of rank >= 2 and a dequantized 2-D W, decoding W inside the matmul kernel; None otherwise."""
    found = _decoded_weight(call)
    if found is None or call.types[0].rank < 2:
        return None
    dq, transposed = found
    decode = decoder(dq)
    n = call.shape(1)[1]

    def compute(x: te.Tensor, *tensors: te.Tensor) -> te.Tensor:
        *rows, depth = x.shape
        k = te.reduce_axis((0, depth), "k")

        def element(*i):
            w = decode(tensors, (i[-1], k) if transposed else (k, i[-1]))
            return te.sum(x[(*i[:-1], k)] * w.astype(x.dtype), axis=k)

        return te.compute([*rows, n], element, name="matmul")

    return call.bb.call_te(compute, call.args[0], *dq.args, primfunc_name_hint="dequantize_matmul")
