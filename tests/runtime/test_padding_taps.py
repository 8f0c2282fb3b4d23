"""A conv's products with its zero padding are skipped (`schedules/padding_taps.py`): the guard on the kernel rows
of an output row, the predicate on a tile's columns, the products LLVM is left with, and numbers against torch
where whole kernel rows read padding."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX512
from tile_text import conv_tasks
from tvm import relax, s_tir, te, tirx

from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.conv_layout import blocked_conv
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.schedules import CPUMatmul
from kiln.runtime.tvm.schedules.padding_taps import map_share
from kiln.runtime.tvm.target import cpu_target

pytestmark = pytest.mark.usefixtures("module_cache")  # builds go to a scratch cache, never ~/.cache/kiln


def _scheduled(width: int, padding: int, channels: int = 64) -> tirx.PrimFunc:
    """A 3x3 blocked conv of `channels` 16-lane channels over a `width`-wide map (its input `width + 2 - 2 x padding`
    wide, so the output is `width` wide), scheduled for AVX-512."""
    size = width + 2 - 2 * padding
    x = te.placeholder((1, channels // 16, size, size, 16), name="x")
    wp = te.placeholder((4, channels, 3, 3, 16), name="w")
    conv = blocked_conv(x, wp, channels, [1, 1], [padding] * 4, [1, 1])
    return CPUMatmul().apply(te.create_prim_func([x, wp, conv]), AVX512, False).mod["main"]


def _products(text: str) -> tuple[str, str]:
    """The guard right inside the kernel-row loop (empty without one) and the update's predicate (empty without)."""
    guard = re.search(r"T\.grid\([^\n]*\):\n\s+if ([^\n]*):", text)
    where = re.search(r"T\.where\(([^\n]*)\)", text[text.index('"conv_blocked_update"'):])
    return (guard[1] if guard else ""), (where[1] if where else "")


def test_a_7_wide_conv_skips_the_kernel_rows_and_columns_on_its_padding() -> None:
    """ResNet's last stage (3x3 over 7², one tile of 7 columns a row): an output row's kernel rows are guarded once per
    input channel against the padded rows, and the tile's products are predicated on its unrolled columns and kernel
    columns alone, so TVM folds the predicate and drops the 4 of 42 products that read padding."""
    text = _scheduled(7, 1).script()
    (guard, where), (parallel, _) = _products(text), conv_tasks(text)
    assert parallel in guard and "<" in guard and "<=" in guard
    assert where and parallel not in where
    assert _products(_scheduled(7, 0).script()) == ("", "")  # no padding, nothing to skip


def test_the_llvm_build_of_a_padded_7_wide_conv_has_fewer_products() -> None:
    """The predicate folds away: the padded conv's build holds fewer vector FMAs than the same tile over an input
    padded by the caller (the same loops, no zero guard)."""
    def fmas(padding: int) -> int:
        ll = cpu_compile(tvm.IRModule({"main": _scheduled(7, padding)}), AVX512).mod.inspect_source("ll")
        return len(re.findall(r"fmuladd\.v16f32\(", ll))

    padded, unpadded = fmas(1), fmas(0)
    assert 0 < padded < unpadded


def test_a_tile_inside_a_wider_map_tests_its_position() -> None:
    """On a 14-wide map (two tiles of 7 columns) the column predicate reads the tile's position, a test per task
    outside the channel loop that LLVM keeps as a branch; the kernel rows are guarded as at 7²."""
    text = _scheduled(14, 1).script()
    (guard, where), (parallel, _) = _products(text), conv_tasks(text)
    assert guard and parallel in where


