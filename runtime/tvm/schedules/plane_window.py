"""CPU schedule for the depthwise convs computed plane by plane (`runtime/tvm/plane_window.py`).

Groups of channels in parallel (`plane_group`); under each, the group's padded planes are filled (a few KiB, in
L1), then for each channel register tiles of `row_tile` output rows x one vector of columns reduce the window row
by row (its taps unrolled, each a vector multiply-add of a contiguous load, the next rows reusing those loads), and
the channel's real columns are stored with any elementwise epilogue (bias, relu) fused.
"""

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..cpu import CPUModel, cpu_model
from ..plane_window import ACC_BLOCK, OUT_BLOCK, PAD_BLOCK, vector_width
from .injective import largest_divisor, static_extent, vectorize_inner


def row_tile(rows: int, weights: int, shifts: int, model: CPUModel) -> int:
    """Output rows per register tile: as many accumulators as fit beside the window's `weights` (the conv's taps)
    and the `shifts` vectors of one input row in the register file, as a divisor of `rows`;
    when that divisor is under half of them (7 or 13 rows), all `rows` up to `model.accumulators`."""
    fit = max(1, min(model.accumulators, model.vector_registers - weights - shifts))
    divisor = largest_divisor(rows, fit)
    return rows if 2 * divisor < fit and rows <= model.accumulators else divisor


GROUP_PLANES = 8  # at 7² and 14² eight planes a group beat four (6.9 against 7.9 us, 10.0 against 10.6)


def plane_group(channels: int, plane_bytes: int, model: CPUModel) -> int:
    """Channels whose padded planes are filled before the first of them is summed: as many as fit a quarter of L1
    (at most `GROUP_PLANES`), leaving a group at least for each core at batch 1, as a divisor of `channels`. A
    plane summed right after its copy waits on store forwarding (its rows are written as narrow stores that no
    window load lies within): a 512x7² conv ran 10.6 us one plane at a time, 6.9 eight at a time (Zen 4)."""
    fit = model.caches.l1d // 4 // plane_bytes
    return largest_divisor(channels, max(1, min(GROUP_PLANES, fit, channels // model.cores)))


# Elements of a stride's phase-split plane (rows x phases x columns) copied by fully unrolled rows: ~2 instructions
# each, a few KiB of code at most. As a loop nest LLVM vectorized the copy across rows, into gathers and (on AVX-512)
# scatters: the 3x3/2 plane of 96x27² (then a max pool's) took 36 us against 16 unrolled (AVX2 build: 20 against
# 18); past this size (64x56², 3.8k elements) the unrolled copy was the slower one, with the gathers kept and 14x
# the code.
UNROLLED_PLANE = 1024


def _fuse_epilogue(sch: s_tir.Schedule, epilogue: list[s_tir.schedule.SBlockRV]) -> None:
    """Fuse the elementwise blocks after the kernel's store into it: each but the last inlined into its consumers,
    then the last into the store. Reverse-inlining them one by one lost a value read twice (SiLU's `y * sigmoid(y)`
    reads the bias add twice): over a symbolic batch the kernel then read the add's buffer, never allocated."""
    if not epilogue:
        return
    *inner, last = epilogue
    for block in inner:
        sch.compute_inline(block)
    sch.reverse_compute_inline(last)


class CPUPlaneWindow(dl.ScheduleRule):
    """The kernels of `plane_depthwise` (its three blocks by name, then elementwise epilogues), else None."""

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        names = {sch.get(b).name_hint: b for b in sch.get_child_blocks(sch.get_sblock("root"))}
        if not {PAD_BLOCK, ACC_BLOCK, OUT_BLOCK} <= set(names):
            return None
        pad, acc, out = names[PAD_BLOCK], names[ACC_BLOCK], names[OUT_BLOCK]
        model = cpu_model(target)
        columns, padded = (static_extent(sch.get(b).writes[0].source.shape[-1]) for b in (out, acc))
        vector = vector_width(columns, model.lanes())
        batch, channel, row, column, *taps = sch.get_loops(acc)
        rows, kernel = static_extent(sch.get(row).extent), [static_extent(sch.get(t).extent) for t in taps]
        if padded % vector or rows is None or None in kernel:
            return None
        symbolic = static_extent(sch.get(batch).extent) is None
        padded_map = sch.get(pad).writes[0].source
        plane = [static_extent(d) for d in padded_map.shape[-3:]]
        planes = plane_group(static_extent(sch.get(channel).extent),
                             math.prod(plane) * tvm.DataType(padded_map.dtype).bits // 8, model)
        channel_o, channels = sch.split(channel, [None, planes])
        group = sch.fuse(batch, channel_o)  # in parallel: each group's planes filled, then its channels summed
        row_o, row_i = sch.split(row, [None, row_tile(rows, kernel[0] * kernel[1], kernel[1], model)])
        column_o, column_i = sch.split(column, [None, vector])
        # Row by row, each row's taps inside: the rows share their input vectors in registers. Taps outside the rows
        # (tap by tap over the tile) kept every row's loads live across taps, and the spills made a 3x3 window over
        # 64x56² take 58.9 us against 35.7 (Zen 4; 16x112²: 58.5 against 33.7).
        sch.reorder(channels, row_o, column_o, row_i, *taps, column_i)
        tile = sch.cache_write(acc, 0, "local")
        sch.reverse_compute_at(tile, column_o, preserve_unit_loops=True)
        own = (pad, acc, out)
        _fuse_epilogue(sch, [b for b in names.values() if not any(sch.get(b).same_as(sch.get(k)) for k in own)])
        sch.reverse_compute_at(out, channels)
        vectorize_inner(sch, out, model.lanes(), peel_tail=not symbolic)
        sch.compute_at(pad, group)
        sch.parallel(group)
        for loop in (*taps, row_i):
            sch.unroll(loop)
        sch.vectorize(column_i)
        *_, tile_rows, tile_columns = sch.get_loops(tile)
        sch.unroll(tile_rows)
        sch.vectorize(tile_columns)
        sch.decompose_reduction(acc, taps[0])
        *_, pad_row, phase, column = sch.get_loops(pad)
        if plane[1] > 1:  # a stride's phases (for 1, no such loop)
            sch.reorder(column, phase)
            sch.unroll(phase)
            if plane[0] * plane[1] * plane[2] <= UNROLLED_PLANE:
                sch.unroll(pad_row)
        if not symbolic:  # over a symbolic batch, TVM's loop partition mixed int32 and int64 indices and failed
            sch.annotate(column, "pragma_loop_partition_hint", 1)
        return sch
