"""softmax(s q kᵀ) v in one hand-scheduled CPU kernel: for each head, kᵀ packed once, then per block of query rows
the scores, their softmax and the context, the block's scores kept in L1.

Unfused, attention ran as five kernels (a pack of kᵀ, the scores product, the softmax rows, a pack of v, the context
product), and the scores went through memory twice each way: [6, 8, 197, 197] f32 is 7.4 MB, past L2. Here a block
of `rows` queries computes its [rows, n] scores in register tiles of `rows` x 2 vectors over kᵀ's columns (kᵀ: d x n,
packed once per head, in L2), takes the softmax of each row in vectors (`softmax_rows.exp_nonpositive`), leaves the
exps unscaled, and multiplies them into v's rows (contiguous as they are: no pack) in register tiles of `rows` x 2
vectors of the context, scaling each row by its sum's reciprocal as it is stored. A tile or row whose vectors do not
divide its extent moves its last vector back to end at the extent (`row_vectors`): those columns are computed twice
and the same value is stored again, so nothing is padded and nothing guarded; the last row block moves back the same
way.

Each operand is [batch, heads, seq, d] or, read through the head split's transpose, [batch, seq, heads, d]
(`Layout`), so a multi-head layer reads q, k and v from its projections and may write the context where the
output projection reads it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as ib

from .cpu import CPUModel
from .row_vectors import RowSplit, across, at, row_vector, splat
from .softmax_rows import exp_nonpositive

KERNEL_NAME = "attention"
TILE_VECTORS = 2  # vectors across a register tile's columns, as the matmul rule's (`schedules/matmul.py`)
TASKS_PER_CORE = 2  # a head's row blocks split into parts until there are this many tasks a core (batch 1, 1 head)


@dataclass(frozen=True)
class Layout:
    """Where an operand's seq axis is: [batch, heads, seq, d] (`seq_first` False) or [batch, seq, heads, d]."""

    seq_first: bool = False

    def dims(self, batch: tirx.PrimExpr, heads: tirx.PrimExpr, seq: int, width: int) -> list[tirx.PrimExpr]:
        return [batch, seq, heads, width] if self.seq_first else [batch, heads, seq, width]

    def index(self, b: tirx.PrimExpr, h: tirx.PrimExpr, s: tirx.PrimExpr, j: tirx.PrimExpr) -> list[tirx.PrimExpr]:
        return [b, s, h, j] if self.seq_first else [b, h, s, j]