@pytest.mark.parametrize(("x_shape", "w_shape", "kw"), [
    ((1, 32, 7, 7), (48, 32, 3, 3), dict(padding=(3, 0, 1, 2))),
    ((2, 16, 7, 7), (32, 16, 3, 3), dict(padding=4, dilation=4)),
    ((1, 32, 14, 14), (32, 32, 3, 3), dict(padding=1, strides=2)),
    ((1, 16, 14, 14), (16, 16, 5, 5), dict(padding=(4, 1, 0, 3))),
    ((3, 32, 7, 7), (64, 32, 3, 3), dict(padding=2, dilation=2))],
    ids=["top-rows-all-padding", "dilated-by-4-most-taps-padding", "strided-14-wide", "5x5-asymmetric",
         "dilated-7-wide-batch-3"])
def test_convs_with_taps_on_padding_match_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...], kw: dict) -> None:
    """Convs whose padding takes whole kernel rows of some output rows (the first row of a conv padded 3 on top reads
    none of the map), most taps (3x3 dilated by 4 on 7²) or an asymmetric border equal torch's in float64."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    target = cpu_target()
    mod = relax_module([x_shape], lambda a: relax.op.nn.conv2d(a, relax.const(w), **kw))
    exe = cpu_compile(mod, target, cpu_pipeline(target, fast_math=False))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    pad = kw["padding"] if isinstance(kw["padding"], tuple) else (kw["padding"],) * 4
    top, left, bottom, right = pad
    padded = torch.nn.functional.pad(torch.from_numpy(x).double(), (left, right, top, bottom))
    want = torch.nn.functional.conv2d(padded, torch.from_numpy(w).double(), stride=kw.get("strides", 1),
                                      dilation=kw.get("dilation", 1))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def _window_conv(width: int, padding: int, dilation: int = 1) -> tuple[s_tir.Schedule, s_tir.schedule.SBlockRV,
                                                                       s_tir.schedule.SBlockRV]:
    """An unscheduled 3x3 blocked conv over a `width`-wide map (output `width` wide), its update and padding blocks."""
    size = width + 2 * dilation - 2 * padding
    x = te.placeholder((1, 4, size, size, 16), name="x")
    wp = te.placeholder((4, 64, 3, 3, 16), name="w")
    conv = blocked_conv(x, wp, 64, [1, 1], [padding] * 4, [dilation, dilation])
    sch = s_tir.Schedule(te.create_prim_func([x, wp, conv]))
    return sch, sch.get_sblock("conv_blocked"), sch.get_sblock("PadInput")


@pytest.mark.parametrize(("width", "padding", "dilation", "share"), [
    (28, 1, 1, 82 / 84), (7, 1, 1, 19 / 21), (7, 2, 2, 17 / 21)], ids=["28²", "7²", "7²-dilated-by-2"])
def test_map_share_counts_the_kernel_rows_that_read_the_map(width: int, padding: int, dilation: int,
                                                           share: float) -> None:
    """Of a 3x3 conv's (output row, kernel row) pairs, those reading the map: 82 of 84 at 28² padded by 1, 19 of
    21 at 7², 17 of 21 for a dilation of 2 padded by 2 at 7²."""
    sch, update, pad = _window_conv(width, padding, dilation)
    rows = sch.get_loops(update)[2]
    assert map_share(sch, update, pad, rows) == pytest.approx(share)


def test_a_padded_28_wide_conv_tiles_one_output_row_so_its_kernel_rows_are_skipped() -> None:
    """At 28² a tile of 2 output rows x 4 columns ties one row x 7 columns on cycles per FMA; the row skip (82 of 84
    pairs computed) breaks the tie for the single row, whose kernel rows are then guarded (Zen 4: the 3x3 128x28²
    conv at batch 8 8.6 -> 8.1 ms). Over a map padded by its caller, the 2-row tile stays."""
    def tile(text: str) -> list[int]:  # the init's unrolled loops: rows x columns x channel vectors
        return [int(extent) for extent in re.findall(r"for \w+_init in T\.unroll\((\d+)\)", text)]

    padded, unpadded = _scheduled(28, 1).script(), _scheduled(28, 0).script()
    assert tile(padded) == [7, 2] and _products(padded)[0]
    assert tile(unpadded) == [2, 4, 2] and _products(unpadded) == ("", "")
