"""A batched matmul whose left operand is a transpose of its last two axes, lowered as one kernel reading that
operand's source transposed (`C[.., i, j] = sum_k X[.., k, i] * B[.., k, j]`) instead of a transpose kernel and a
matmul: attention's backward (`p^T @ g` for the values, `g^T @ q` for the keys, per head).

Folded, the transposed copy is neither written nor read back, and the transpose's own kernel goes away once nothing
else reads it (dead-code elimination); `CPUMatmul` takes the folded kernel like any matmul, its rows read with
stride 1 down the source's columns. 8x4x128x128^T @ 8x4x128x64 ran 2.9 -> 2.1-2.5 ms (one Zen 3 core, load 5).
Only the left operand folds: a right operand read transposed would put the stride on the vector loop. 2-D weight
gradients (`x^T @ g`) do not fold: read down its columns, a source larger than L2 costs the unpacked dense kernel
more than the transpose it saves (1024x1024^T @ 1024x256: 15.1-16.4 ms unfolded, 17.4-20.2 folded); with packed
A panels (issue 13) the packing could read it transposed instead.
"""

from __future__ import annotations

from tvm import relax, te

from kiln.ir import DType
from kiln.ir.ops.shape import transpose_perm

from .rule import OpCall

_FOLDED = (DType.f32, DType.f64)  # f16/bf16 matmuls keep their own lowering (they compute in f32 and round)


def _swaps_last_two(perm: tuple[int, ...] | None, rank: int) -> bool:
    """Whether a transpose's `perm` exchanges the last two axes and keeps the rest."""
    return transpose_perm(perm, rank) == (*range(rank - 2), rank - 1, rank - 2)


def _tn(x: te.Tensor, b: te.Tensor) -> te.Tensor:
    """`swap(x) @ b` for x [.., K, M] and b [.., K, N] of the same batch dims."""
    k = te.reduce_axis((0, x.shape[-2]), name="k")
    return te.compute((*x.shape[:-2], x.shape[-1], b.shape[-1]),
                      lambda *ix: te.sum(x[(*ix[:-2], k, ix[-2])] * b[(*ix[:-2], k, ix[-1])], axis=k),
                      name="matmul_tn")


def transposed_lhs(call: OpCall) -> relax.Expr | None:
    """`call`'s batched matmul as one kernel reading its left operand's source transposed, when that operand is a
    transpose of the last two axes of a tensor with the other operand's static batch dims; else None."""
    made = call.producer(0, "transpose")
    a, b = call.types[0], call.types[1]
    if made is None or a.dtype not in _FOLDED or a.rank != b.rank or a.rank < 3:
        return None
    if not _swaps_last_two(made.attrs["perm"], a.rank) or None in a.shape[:-2] or a.shape[:-2] != b.shape[:-2]:
        return None  # broadcast or symbolic batch dims keep the matmul's own broadcasting
    return call.bb.call_te(_tn, made.args[0], call.args[1], primfunc_name_hint="matmul_tn")