@dataclass(frozen=True)
class Attention:
    """One attention's static geometry: `m` queries and `n` keys of width `d`, values of width `dv`, the scores'
    `scale`, and the layouts of q, k, v and the result."""

    m: int
    n: int
    d: int
    dv: int
    scale: float
    layouts: tuple[Layout, Layout, Layout, Layout] = (Layout(), Layout(), Layout(), Layout())

    def block_rows(self, model: CPUModel) -> int:
        """Query rows a block takes: the register tile's rows (`model.accumulators` / `TILE_VECTORS`), evened out
        over the blocks M needs, so the last block repeats as few rows as it can."""
        most = max(1, min(self.m, model.accumulators // TILE_VECTORS))
        blocks = math.ceil(self.m / most)
        return math.ceil(self.m / blocks)

    def stride(self, lanes: int) -> int:
        """Elements a row of packed kᵀ or of the scores takes: n to whole vectors, so every row starts aligned."""
        return math.ceil(self.n / lanes) * lanes

    def fits(self, model: CPUModel) -> bool:
        """Whether packed kᵀ and one block's scores fill at most half of `model`'s L2 (longer keys stay unfused)."""
        return 4 * (self.d + self.block_rows(model)) * self.stride(model.lanes()) <= model.caches.l2 // 2

    def chunk_blocks(self, model: CPUModel) -> int:
        """Row blocks whose scores a task keeps at once: all of them where those and packed kᵀ fill at most half of
        L2, else as many as fit (at least one)."""
        row_bytes = 4 * self.stride(model.lanes())
        fit = (model.caches.l2 // 2 - self.d * row_bytes) // (self.block_rows(model) * row_bytes)
        return max(1, min(math.ceil(self.m / self.block_rows(model)), fit))


@dataclass(frozen=True)
class _Tiles:
    """`count` register tiles of `width` vectors of `step` lanes over `extent` columns, the last moved back."""

    extent: int
    step: int
    width: int

    @classmethod
    def of(cls, extent: int, lanes: int) -> _Tiles:
        step = row_vector(extent, lanes)
        return cls(extent, step, min(TILE_VECTORS, extent // step))

    @property
    def count(self) -> int:
        return math.ceil(self.extent / (self.width * self.step))

    def start(self, tile: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.min(tile * self.width * self.step, self.extent - self.width * self.step)


def _zero(sums: tirx.Buffer, vectors: int, step: int) -> None:
    """Emit the stores zeroing a register tile's `vectors` sums (unrolled), in the kernel being parsed."""
    for i in range(vectors):
        ib.buffer_store(sums, splat(0.0, step), [at(i * step, step)])


def _store(buf: tirx.Buffer, index: list[tirx.PrimExpr], value: tirx.PrimExpr) -> None:
    """Emit `buf[index] = value`, in the kernel being parsed."""
    ib.buffer_store(buf, value, index)


def attention_kernel(spec: Attention, model: CPUModel) -> tirx.PrimFunc:
    """The kernel of `spec` for `model`'s CPU: float32 q, k, v in, the context out, batch and heads symbolic."""
    m, n, d, dv, lanes = spec.m, spec.n, spec.d, spec.dv, model.lanes()
    rows, ns = spec.block_rows(model), spec.stride(lanes)
    blocks, chunk = math.ceil(m / rows), spec.chunk_blocks(model)
    keys, values = _Tiles.of(n, lanes), _Tiles.of(dv, lanes)
    ks, kw, vs, vw = keys.step, keys.width, values.step, values.width
    row = RowSplit.of(n, lanes)
    step, whole, tail = row.step, row.whole, row.tail
    ql, kl, vl, ol = spec.layouts
    most_tasks = TASKS_PER_CORE * model.cores

    @T.prim_func(private=True)
    def attention(q_data: T.handle, k_data: T.handle, v_data: T.handle, out_data: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch, heads = T.int64(), T.int64()
        q = T.match_buffer(q_data, ql.dims(batch, heads, m, d), "float32")
        k = T.match_buffer(k_data, kl.dims(batch, heads, n, d), "float32")
        v = T.match_buffer(v_data, vl.dims(batch, heads, n, dv), "float32")
        out = T.match_buffer(out_data, ol.dims(batch, heads, m, dv), "float32")
        groups = T.bind(batch * heads)
        parts = T.bind(T.max(T.min((most_tasks + groups - 1) // groups, blocks), 1))
        for task in T.parallel(groups * parts):
            g = T.bind(task // parts)
            b, h, part = T.bind(g // heads), T.bind(g % heads), T.bind(task % parts)
            first, last = T.bind(part * blocks // parts), T.bind((part + 1) * blocks // parts)
            kt = T.decl_buffer((d * ns,), "float32", scope="local")
            scores = T.decl_buffer((chunk * rows * ns,), "float32", scope="local")
            sums = T.decl_buffer((rows * TILE_VECTORS * lanes,), "float32", scope="local")
            inverse = T.decl_buffer((chunk * rows,), "float32", scope="local")
            vec = T.decl_buffer((step,), "float32", scope="local")
            for c, j in T.grid(n, d):
                kt[j * ns + c] = k[tuple(kl.index(b, h, c, j))]
            for start in range((last - first + chunk - 1) // chunk):
                b0 = T.bind(first + start * chunk)
                b1 = T.bind(T.min(b0 + chunk, last))
                for tile in range(keys.count):  # a panel of kT (d x kw vectors) stays in L1 over the chunk's blocks
                    c0 = T.bind(keys.start(tile))
                    for block in range(b0, b1):
                        m0 = T.bind(T.min(block * rows, m - rows))
                        at_row = T.bind((block - b0) * rows * ns)
                        _zero(sums, rows * kw, ks)
                        for j in range(d):
                            for r in T.unroll(rows):
                                qv = T.bind(splat(q[tuple(ql.index(b, h, m0 + r, j))], ks))
                                for w in T.unroll(kw):
                                    sums[at((r * kw + w) * ks, ks)] = sums[at((r * kw + w) * ks, ks)] + qv * kt[
                                        at(j * ns + c0 + w * ks, ks)]
                        for r in T.unroll(rows):
                            for w in T.unroll(kw):
                                scores[at(at_row + r * ns + c0 + w * ks, ks)] = sums[
                                    at((r * kw + w) * ks, ks)] * splat(spec.scale, ks)
                for r in range((b1 - b0) * rows):
                    vec[at(0, step)] = scores[at(r * ns + tail, step)]
                    for w in range(whole):
                        vec[at(0, step)] = T.max(vec[at(0, step)], scores[at(r * ns + w * step, step)])
                    top = T.bind(splat(across(vec[at(0, step)], step, tirx.max), step))
                    vec[at(0, step)] = exp_nonpositive(scores[at(r * ns + tail, step)] - top, step)
                    for w in range(whole):
                        scores[at(r * ns + w * step, step)] = exp_nonpositive(
                            scores[at(r * ns + w * step, step)] - top, step)
                    scores[at(r * ns + tail, step)] = vec[at(0, step)]
                    vec[at(0, step)] = row.fresh(vec[at(0, step)])
                    for w in range(whole):
                        vec[at(0, step)] = vec[at(0, step)] + scores[at(r * ns + w * step, step)]
                    inverse[r] = T.float32(1) / across(vec[at(0, step)], step, operator.add)
                for tile in range(values.count):  # a panel of v (n x vw vectors) stays in L1 over the blocks
                    c0 = T.bind(values.start(tile))
                    for block in range(b0, b1):
                        m0 = T.bind(T.min(block * rows, m - rows))
                        at_row = T.bind((block - b0) * rows)
                        _zero(sums, rows * vw, vs)
                        for c in range(n):
                            for r in T.unroll(rows):
                                p = T.bind(splat(scores[(at_row + r) * ns + c], vs))
                                for w in T.unroll(vw):
                                    sums[at((r * vw + w) * vs, vs)] = sums[at((r * vw + w) * vs, vs)] + p * v[
                                        tuple(vl.index(b, h, c, at(c0 + w * vs, vs)))]
                        for r in T.unroll(rows):
                            for w in T.unroll(vw):
                                _store(out, ol.index(b, h, m0 + r, at(c0 + w * vs, vs)),
                                       sums[at((r * vw + w) * vs, vs)] * splat(inverse[at_row + r], vs))
    return attention
