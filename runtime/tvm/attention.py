"""softmax(s q kᵀ) v as one hand-scheduled CPU kernel: per head, kᵀ packed once; per chunk of query rows, the
scores panel by panel of kᵀ, each row's softmax, and the context panel by panel of v, the chunk's scores kept in L2.

Unfused, attention ran as five kernels (a pack of kᵀ, the scores product, the softmax rows, a pack of v, the context
product), and the scores went through memory twice each way ([6, 8, 197, 197] f32 is 7.4 MB, past L2). Here each
task packs its head's kᵀ (d x n, rows padded to whole vectors), then for a chunk of row blocks (all of them where
their scores and kᵀ fill at most half of L2, `Attention.chunk_blocks`):
- the scaled scores in register tiles of `rows` x 2 vectors (the matmul rule's tile), one panel of kᵀ's columns at a
  time over all the chunk's blocks, so the panel stays in L1 (a block's tiles over all of kᵀ, 53 KB at 197 keys,
  read it from L2: 125 against 186 GFLOP/s with keys that fit L1);
- each row's maximum, exps and sum in vectors, by the emitters of the softmax kernel (`softmax_rows.row_maximum`,
  `row_exps`), the exps left unscaled, in place;
- the context in tiles of `rows` x 2 vectors over v's rows as they are (contiguous: no pack), one panel of v's
  columns at a time, each row scaled by its sum's reciprocal as it is stored.
A tile, row or block whose vectors do not divide its extent has its last one end at the extent (`row_vectors`), so
nothing is padded or guarded: the columns or rows it shares with the one before are computed twice and the same
value stored again; a last tile takes only the vectors what is left needs.

Each operand is [batch, heads, seq, d] or, read through the head split's transpose, [batch, seq, heads, d], or
through its reshape too, [batch, seq, heads x d] (`Layout`), so a multi-head layer reads q, k and v from its
projections and writes the context where the output projection reads it. Over 6 x 8 heads of 197 x 64 on Zen 4 it
takes 2.6-2.8 ms (175 GFLOP/s) where the unfused kernels took 3.3-3.5 (bench/RESULTS.md, session 31).

A bf16 build's kernel (`Attention.pairs`, on CPUs with 512-bit `vdpbf16ps`) computes both products on bf16 pairs with
f32 sums: kᵀ is packed as words of (j, j + 1) pairs of d, v as words of (c, c + 1) pairs of its rows, each chunk's q
rows as pairs of d, and each row's exps as pairs of n, rounded 32 at a time (`PAIRS_IR`) in the pass that sums them
in f32 (the f32 exps are never stored); the softmax is f32 but for that rounding. Over the same 6 x 8 heads it takes
1.6-1.7 ms (about 290 GFLOP/s; bench/RESULTS.md, session 32).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as ib

from .bf16_layout import N_TILE, PAIR, rounding_ir
from .cpu import CPUModel
from .dot_bf16 import DOT_IR, dot_pairs, has_dot
from .row_vectors import RowSplit, across, at, row_vector, splat, zero_sums
from .schedules.matmul import TILE_VECTORS
from .softmax_rows import ROW_CHAINS, exp_nonpositive, row_exps, row_maximum

KERNEL_NAME = "attention"
TASKS_PER_CORE = 2  # a head's row blocks split into parts until a batch of 1 has this many tasks a core (few heads)
WORDS = N_TILE  # bf16 pairs (one int32 word each) in a 512-bit vector: `vdpbf16ps`'s operand
_WORDS, _ZIP = "kiln_bf16_words", "kiln_bf16_zip"
# linked into a pairs kernel beside `dot_bf16.DOT_IR`: 32 f32 as the 16 words of consecutive pairs (lo ‖ hi: word
# i = element 2i | element 2i + 1 << 16), or of lane-wise ones (word i = a[i] | b[i] << 16: pairs of two rows)
PAIRS_IR = rounding_ir(_WORDS, WORDS, 2, list(range(2 * WORDS))) + \
    rounding_ir(_ZIP, WORDS, 2, [i // 2 + WORDS * (i % 2) for i in range(2 * WORDS)])


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
    pairs: bool = False  # both products in bf16 pairs by `vdpbf16ps` (`takes_pairs`), the softmax in f32

    def takes_pairs(self, model: CPUModel) -> bool:
        """Whether `model`'s CPU has 512-bit `vdpbf16ps` and the pairs kernel takes this geometry: d whole pairs
        of at least one 32-element conversion, and keys and values at least one vector wide."""
        return has_dot(model) and self.d % PAIR == 0 and self.d >= PAIR * WORDS and min(self.n, self.dv) >= WORDS

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
        """Elements a row of packed kᵀ or of the scores takes: n to whole vectors (to whole pairs of vectors in the
        pairs kernel, which rounds the weights 32 at a time), so every row starts aligned."""
        quantum = PAIR * lanes if self.pairs else lanes
        return math.ceil(self.n / quantum) * quantum

    def _fitting_blocks(self, model: CPUModel) -> int:
        """How many row blocks' scores (and in the pairs kernel their weights' pairs) fit beside packed kᵀ (d rows)
        in half of `model`'s L2."""
        stride = self.stride(model.lanes())
        key_bytes, row_bytes = (2 * stride, 6 * stride) if self.pairs else (4 * stride, 4 * stride)
        return (model.caches.l2 // 2 - self.d * key_bytes) // (self.block_rows(model) * row_bytes)

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


Scalar = Callable[[int, tirx.Expr], tirx.Expr]  # (row of the tile, step of the sum) -> its scalar operand
Vector = Callable[[tirx.Expr, int], tirx.Expr]  # (step of the sum, vector of the tile) -> a vector
Store = Callable[[int, int, tirx.Expr], None]  # (row, vector, the sum) -> emits its store


@dataclass(frozen=True)
class _Product:
    """How a register tile's step adds a broadcast scalar times a vector: `spread` broadcasts the scalar to the
    tile's lanes, `add` is the sums plus their product (an f32 FMA, or `vdpbf16ps` over (k, k+1) pairs)."""

    spread: Callable[[tirx.Expr, int], tirx.Expr]
    add: Callable[[tirx.Expr, tirx.Expr, tirx.Expr], tirx.Expr]

    @classmethod
    def of(cls, pairs: bool) -> _Product:
        if pairs:
            return cls(lambda x, lanes: splat(x, lanes, "int32"), dot_pairs)
        return cls(splat, lambda sums, a, b: sums + a * b)


def _tile(sums: tirx.Buffer, shape: tuple[int, int, int], depth: int, left: Scalar, right: Vector,
          store: Store, product: _Product) -> None:
    """Emit one register tile of `shape` (rows, vectors, lanes) in the kernel being parsed: each sum is left(r, i)
    spread times right(i, w) over i < `depth`, then stored by store(r, w, sum)."""
    rows, width, lanes = shape
    zero_sums(sums, rows * width, lanes)
    with T.serial(0, depth) as i:
        for r in range(rows):
            a = product.spread(left(r, i), lanes)
            for w in range(width):
                index = at((r * width + w) * lanes, lanes)
                ib.buffer_store(sums, product.add(sums[index], a, right(i, w)), [index])
    for r in range(rows):
        for w in range(width):
            store(r, w, sums[at((r * width + w) * lanes, lanes)])


def _words(lo: tirx.Expr, hi: tirx.Expr) -> tirx.Expr:
    """16 words of bf16 pairs of consecutive elements from 32 f32 (`lo` then `hi`), in a kernel importing
    `PAIRS_IR`."""
    return T.call_pure_extern("int32x16", _WORDS, lo, hi)


def _zip(a: tirx.Expr, b: tirx.Expr) -> tirx.Expr:
    """16 words of bf16 pairs (a[i], b[i]) of two rows' f32 vectors, in a kernel importing `PAIRS_IR`."""
    return T.call_pure_extern("int32x16", _ZIP, a, b)


def attention_kernel(spec: Attention, model: CPUModel) -> tirx.PrimFunc:
    """The kernel of `spec` for `model`'s CPU: float32 q, k, v in, the context out, the batch symbolic. In the
    pairs kernel, kᵀ, v and each chunk's q are packed as bf16 pairs (kᵀ's along d, v's along n) and each row's
    exps rounded to pairs as they are summed, so both products are `vdpbf16ps` tiles."""
    m, n, d, dv, pairs = spec.m, spec.n, spec.d, spec.dv, spec.pairs
    lanes = WORDS if pairs else model.lanes()
    rows, ns = spec.block_rows(model), spec.stride(lanes)
    blocks, chunk = spec.blocks(model), spec.chunk_blocks(model)
    keys, values = _Tiles.of(n, lanes), _Tiles.of(dv, lanes)
    row = RowSplit.of(n, lanes)
    step, tail = row.step, row.tail
    ql, kl, vl, ol = spec.layouts
    heads, parts = spec.heads, spec.parts(model)
    product = _Product.of(pairs)
    # the reduction steps of each product (pairs of d or of n in the pairs kernel); a row of the weights' pairs
    dq, dn, row_words = (d // PAIR, math.ceil(n / PAIR), ns // PAIR) if pairs else (d, n, ns)
    packed = "int32" if pairs else "float32"  # kᵀ's and (pairs only) q's, the weights' and v's packed elements
    pair_size = chunk * rows * max(dq, row_words) if pairs else 1  # q's and the weights' pairs (pairs only)

    def first_row(block: tirx.PrimExpr) -> tirx.PrimExpr:
        """A row block's first query: the last block moved back to end at m (its rows the one before computed too)."""
        return tirx.min(block * rows, m - rows)

    def pairs_of_d(read: Callable[[int], tirx.Expr]) -> list[tuple[int, tirx.Expr]]:
        """A row of d as (its first word, 16 words of (j, j + 1) pairs) pieces, rounded 32 elements at a time, where
        read(j) loads 16 elements from j (pairs only)."""
        return [(j // PAIR, _words(read(j), read(j + WORDS))) for j in RowSplit(d, PAIR * WORDS).starts]

    def scores_panel(q: tirx.Buffer, qp: tirx.Buffer, kt: tirx.Buffer, mask: tirx.Buffer, scores: tirx.Buffer,
                     sums: tirx.Buffer, place: tuple[tirx.PrimExpr, ...], c0: tirx.PrimExpr, width: int) -> None:
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

        def left(r: int, j: tirx.Expr) -> tirx.Expr:
            return qp[((block - b0) * rows + r) * dq + j] if pairs else q[tuple(ql.index(b, h, m0 + r, j, d))]

        with T.serial(b0, b1) as block:
            m0, base = first_row(block), (block - b0) * rows * ns
            _tile(sums, (rows, width, step), dq, left, lambda j, w: kt[at(j * ns + c0 + w * step, step)],
                  lambda r, w, s: ib.buffer_store(scores, score(r, w, s), [at(base + r * ns + c0 + w * step, step)]),
                  product)

    def context_panel(v: tirx.Buffer, vp: tirx.Buffer, out: tirx.Buffer, weights: tirx.Buffer,
                      inverse: tirx.Buffer, sums: tirx.Buffer, place: tuple[tirx.PrimExpr, ...], c0: tirx.PrimExpr,
                      width: int) -> None:
        """The context's columns [c0, c0 + width vectors) of every block in the chunk (one panel of v, in L1 over
        the blocks), each row scaled by its sum's reciprocal as it is stored."""
        b, h, b0, b1 = place
        step = values.step

        def right(c: tirx.Expr, w: int) -> tirx.Expr:
            return vp[at(c * dv + c0 + w * step, step)] if pairs else \
                v[tuple(vl.index(b, h, c, c0 + w * step, dv, step))]

        with T.serial(b0, b1) as block:
            m0, base = first_row(block), (block - b0) * rows
            _tile(sums, (rows, width, step), dn, lambda r, c: weights[(base + r) * row_words + c], right,
                  lambda r, w, s: ib.buffer_store(out, s * splat(inverse[base + r], step),
                                                  ol.index(b, h, m0 + r, c0 + w * step, dv, step)),
                  product)

    def pack_keys(k: tirx.Buffer, kt: tirx.Buffer, b: tirx.PrimExpr, h: tirx.PrimExpr) -> None:
        """kᵀ as [d, ns] (f32), or as [d / 2, ns] words of (j, j + 1) pairs, each key's row rounded 32 at a time."""
        if not pairs:
            with T.grid(n, d) as (c, j):
                ib.buffer_store(kt, k[tuple(kl.index(b, h, c, j, d))], [j * ns + c])
            return
        with T.serial(0, n) as c:
            for word, words in pairs_of_d(lambda j: k[tuple(kl.index(b, h, c, j, d, WORDS))]):
                ib.buffer_store(kt, words, [tirx.Ramp(word * ns + c, ns, WORDS)])

    def pack_values(v: tirx.Buffer, vp: tirx.Buffer, b: tirx.PrimExpr, h: tirx.PrimExpr) -> None:
        """v as [ceil(n / 2), dv] words of (c, c + 1) pairs of its rows (pairs only; an odd n's last row paired
        with zeros)."""
        def rows_of(c: tirx.Expr, second: bool) -> None:
            for j in RowSplit(dv, WORDS).starts:
                low = v[tuple(vl.index(b, h, PAIR * c, j, dv, WORDS))]
                high = v[tuple(vl.index(b, h, PAIR * c + 1, j, dv, WORDS))] if second else splat(0.0, WORDS)
                ib.buffer_store(vp, _zip(low, high), [at(c * dv + j, WORDS)])

        with T.serial(0, n // PAIR) as c:
            rows_of(c, True)
        if n % PAIR:
            rows_of(tirx.const(n // PAIR, "int32"), False)

    def pack_queries(q: tirx.Buffer, qp: tirx.Buffer, place: tuple[tirx.PrimExpr, ...]) -> None:
        """The chunk's rows of q as [rows, d / 2] words of (j, j + 1) pairs (pairs only)."""
        b, h, b0, b1 = place
        with T.serial(b0, b1) as block:
            for r in range(rows):
                query = first_row(block) + r
                for word, words in pairs_of_d(lambda j, i=query: q[tuple(ql.index(b, h, i, j, d, WORDS))]):
                    ib.buffer_store(qp, words, [at(((block - b0) * rows + r) * dq + word, WORDS)])

    def scores_row(scores: tirx.Buffer, r: tirx.Expr) -> Callable[[tirx.Expr], tirx.Expr]:
        """Row r of the chunk's scores, as its vector from a start."""
        return lambda start: scores[at(r * ns + start, step)]

    def exp_pairs(scores: tirx.Buffer, weights: tirx.Buffer, vec: tirx.Buffer, r: tirx.Expr, top: tirx.Expr
                  ) -> None:
        """Row r's exps as bf16 pairs in `weights` (the columns from n to the stride zeros) and their f32 sum in
        `vec`'s lanes, 32 columns at a time in one pass: the f32 exps are never stored (pairs only)."""
        ib.buffer_store(vec, splat(0.0, WORDS), [at(0, WORDS)])
        for t in range(ns // (PAIR * WORDS)):
            halves = []
            for start in (PAIR * WORDS * t, PAIR * WORDS * t + WORDS):
                value = exp_nonpositive(scores[at(r * ns + start, WORDS)] - top, WORDS)
                if start + WORDS > n:
                    value = tirx.Select(at(start, WORDS) < splat(n, WORDS, "int32"), value, splat(0.0, WORDS))
                halves.append(value)
            ib.buffer_store(vec, vec[at(0, WORDS)] + halves[0] + halves[1], [at(0, WORDS)])
            ib.buffer_store(weights, _words(*halves), [at(r * row_words + t * WORDS, WORDS)])

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
            kt = T.decl_buffer((dq * ns,), packed, scope="local")
            scores = T.decl_buffer((chunk * rows * ns,), "float32", scope="local")
            sums = T.decl_buffer((rows * TILE_VECTORS * lanes,), "float32", scope="local")
            inverse = T.decl_buffer((chunk * rows,), "float32", scope="local")
            vec = T.decl_buffer((ROW_CHAINS * step,), "float32", scope="local")
            # pairs only (one word, never read, in the f32 kernel): q's pairs, then the weights'; v's pairs
            qp = T.decl_buffer((pair_size,), "int32", scope="local")
            vp = T.decl_buffer((dn * dv if pairs else 1,), "int32", scope="local")
            pack_keys(k, kt, b, h)
            if pairs:
                pack_values(v, vp, b, h)
            for start in range((last - first + chunk - 1) // chunk):
                b0 = T.bind(first + start * chunk)
                place = (b, h, b0, T.min(b0 + chunk, last))
                if pairs:
                    pack_queries(q, qp, place)
                for tile in range(keys.full):
                    scores_panel(q, qp, kt, mask, scores, sums, place, tile * keys.width * keys.step, keys.width)
                if keys.tail > 0:
                    scores_panel(q, qp, kt, mask, scores, sums, place, n - keys.tail * keys.step, keys.tail)
                for r in range((place[3] - b0) * rows):
                    top = T.bind(splat(row_maximum(row, vec, scores_row(scores, r)), step))
                    if pairs:
                        exp_pairs(scores, qp, vec, r, top)
                    else:  # in place
                        row_exps(row, vec, scores_row(scores, r), top, scores, r * ns, tail)
                    inverse[r] = T.float32(1) / across(vec[at(0, step)], step, operator.add)
                weights = qp if pairs else scores
                for tile in range(values.full):
                    context_panel(v, vp, out, weights, inverse, sums, place, tile * values.width * values.step,
                                  values.width)
                if values.tail > 0:
                    context_panel(v, vp, out, weights, inverse, sums, place, dv - values.tail * values.step,
                                  values.tail)
    body = tirx.AttrStmt(tirx.const(0, "int32"), "pragma_import_llvm", DOT_IR + PAIRS_IR, attention.body) \
        if pairs else attention.body
    params = [p for i, p in enumerate(attention.params) if i != 3 or spec.mask is not None]  # unread: no mask
    return tirx.PrimFunc(params, body, attention.ret_type, attention.attrs)
