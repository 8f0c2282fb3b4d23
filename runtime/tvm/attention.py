"""softmax(s q kᵀ) v as one hand-scheduled CPU kernel: per head, kᵀ packed once; per chunk of query rows, the
scores panel by panel of kᵀ, each row's softmax, and the context panel by panel of v, the chunk's scores kept in L2.

Unfused, attention ran as five kernels (a pack of kᵀ, the scores product, the softmax rows, a pack of v, the context
product), and the scores went through memory twice each way ([6, 8, 197, 197] f32 is 7.4 MB, past L2). Here each
task packs its head's kᵀ (d x n, rows padded to whole vectors), then for a chunk of row blocks (all of them where
their scores and kᵀ fill at most half of L2, `Attention.chunk_blocks`):
- the scaled scores in register tiles of `rows` x 2 vectors (the matmul rule's tile), one panel of kᵀ's columns at a
  time over all the chunk's blocks, so the panel stays in L1 (a block's tiles over all of kᵀ, 53 KB at 197 keys,
  read it from L2: 125 against 186 GFLOP/s with keys that fit L1);
- each row's maximum, exps and sum in vectors (`softmax_rows.exp_nonpositive`), the exps left unscaled;
- the context in tiles of `rows` x 2 vectors over v's rows as they are (contiguous: no pack), one panel of v's
  columns at a time, each row scaled by its sum's reciprocal as it is stored.
A tile, row or block whose vectors do not divide its extent has its last one end at the extent (`row_vectors`), so
nothing is padded or guarded: the columns or rows it shares with the one before are computed twice and the same
value stored again; a last tile takes only the vectors what is left needs.

Each operand is [batch, heads, seq, d] or, read through the head split's transpose, [batch, seq, heads, d], or
through its reshape too, [batch, seq, heads x d] (`Layout`), so a multi-head layer reads q, k and v from its
projections and writes the context where the output projection reads it. Over 6 x 8 heads of 197 x 64 on Zen 4 it
takes 2.6-2.8 ms (175 GFLOP/s) where the unfused kernels took 3.3-3.5 (bench/RESULTS.md, session 31).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as ib

from .cpu import CPUModel
from .row_vectors import RowSplit, across, at, row_vector, splat, zero_sums
from .schedules.matmul import TILE_VECTORS
from .softmax_rows import exp_nonpositive

KERNEL_NAME = "attention"
TASKS_PER_CORE = 2  # a head's row blocks split into parts until a batch of 1 has this many tasks a core (few heads)


@dataclass(frozen=True)
class Layout:
    """Where an operand's seq axis is: [batch, heads, seq, d] (`seq_first` False) or [batch, seq, heads, d], the
    latter `folded` as [batch, seq, heads x d] (a projection before the head split's reshape)."""

    seq_first: bool = False
    folded: bool = False

    def dims(self, batch: tirx.PrimExpr, heads: int, seq: int, width: int) -> list[tirx.PrimExpr]:
        if self.folded:
            return [batch, seq, heads * width]
        return [batch, seq, heads, width] if self.seq_first else [batch, heads, seq, width]

    def index(self, b: tirx.PrimExpr, h: tirx.PrimExpr, s: tirx.PrimExpr, j: tirx.PrimExpr, width: int,
              lanes: int = 1) -> list[tirx.PrimExpr]:
        """The index of `lanes` elements from element j of (b, h, s) in an operand `width` wide."""
        if self.folded:
            return [b, s, at(h * width + j, lanes)]
        return [b, s, h, at(j, lanes)] if self.seq_first else [b, h, s, at(j, lanes)]


@dataclass(frozen=True)
class Attention:
    """One attention's static geometry: `heads` heads (the batch is symbolic) of `m` queries and `n` keys of width
    `d`, values of width `dv`, the scores' `scale`, the layouts of q, k, v and the result, and where there is an
    additive mask (softmax(s q kᵀ + mask) v, the mask [batch or 1, heads or 1, m or 1, n]) which of its first three
    dims are whole (not 1)."""

    heads: int
    m: int
    n: int
    d: int
    dv: int
    scale: float
    layouts: tuple[Layout, Layout, Layout, Layout] = (Layout(), Layout(), Layout(), Layout())
    mask: tuple[bool, bool, bool] | None = None

    def mask_dims(self, batch: tirx.PrimExpr) -> list[tirx.PrimExpr]:
        """The mask's shape in the kernel (unused where there is none)."""
        whole = self.mask or (False, False, False)
        return [*(dim if full else 1 for dim, full in zip((batch, self.heads, self.m), whole)), self.n]

    def block_rows(self, model: CPUModel) -> int:
        """Query rows a block takes: the register tile's rows (`model.accumulators` / `TILE_VECTORS`), evened out
        over the blocks M needs, so the last block repeats as few rows as it can."""
        most = max(1, min(self.m, model.accumulators // TILE_VECTORS))
        blocks = math.ceil(self.m / most)
        return math.ceil(self.m / blocks)

    def blocks(self, model: CPUModel) -> int:
        """Row blocks of `block_rows` that cover the queries (the last one moved back to end at m)."""
        return math.ceil(self.m / self.block_rows(model))

    def parts(self, model: CPUModel) -> int:
        """Parts a head's row blocks are split into (each a task that packs kᵀ itself): enough for a batch of one
        to give every core `TASKS_PER_CORE` tasks, at most one a block. A static count, so a task finds its head
        and part by dividing by constants (over a symbolic count, TVM's LowerIntrin took 2 of a 3 s build)."""
        return max(1, min(self.blocks(model), math.ceil(TASKS_PER_CORE * model.cores / self.heads)))

    def stride(self, lanes: int) -> int:
        """Elements a row of packed kᵀ or of the scores takes: n to whole vectors, so every row starts aligned."""
        return math.ceil(self.n / lanes) * lanes

    def _fitting_blocks(self, model: CPUModel) -> int:
        """How many row blocks' scores fit beside packed kᵀ (d rows) in half of `model`'s L2."""
        row_bytes = 4 * self.stride(model.lanes())
        return (model.caches.l2 // 2 - self.d * row_bytes) // (self.block_rows(model) * row_bytes)

    def fits(self, model: CPUModel) -> bool:
        """Whether packed kᵀ and one block's scores fill at most half of `model`'s L2 (longer keys stay unfused)."""
        return self._fitting_blocks(model) >= 1

    def chunk_blocks(self, model: CPUModel) -> int:
        """Row blocks whose scores a task keeps at once: all of them where those and packed kᵀ fit half of L2, else
        as many as fit (at least one)."""
        return max(1, min(self.blocks(model), self._fitting_blocks(model)))


@dataclass(frozen=True)
class _Tiles:
    """Register tiles over `extent` columns in vectors of `step` lanes: `full` tiles of `width` vectors from column 0,
    then, where columns are left, one of the `tail` vectors that cover them, ending at the extent (it overlaps the
    tile before it where its vectors do not divide what is left)."""

    extent: int
    step: int
    width: int

    @classmethod
    def of(cls, extent: int, lanes: int) -> _Tiles:
        step = row_vector(extent, lanes)
        return cls(extent, step, min(TILE_VECTORS, extent // step))

    @property
    def full(self) -> int:
        return self.extent // (self.width * self.step)

    @property
    def tail(self) -> int:
        return math.ceil((self.extent - self.full * self.width * self.step) / self.step)


Scalar = Callable[[int, tirx.Expr], tirx.Expr]  # (row of the tile, step of the sum) -> a float32
Vector = Callable[[tirx.Expr, int], tirx.Expr]  # (step of the sum, vector of the tile) -> a vector
Store = Callable[[int, int, tirx.Expr], None]  # (row, vector, the sum) -> emits its store


def _tile(sums: tirx.Buffer, shape: tuple[int, int, int], depth: int, left: Scalar, right: Vector,
          store: Store) -> None:
    """Emit one register tile of `shape` (rows, vectors, lanes) in the kernel being parsed: each sum is left(r, i)
    broadcast times right(i, w) over i < `depth`, then stored by store(r, w, sum)."""
    rows, width, lanes = shape
    zero_sums(sums, rows * width, lanes)
    with T.serial(0, depth) as i:
        for r in range(rows):
            a = splat(left(r, i), lanes)
            for w in range(width):
                index = at((r * width + w) * lanes, lanes)
                ib.buffer_store(sums, sums[index] + a * right(i, w), [index])
    for r in range(rows):
        for w in range(width):
            store(r, w, sums[at((r * width + w) * lanes, lanes)])


def attention_kernel(spec: Attention, model: CPUModel) -> tirx.PrimFunc:
    """The kernel of `spec` for `model`'s CPU: float32 q, k, v in, the context out, the batch symbolic."""
    m, n, d, dv, lanes = spec.m, spec.n, spec.d, spec.dv, model.lanes()
    rows, ns = spec.block_rows(model), spec.stride(lanes)
    blocks, chunk = spec.blocks(model), spec.chunk_blocks(model)
    keys, values = _Tiles.of(n, lanes), _Tiles.of(dv, lanes)
    row = RowSplit.of(n, lanes)
    step, whole, tail = row.step, row.whole, row.tail
    ql, kl, vl, ol = spec.layouts
    heads, parts = spec.heads, spec.parts(model)

    def scores_panel(q: tirx.Buffer, kt: tirx.Buffer, mask: tirx.Buffer, scores: tirx.Buffer, sums: tirx.Buffer,
                     place: tuple[tirx.PrimExpr, ...], c0: tirx.PrimExpr, width: int) -> None:
        """The scale times q kᵀ (plus the mask) over columns [c0, c0 + width vectors) of every block in the chunk
        (one panel of kᵀ, kept in L1 over the blocks)."""
        b, h, b0, b1 = place
        step = keys.step

        def score(r: int, w: int, s: tirx.Expr) -> tirx.Expr:
            scaled = s * splat(spec.scale, step)
            if spec.mask is None:
                return scaled
            at_mask = [i if full else 0 for i, full in zip((b, h, m0 + r), spec.mask)]
            return scaled + mask[(*at_mask, at(c0 + w * step, step))]

        with T.serial(b0, b1) as block:
            m0, base = tirx.min(block * rows, m - rows), (block - b0) * rows * ns
            _tile(sums, (rows, width, step), d,
                  lambda r, j: q[tuple(ql.index(b, h, m0 + r, j, d))],
                  lambda j, w: kt[at(j * ns + c0 + w * step, step)],
                  lambda r, w, s: ib.buffer_store(scores, score(r, w, s), [at(base + r * ns + c0 + w * step, step)]))

    def context_panel(v: tirx.Buffer, out: tirx.Buffer, scores: tirx.Buffer, inverse: tirx.Buffer,
                      sums: tirx.Buffer, place: tuple[tirx.PrimExpr, ...], c0: tirx.PrimExpr, width: int) -> None:
        """The context's columns [c0, c0 + width vectors) of every block in the chunk (one panel of v, in L1 over
        the blocks), each row scaled by its sum's reciprocal as it is stored."""
        b, h, b0, b1 = place
        with T.serial(b0, b1) as block:
            m0, base = tirx.min(block * rows, m - rows), (block - b0) * rows
            _tile(sums, (rows, width, values.step), n,
                  lambda r, c: scores[(base + r) * ns + c],
                  lambda c, w: v[tuple(vl.index(b, h, c, c0 + w * values.step, dv, values.step))],
                  lambda r, w, s: ib.buffer_store(out, s * splat(inverse[base + r], values.step),
                                                  ol.index(b, h, m0 + r, c0 + w * values.step, dv, values.step)))

    @T.prim_func(private=True)
    def attention(q_data: T.handle, k_data: T.handle, v_data: T.handle, mask_data: T.handle, out_data: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch = T.int64()
        q = T.match_buffer(q_data, ql.dims(batch, heads, m, d), "float32")
        k = T.match_buffer(k_data, kl.dims(batch, heads, n, d), "float32")
        v = T.match_buffer(v_data, vl.dims(batch, heads, n, dv), "float32")
        mask = T.match_buffer(mask_data, spec.mask_dims(batch), "float32")
        out = T.match_buffer(out_data, ol.dims(batch, heads, m, dv), "float32")
        for task in T.parallel(batch * heads * parts):
            g = T.bind(task // parts)
            b, h, part = T.bind(g // heads), T.bind(g % heads), T.bind(task % parts)
            first, last = T.bind(part * blocks // parts), T.bind((part + 1) * blocks // parts)
            kt = T.decl_buffer((d * ns,), "float32", scope="local")
            scores = T.decl_buffer((chunk * rows * ns,), "float32", scope="local")
            sums = T.decl_buffer((rows * TILE_VECTORS * lanes,), "float32", scope="local")
            inverse = T.decl_buffer((chunk * rows,), "float32", scope="local")
            vec = T.decl_buffer((step,), "float32", scope="local")
            for c, j in T.grid(n, d):
                kt[j * ns + c] = k[tuple(kl.index(b, h, c, j, d))]
            for start in range((last - first + chunk - 1) // chunk):
                b0 = T.bind(first + start * chunk)
                place = (b, h, b0, T.min(b0 + chunk, last))
                for tile in range(keys.full):
                    scores_panel(q, kt, mask, scores, sums, place, tile * keys.width * keys.step, keys.width)
                if keys.tail > 0:
                    scores_panel(q, kt, mask, scores, sums, place, n - keys.tail * keys.step, keys.tail)
                for r in range((place[3] - b0) * rows):
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
                for tile in range(values.full):
                    context_panel(v, out, scores, inverse, sums, place, tile * values.width * values.step,
                                  values.width)
                if values.tail > 0:
                    context_panel(v, out, scores, inverse, sums, place, dv - values.tail * values.step, values.tail)
    if spec.mask is not None:
        return attention
    unmasked = [p for i, p in enumerate(attention.params) if i != 3]  # its body never reads the mask
    return tirx.PrimFunc(unmasked, attention.body, attention.ret_type, attention.attrs)
