"""The blocked layout's exit kernel (`blocked_exit.py`): NCHW[x]c back to NCHW by in-register transposes, against
numpy's transpose, for AVX-512 and AVX2 tiles, ragged pixels and channels, a dynamic batch and a 1x1 conv's map of
one pixel row; its AVX-512 build gathers no lane."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from cross_targets import AVX2, AVX512
from tvm import relax, tirx

from kiln.runtime.tvm.blocked_exit import KERNEL_NAME, blocked_exit, from_blocked_kernel, transposed
from kiln.runtime.tvm.pipeline import cpu_compile
from kiln.runtime.tvm.target import cpu_target

pytestmark = pytest.mark.usefixtures("module_cache")  # builds go to a scratch cache, never ~/.cache/kiln


def _nchw(xb: np.ndarray, channels: int) -> np.ndarray:
    """numpy's exit: `[n, C / b, H, W, b]` to `[n, C, H, W]`, the padding channels dropped."""
    n, blocks, h, w, lanes = xb.shape
    return xb.transpose(0, 1, 4, 2, 3).reshape(n, blocks * lanes, h, w)[:, :channels]


@pytest.mark.parametrize(("batch", "in_shape", "out_shape", "lanes"), [
    (1, (4, 56, 56), (64, 56, 56), 16), (3, (5, 7, 7), (77, 7, 7), 16), (2, (2, 1, 20), (32, 4, 5), 16),
    (1, (16, 14, 14), (256, 14, 14), 16), (2, (10, 6, 9), (77, 6, 9), 8), (1, (1, 4, 4), (16, 4, 4), 16)],
    ids=["56²-whole-tiles", "7²-ragged-pixels-and-channels-batch-3", "1x1-row-of-20", "14²-196-pixels",
         "avx2-build-6x9-ragged", "one-tile"])
def test_the_exit_kernel_equals_numpys_transpose(batch: int, in_shape: tuple[int, int, int],
                                                 out_shape: tuple[int, int, int], lanes: int) -> None:
    """Every real channel of every pixel lands where numpy's transpose puts it: tiles that divide the map and a last
    one overlapping its neighbour (49, 54 and 196 pixels), a last channel block of 13 real channels of 16 (or 5 of
    8), a batch the kernel reads as a variable, a 4x5 map given as one row of 20 pixels, a map of one tile."""
    xb = np.random.default_rng(0).standard_normal((batch, *in_shape, lanes)).astype(np.float32)
    got = tvm.runtime.empty((batch, *out_shape), "float32")
    target = AVX2 if lanes == 8 else None  # an AVX2 build runs on this host too
    _library(from_blocked_kernel(in_shape, out_shape, lanes), target).jit()["main"](tvm.runtime.tensor(xb), got)
    want = _nchw(xb.reshape(batch, in_shape[0], *out_shape[1:], lanes), out_shape[0])
    np.testing.assert_array_equal(got.numpy(), want)


def test_its_avx512_build_reads_and_writes_whole_vectors() -> None:
    """The tile is 16 zmm loads, shuffles and 16 zmm stores: no lane is inserted one at a time (the transpose
    schedule's `vinsertps` gathers), and no element is loaded alone."""
    asm = _library(from_blocked_kernel((4, 56, 56), (64, 56, 56), 16), AVX512).mod.inspect_source("asm")
    assert "vinsertps" not in asm and not re.search(r"vmovss\s+[^\n]*\(", asm)
    assert len(re.findall(r"vmov\w+\s+%zmm\d+, [^\n]*\(", asm)) >= 16  # the channels' stores
    assert len(re.findall(r"\tv(?:perm|shuf|unpck|insertf)", asm)) >= 32  # the shuffle network


def test_the_shuffle_network_moves_every_lane_to_its_transposed_place() -> None:
    """Evaluated on lane tags, `(row, lane)` in every lane of every row, each Shuffle read off its mask: vector j of
    the result holds (0, j), (1, j), ... (one lane of each row in order), for 4, 8 and 16 lanes."""
    def evaluate(expr: tirx.PrimExpr, rows: dict[str, list]) -> list:
        if isinstance(expr, tirx.Shuffle):
            concatenated = [tag for vector in expr.vectors for tag in evaluate(vector, rows)]
            return [concatenated[int(i)] for i in expr.indices]
        return rows[expr.name]

    for lanes in (4, 8, 16):
        rows = [tirx.Var(f"r{i}", f"float32x{lanes}") for i in range(lanes)]
        tags = {f"r{i}": [(i, p) for p in range(lanes)] for i in range(lanes)}
        result = [evaluate(vector, tags) for vector in transposed(rows, lanes, bind=lambda e: e)]
        assert result == [[(i, j) for i in range(lanes)] for j in range(lanes)]


def test_a_conv_region_exits_through_the_kernel() -> None:
    """A conv whose result leaves its blocked region is converted by this kernel, hand-scheduled, reading the 1x1
    conv's map of one pixel row without a reshape; a map narrower than one tile keeps `from_blocked`'s TE kernel."""
    def exits(size: int) -> list[tvm.tirx.PrimFunc]:
        builder = relax.BlockBuilder()
        xb = relax.Var("xb", relax.TensorType([2, 4, 1, size * size, 16], "float32"))
        with builder.function("main", [xb]):
            with builder.dataflow():
                out = builder.emit_output(blocked_exit(builder, xb, [2, 64, size, size]))
            builder.emit_func_output(out)
        mod = builder.get()
        return [f for g, f in mod.functions_items() if g.name_hint == KERNEL_NAME]

    (kernel,) = exits(7)
    assert kernel.attrs["tirx.is_scheduled"] and "T.Shuffle(" in kernel.script()
    (fallback,) = exits(3)
    assert "tirx.is_scheduled" not in (fallback.attrs or {})


def _library(kernel: tvm.tirx.PrimFunc, target: tvm.target.Target | None = None) -> tvm.runtime.Executable:
    return cpu_compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target or cpu_target(),
                       "default")
