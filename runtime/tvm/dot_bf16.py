"""bf16 products on AVX512-BF16 CPUs without AMX (Zen 4, Cooper Lake): `vdpbf16ps` register tiles over the same
operands as the AMX kernel (`amx.py`: A bf16 [batch, Mp, Kp], B packed [batch or 1, Np/16, Kp/2, 16] bf16 pairs, C
f32 [batch, Mp, Np]), so the casts, packs, paddings and epilogues in front of and behind it are AMX's.

`vdpbf16ps` adds to each of 16 f32 sums the two products of one (k, k+1) pair: B's packed row of 16 pairs is one
512-bit load, A's pair one 32-bit broadcast. A register tile of `rows` x `width` vectors of sums walks all of K
(`dot_tile` takes the shape with the fewest loads per instruction that fits the register file beside the B vectors
and the broadcast); each parallel task is one panel of `width` vectors over one of M's even chunks, whose A fills at
most half of L2, chunks outermost, so consecutive tasks of a thread reuse the chunk, and the panel's B (Kp x 128
bytes) streams from L2 for each row tile.

TVM 0.27 widens every bf16 expression to f32 (`BF16ComputeLegalize`) and its LLVM code generator has no bf16
vector type, so the instruction cannot take bf16 operands from TIR: the kernel calls `kiln_dpbf16ps`, three lines of
LLVM IR linked into the kernel's module (`pragma_import_llvm`) that bit cast int32 vectors to `<32 x bfloat>` and
call the intrinsic; LLVM inlines it.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .bf16_layout import N_TILE, PAIR, TILE_PARAMS, Epilogue, even_chunks, result_params, store_epilogue, task_place
from .cpu import CPUModel
from .row_vectors import zero_sums

DOT_KERNEL_NAME = "bf16_dot_matmul"
DOT_BF16 = "avx512bf16"  # LLVM's feature name of vdpbf16ps
_DOT = "kiln_dpbf16ps"
# linked into a kernel by `T.attr(0, "pragma_import_llvm", DOT_IR)` around its body
DOT_IR = f"""
define linkonce_odr <16 x float> @{_DOT}(<16 x float> %sums, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %sums, <32 x bfloat> %x, <32 x bfloat> %y)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


def dot_pairs(sums: tirx.PrimExpr, pair: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """`vdpbf16ps`: 16 f32 `sums` plus the products of the broadcast bf16 `pair` (int32x16) and `b`'s 16 pairs
    (uint32x16), for a kernel whose body is wrapped in `DOT_IR`'s import."""
    return T.call_pure_extern("float32x16", _DOT, sums, pair, T.reinterpret(b, dtype="int32x16"))


def has_dot(model: CPUModel) -> bool:
    """Whether the CPU has 512-bit `vdpbf16ps` (AVX512-BF16 on AVX-512 vectors)."""
    return DOT_BF16 in model.features and model.vector_bits == 512


def dot_tile(rows: int | None, groups: int, registers: int) -> tuple[int, int]:
    """(rows, vectors) of the register tile over `groups` 16-column vectors of B: each step loads one broadcast per
    row and one vector per column group for rows x vectors instructions, so of the tiles whose sums, B vectors and
    broadcast fit `registers` (the vectors a divisor of `groups`, the rows at most `rows` where it is given) the
    one with the fewest loads per instruction; ties go to more rows."""
    shapes = []
    for width in (w for w in range(1, groups + 1) if groups % w == 0):
        tall = (registers - width - 1) // width
        if tall < 1:
            break
        tall = tall if rows is None else min(tall, rows)
        shapes.append(((tall + width) / (tall * width), -tall, width))
    _, tall, width = min(shapes)
    return -tall, width


def dot_kernel(rows: int, kp: int, np_: int, shared_b: bool, cores: int, l2_bytes: int, registers: int,
               epilogue: Epilogue | None = None) -> tirx.PrimFunc:
    """The `vdpbf16ps` kernel over padded operands A [batch, Mp, kp] bf16, packed B [batch (1 if `shared_b`),
    np_/16, kp/2, 16] bf16 pairs (uint32) and C [batch, Mp, np_] f32 (`amx.padded`: Mp is M; `rows` is M where it
    is known, the most rows a register tile may take, else 0), with `registers` vector registers; an `epilogue`
    computes from each sum as it is stored instead of C. `TILE_PARAMS` records the arguments, so a pass can rebuild
    the kernel with an epilogue."""
    groups = np_ // N_TILE
    tall, width = dot_tile(rows or None, groups, registers)
    panels, pairs, lanes = groups // width, kp // PAIR, N_TILE
    b_step = 0 if shared_b else 1
    chunk = max(1, l2_bytes // 2 // (kp * 2 * tall))  # row tiles of A in half of L2
    geometry = [rows, kp, np_, int(shared_b), cores, l2_bytes, registers]

    def row(m0: tirx.PrimExpr, r: int, mp: tirx.PrimExpr) -> tirx.PrimExpr:
        """Row `r` of the tile at `m0`, clamped to M's last where M is not known (it may be shorter than the tile)."""
        return m0 + r if rows else T.min(m0 + r, mp - 1)

    @T.prim_func(private=True)
    def kernel(a_data: T.handle, w_data: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, TILE_PARAMS: geometry})
        batch, mp, wbatch = T.int64(), T.int64(), T.int64()
        a = T.match_buffer(a_data, (batch, mp, kp), "bfloat16")
        w = T.match_buffer(w_data, (wbatch, groups, pairs, lanes), "uint32")
        c = result_params(epilogue, batch, mp, np_)
        with T.attr(0, "pragma_import_llvm", DOT_IR):
            a_pairs = T.decl_buffer((batch, mp, pairs), "uint32", data=a.data)  # A's (k, k+1) pairs as one word
            mblocks = (mp + tall - 1) // tall
            chunks = T.bind(even_chunks(mblocks, chunk, cores, batch * panels))
            for task in T.parallel(chunks * batch * panels):
                nb, bb, first, last = task_place(task, panels, batch, mblocks, chunks)
                sums = T.decl_buffer((tall * width * lanes,), "float32", scope="local")
                for tile in range(first, last):
                    # the last tile moves back to end at row mp, and in M shorter than the tile (a symbolic M at
                    # run time) its rows past M repeat M's last: either way some rows are computed twice and store
                    # the same values again (`donation.py` never aliases a result to an input of a kernel without
                    # blocks), so M needs no padding and the tile no guard
                    m0 = T.bind(T.max(T.min(tile * tall, mp - tall), 0))
                    zero_sums(sums, tall * width, N_TILE)
                    for q in range(pairs):
                        for r in T.unroll(tall):
                            pair = T.bind(T.reinterpret(T.broadcast(a_pairs[bb, row(m0, r, mp), q], lanes),
                                                        dtype="int32x16"))
                            for g in T.unroll(width):
                                at = T.bind((r * width + g) * lanes)
                                sums[T.ramp(at, 1, lanes)] = dot_pairs(
                                    sums[T.ramp(at, 1, lanes)], pair,
                                    w.vload([bb * b_step, nb * width + g, q, 0], "uint32x16"))
                    for r in T.unroll(tall):
                        for g in T.unroll(width):
                            at = T.bind((r * width + g) * lanes)
                            col = T.bind((nb * width + g) * lanes)
                            if epilogue is None:
                                c[bb, row(m0, r, mp), T.ramp(col, 1, lanes)] = sums[T.ramp(at, 1, lanes)]
                            else:
                                store_epilogue(epilogue, bb, row(m0, r, mp), col, lanes, sums, [at])
    return kernel
