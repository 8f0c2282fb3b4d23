"""Matmul weights in the panel order `CPUMatmul`'s register tile reads: a `[K, N]` weight stored `[N / w, K, w]`
(w: the rule's vector tile for the shape), so one tile's k steps read one contiguous stream instead of one row of
stride N per step, and the rule's tile rows come from the register file (`CPUMatmul.packed_rows`).

A weight that is a constant (`params="bound"`) is packed in numpy at build time; any other 2-D right operand
(`params="inputs"`, a training step's weights) by a kernel of the program, where the rows amortize its copy
(`packs_operand`), and so is a batched one with the same batch dims (attention's keys and values, per head): its
packing kernel fuses into the head-split transpose that produces it, so the panels cost no extra pass (the
12x128x64x128 scores 0.405 -> 0.373 ms, 12x128x128x64 0.317 -> 0.304 on a Zen 3 core).
A right operand that is the transpose of a run-time weight larger than the activations (the backward's
`dy @ W^T` of a batch-1 encoder) is not packed: the product is computed as `(W @ dy^T)^T` (`flip_pays`), so the
small activation is packed and the weight's rows stream in place, and the weight is not copied every step.
A Relax rewrite before legalization, like the conv layout (`conv_regions.py`): it needs the target.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .cpu import CPUModel, cpu_model
from .relax_rewrite import batched_f32_shape, permute_axes, rewrite_functions, static_f32_shape, swaps_last_two
from .schedules.matmul import CPUMatmul

PACKED_NAME = "matmul_packed"  # the PrimFunc name hint of a matmul reading a packed weight
_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")


def panel_width(rule: CPUMatmul, rows: int | None, n: int, batch: int = 1) -> int | None:
    """Columns of one panel of an `n`-column weight multiplied by `rows` rows (C's innermost row extent, in `batch`
    matrices), or None when it stays `[K, N]`: the tile width `rule` (sized `for_cpu`) takes for the rows, or `n`
    rounded up to whole vectors when narrower (a width no panel divides, 10, 77 or 1000, is zero-padded to whole
    panels: no tile has a ragged vector or a predicated tail, where `[K, N]` would take a divisor such as 8 of
    1000); a weight that is already one panel (16 columns on AVX2) stays as it is.

    Rows that one register tile takes leave the panels (times the batch) as the only parallel tasks, so where there
    are several the tile is narrowed as far as that evens out the columns each core computes, keeping
    `latency_sums` sums in flight: a 1 x 768 x 768 call on 2 cores took 33.5 us in three 256-column panels, 24-26 in
    four of 192 (Zen 4). One panel stays one: split in two, a 1 x 64 x 256 call woke the second thread and took
    8.4 us against 4.6-7.0."""
    lanes = rule.lanes or 1
    vectors = min(rule.tile_width(rows), -(-n // lanes) * lanes) // lanes
    if rows is not None and 0 < rows < rule.mr and rule.cores and batch * -(-n // (vectors * lanes)) > 1:
        fewest = min(vectors, -(-rule.latency_sums // rows))

        def per_core(count: int) -> int:  # vectors of columns the busiest core computes, in panels of `count`
            return -(-batch * -(-n // (count * lanes)) // rule.cores) * count

        vectors = min(range(fewest, vectors + 1), key=lambda count: (per_core(count), -count))
    width = vectors * lanes
    return None if width == n else width


def packs_operand(model: CPUModel, rows: int) -> bool:
    """Whether a weight computed at run time is worth a packing kernel under `rows` rows of activations (batch dims
    included): its copy moves each element once, about one vector store per `lanes` elements, while the matmul
    spends `rows / fma_units` FMA cycles on each of those vectors; with at least `lanes x fma_units` rows the copy
    is at most 1 / lanes of the matmul (under 4% on AVX2). A GEMV (batch 1) never pays for it."""
    return rows >= model.lanes() * model.fma_units


def flip_pays(rows: int, k: int, n: int) -> bool:
    """Whether `x @ W^T` (x: `rows x n`, W: `k x n`, known only at run time) is cheaper as `(W @ x^T)^T`: packing
    `W^T` copies `k x n` elements, read down the weight's columns, while the flip copies x into panels and its
    `rows x k` result back, `rows x (n + k)` elements; the matmul's FLOPs are the same. (A flip of a flip never
    pays: both inequalities together would need `rows x k < 0`.)"""
    return rows * (n + k) < k * n


def padded_columns(n: int, width: int) -> int:
    """The columns of a weight of `n` packed in panels of `width`: whole panels, zeros past `n`."""
    return -(-n // width) * width


def pack_weight(w: np.ndarray, width: int) -> np.ndarray:
    """`[K, N]` as `[ceil(N / width), K, width]`, zero past N."""
    k, n = w.shape
    padded = np.zeros((k, padded_columns(n, width)), w.dtype)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, -1, width).transpose(1, 0, 2))


def pack_te(w: te.Tensor, width: int) -> te.Tensor:
    """`pack_weight` as a kernel, for a weight known only at run time; a batched right operand `[.., K, N]` (the
    keys and values of attention) is packed batch by batch, `[.., N / width, K, width]`. The column is clamped, so
    every load is in bounds and the zero padding is a select: TVM vectorizes an `if_then_else` as one branch per
    lane (attention's xᵀ over 197 tokens packed in 0.2-0.37 ms against 0.07-0.18 as a select)."""
    *batch, k, n = (int(d) for d in w.shape)
    return te.compute((*batch, padded_columns(n, width) // width, k, width), lambda *i: tirx.Select(
        i[-3] * width + i[-1] < n, w[(*i[:-3], i[-2], tirx.min(i[-3] * width + i[-1], n - 1))],
        tirx.const(0, w.dtype)), name="pack")


def packed_matmul(x: te.Tensor, wp: te.Tensor, n: int, rows: int | None = None) -> te.Tensor:
    """`x @ w` with `w` packed: `[.., M, K] x [.., N / w, K, w] -> [.., M, N]` (`wp` 3-D: one weight for every
    batch; else batch dims equal to `x`'s); the panel index `j % w` is what `CPUMatmul` recognizes as a packed
    operand, taking `w` as its vector tile. With padded panels the sums cover every panel column, and with `rows`
    past M (`CPUMatmul.padded_rows`) that many rows, the last row of x read again; a second block keeps the first
    M x `n`: the rule computes it at the register tile, whose store alone is guarded."""
    *_, panels, k, width = (int(d) for d in wp.shape)
    batched = len(wp.shape) > 3
    m = x.shape[-2]
    rows = m if rows is None else rows
    r = te.reduce_axis((0, k), "k")

    def row(i: tirx.Expr) -> tirx.Expr:
        return i if rows == m else tirx.min(i, m - 1)

    sums = te.compute((*x.shape[:-2], rows, panels * width), lambda *i: te.sum(
        x[(*i[:-2], row(i[-2]), r)] * wp[(*(i[:-2] if batched else ()), i[-1] // width, r, i[-1] % width)], axis=r),
        name="matmul_packed")
    if panels * width == n and rows == m:
        return sums
    return te.compute((*x.shape[:-1], n), lambda *i: sums(*i), name="matmul_columns")


@mutator
class _Packer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, model: CPUModel) -> None:
        super().__init__(mod)
        self.model, self.rule = model, CPUMatmul().for_cpu(model)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _MATMUL:
            return call
        x, w = call.args
        x_shape, w_shape = batched_f32_shape(x.ty), static_f32_shape(w.ty)
        if x_shape is None or w_shape is None or len(x_shape) < 2 or len(w_shape) < 2:
            return call
        batched, rows = len(w_shape) > 2, x_shape[-2]
        dynamic = not isinstance(x_shape[0], int)  # a dynamic batch: only a constant weight is packed, at build time
        if not batched and not dynamic and self._single_rows(x_shape, w_shape):
            flat = self.builder_.emit(relax.op.reshape(x, (math.prod(x_shape[:-1]), x_shape[-1])))
            product = self.builder_.emit(self.visit_call_(self.builder_.normalize(relax.op.matmul(flat, w))))
            return relax.op.reshape(product, (*x_shape[:-1], w_shape[-1]))
        if batched and (dynamic or tuple(x_shape[:-2]) != tuple(w_shape[:-2])):  # broadcasting batch dims stay
            return call
        width = panel_width(self.rule, rows if isinstance(rows, int) else None, w_shape[-1],
                            math.prod(x_shape[:-2]) if all(isinstance(d, int) for d in x_shape[:-2]) else 1)
        if width is None:
            return call
        constant = None if batched else self._constant(w)
        if constant is not None:
            wp: relax.Expr = relax.const(pack_weight(constant, width))
        elif not dynamic and packs_operand(self.model, rows if batched else math.prod(x_shape[:-1])):
            source = None if batched else self._transposed(w)
            if source is not None and flip_pays(math.prod(x_shape[:-1]), *w_shape[::-1]):
                return self._flipped(x, source, x_shape)
            wp = self.builder_.emit(self.builder_.call_te(pack_te, w, width, primfunc_name_hint="pack_matmul_weight"))
        else:
            return call
        padded = self.rule.padded_rows(rows, width) if isinstance(rows, int) else None
        return self.builder_.call_te(packed_matmul, x, wp, w_shape[-1], padded, primfunc_name_hint=PACKED_NAME)

    def _single_rows(self, x_shape: list[int], w_shape: list[int]) -> bool:
        """Whether `x` is a batch of single rows (`[.., B, 1, K]`: a decoder's step, a batch of pooled features) against
        a weight larger than L2, computed as one product of B rows: as B one-row products each task streamed its
        panel from L3 once per row (2 x 1 x 384 -> 768 took 21 us, as 2 x 384 -> 768 14; 16 x 1 x 768 -> 768 189
        and 93, Zen 4). A weight that L2 holds is cheap to read again, and there the reshapes cost more (3 x 1 x 1024
        -> 77: 8.4 -> 9.0 us)."""
        return len(x_shape) > 2 and x_shape[-2] == 1 and math.prod(x_shape[:-2]) > 1 \
            and math.prod(w_shape) * 4 > self.model.caches.l2

    def _transpose_of(self, w: relax.Expr) -> relax.Expr | None:
        """The 2-D tensor whose transpose `w` is bound to (`permute_dims` of its two axes), else None."""
        made = self.lookup_binding(w) if isinstance(w, relax.Var) else None
        if not (isinstance(made, relax.Call) and made.op == _PERMUTE):
            return None
        return made.args[0] if swaps_last_two(permute_axes(made), 2) else None

    def _constant(self, w: relax.Expr) -> np.ndarray | None:
        """The value of a constant weight, or of a transpose of one (ONNX's Gemm with `transB`: torch exports its
        Linear layers so), else None."""
        source = self._transpose_of(w)
        if isinstance(source, tvm.ir.Constant):
            return source.value.numpy().T
        return w.value.numpy() if isinstance(w, tvm.ir.Constant) else None

    def _transposed(self, w: relax.Expr) -> relax.Expr | None:
        """The 2-D run-time tensor whose transpose `w` is, else None (a constant's transpose packs at build time)."""
        source = self._transpose_of(w)
        return None if isinstance(source, tvm.ir.Constant) else source

    def _flipped(self, x: relax.Expr, w: relax.Expr, x_shape: list[int]) -> relax.Expr:
        """`x @ w^T` as `(w @ x^T)^T` over x's rows flattened, the inner product packed (or not) by the same rule."""
        *rows, n = x_shape
        flat = x if len(rows) == 1 else self.builder_.emit(relax.op.reshape(x, (math.prod(rows), n)))
        inner = self.builder_.normalize(relax.op.matmul(w, self.builder_.emit(relax.op.permute_dims(flat))))
        product = relax.op.permute_dims(self.builder_.emit(self.visit_call_(inner)))
        k = static_f32_shape(w.ty)[0]
        return product if len(rows) == 1 else relax.op.reshape(self.builder_.emit(product), (*rows, k))


def pack_matmul_weights(target: Target) -> tvm.transform.Pass:
    """The module pass computing every float32 `x @ w` with a 2-D `w` that `panel_width` packs for `target`'s CPU
    from the packed weight: packed at build time when `w` is a constant (`x` may have a dynamic batch), by a kernel
    where `packs_operand` (static shapes only)."""
    model = cpu_model(target)

    @tvm.transform.module_pass(opt_level=0, name="KilnPackMatmulWeights")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _Packer(mod, model))

    return _pass
