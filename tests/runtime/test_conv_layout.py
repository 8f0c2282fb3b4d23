"""Convs with output channels blocked by the vector width (issue 13: "conv weights and activations in a blocked
channel layout (NCHW[x]c, as onnxruntime's MLAS and oneDNN use)", "bound weights pre-packed"): which convs the
CPU model blocks, the packed weight, and numbers against torch, bound and as inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX2, AVX512, avx512
from tile_text import conv_tasks
from tvm import relax, te, tirx

from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.conv_layout import BLOCKED_NAME, blocked_conv, blocks_output_channels, pack_weight
from kiln.runtime.tvm.conv_regions import block_conv_regions
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.schedules import CPUMatmul
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()

pytestmark = pytest.mark.usefixtures("module_cache")  # builds go to a scratch cache, never ~/.cache/kiln


@pytest.mark.parametrize(("target", "channels", "width", "blocked"), [
    (AVX2, 128, 28, True), (AVX2, 256, 14, True), (AVX2, 256, 7, True), (AVX2, 64, 56, True),
    (AVX2, 10, 28, False), (AVX2, 77, 28, True), (AVX512, 128, 28, True), (AVX512, 64, 56, True),
    (AVX512, 64, 64, True), (AVX512, 24, 14, False)])
def test_the_cpu_model_blocks_convs_whose_width_fills_vectors_worse(target: tvm.target.Target, channels: int,
                                                                   width: int, blocked: bool) -> None:
    """Width tiles of 28 columns are 14 + 14 (8 + 6 lanes on AVX2), of 14 one partial vector: those convs ran at a
    third of onnxruntime's speed and are blocked, and so is a 7-wide map (under one vector: its 7 columns are one
    register tile, `test_a_7_wide_blocked_conv_keeps_its_columns_in_one_tile`); a 56-wide map fills
    whole vectors on AVX2, as many as 64 channels do, and a tie is blocked (the 1x1 64x56² -> 256 conv ran 1.8x
    faster blocked; on AVX-512 56 wide tiles as 8 of 16 lanes; 64 wide ties); channel counts (10 on AVX2, 24 of
    AVX-512's 32) that would fill fewer lanes than the width does stay NCHW."""
    rule = CPUMatmul().for_cpu(cpu_model(target))
    assert blocks_output_channels(channels, width, rule) is blocked


def test_pack_weight_puts_a_vector_of_output_channels_last() -> None:
    """`[O, I, KH, KW]` as `[O / b, I, KH, KW, b]`, zero rows past O (77 channels in blocks of 8: 3 zero rows)."""
    w = np.random.default_rng(0).standard_normal((77, 3, 3, 2)).astype(np.float32)
    packed = pack_weight(w, 8)
    assert packed.shape == (10, 3, 3, 2, 8)
    for o in (0, 7, 8, 40, 76):
        np.testing.assert_array_equal(packed[o // 8, :, :, :, o % 8], w[o])
    assert not packed[9, ..., 5:].any()


def _blocked_module(x_shape: tuple[int, ...], w: np.ndarray, bound: bool, kw: dict, epilogue: bool) -> tvm.IRModule:
    def body(x: relax.Expr, *weight: relax.Expr) -> relax.Expr:
        y = relax.op.nn.conv2d(x, weight[0] if weight else relax.const(w), **kw)
        return relax.op.nn.relu(relax.op.add(y, relax.const(np.arange(w.shape[0], dtype=np.float32)
                                                             .reshape(-1, 1, 1) / 10))) if epilogue else y
    return relax_module([x_shape] if bound else [x_shape, w.shape], body)


def _prim_names(mod: tvm.IRModule) -> list[str]:
    with TARGET:
        out = block_conv_regions(TARGET)(mod)
    return [g.name_hint for g, f in out.functions_items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize(("x_shape", "w_shape", "kw", "epilogue", "bound"), [
    ((2, 3, 20, 20), (77, 3, 3, 3), dict(padding=1), True, True),
    ((1, 10, 18, 18), (16, 10, 1, 1), dict(padding=0), False, True),
    ((1, 5, 39, 39), (24, 5, 3, 3), dict(padding=1, strides=2), False, False),
    ((1, 4, 20, 20), (32, 4, 3, 3), dict(padding=2, dilation=2), True, False),
    ((8, 13, 7, 7), (21, 13, 3, 3), dict(padding=1), True, True),
    ((1, 16, 7, 7), (24, 16, 1, 1), dict(padding=0), False, False),
    ((1, 9, 14, 14), (16, 9, 3, 3), dict(padding=1, strides=2), False, True),
    ((1, 11, 14, 14), (32, 11, 3, 3), dict(padding=1), True, True),
    ((1, 7, 15, 15), (16, 7, 3, 3), dict(padding=0), False, False),
    ((2, 6, 17, 17), (16, 6, 3, 3), dict(padding=2, dilation=2), False, True),
    ((1, 40, 10, 10), (16, 40, 3, 3), dict(padding=1), True, False),
    ((2, 40, 24, 24), (64, 40, 3, 3), dict(padding=1), True, True),
    ((2, 13, 5, 9), (21, 13, 1, 1), dict(padding=0), True, True),
    ((1, 300, 7, 7), (27, 300, 1, 1), dict(padding=0), True, True),
    ((3, 201, 7, 7), (96, 201, 1, 1), dict(padding=0), False, False),
    ((1, 64, 56, 56), (256, 64, 1, 1), dict(padding=0), True, True),
    ((2, 384, 28, 28), (48, 384, 1, 1), dict(padding=0), True, True)],
    ids=["3x3-77-channels-bias-relu-bound", "1x1-18-wide-bound", "3x3-s2-20-wide-inputs", "dilated-20-wide-inputs",
         "3x3-7-wide-batch-8-odd-channels", "1x1-7-wide-inputs", "3x3-s2-to-7-wide-bound",
         "3x3-14-wide-rows-in-one-tile-bias-relu", "3x3-13-wide-unpadded-odd-channels-inputs",
         "dilated-17-wide-batch-2", "3x3-40-channels-in-chunks-bias-relu-inputs",
         "3x3-40-channels-in-chunks-split-by-rows-batch-2-bias-relu",
         "1x1-5x9-batch-2-odd-channels-bias-relu", "1x1-7-wide-deep-two-lines-odd-channels-bias-relu",
         "1x1-7-wide-deep-batch-3-inputs", "1x1-56-wide-pixel-chunks-bias-relu",
         "1x1-28-wide-channel-chunks-batch-2-bias-relu"])
def test_blocked_conv_matches_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...], kw: dict, epilogue: bool,
                                    bound: bool) -> None:
    """Blocked convs (a 77-channel tail, 1x1, strided, dilated, with a fused bias and relu; 18-20 wide, so blocked on
    AVX2 and AVX-512 hosts alike; 7-wide maps at batch 1 and 8, whose 7 columns are one register tile; odd 13-17 wide
    maps, unpadded or dilated; a 14-wide map whose tile spans output rows; 40 input channels summed in chunks (a
    24-wide input that outweighs its weight, so its threads split the output rows);
    a 5x9 1x1 at batch 2 as one row of pixels; 7² 1x1s 201-300 deep at batch 1 and 3, whose tile takes lines past
    L1 to hide the FMA latency; 1x1s over 784-3136 pixels, swept in chunks of pixels, 384 channels summed in chunks
    of channel blocks) equal torch's; a bound weight is packed at build time (no packing kernel), a weight
    passed as input is packed by a kernel of the program."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    mod = _blocked_module(x_shape, w, bound, kw, epilogue)
    names = _prim_names(mod)
    assert BLOCKED_NAME in names and ("pack_conv_weight" in names) is not bound
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in ([x] if bound else [x, w])))
    tkw = {"stride": kw.get("strides", 1), "padding": kw["padding"], "dilation": kw.get("dilation", 1)}
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), **tkw)
    if epilogue:
        want = torch.relu(want + torch.arange(w_shape[0], dtype=torch.float64).reshape(-1, 1, 1) / 10)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("x_shape", "w_shape"), [((1, 64, 56, 56), (256, 64, 1, 1)),
                                                  ((2, 384, 28, 28), (48, 384, 1, 1))],
                         ids=["pixel-chunks", "channel-chunks-batch-2"])
def test_an_avx2_build_of_a_chunked_1x1_conv_matches_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> None:
    """The AVX2 build (8 lanes: chunks of 64 channels, a smaller L2 share) of the 1x1 convs swept in chunks of pixels
    and of input channels, run on this host (AVX2 code runs on AVX-512 CPUs), equals torch's."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
    mod = _blocked_module(x_shape, w, True, dict(padding=0), True)
    exe = cpu_compile(mod, AVX2, cpu_pipeline(AVX2, fast_math=False))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x))
    want = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double())
                      + torch.arange(w_shape[0], dtype=torch.float64).reshape(-1, 1, 1) / 10)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("width", [56, 7])
def test_56_and_7_wide_convs_are_blocked(width: int) -> None:
    """64 channels on a 56-wide map fill whole vectors either way, and blocked wins the tie; a 7-wide map is narrower
    than one vector (on AVX2 and AVX-512), so channel vectors fill more lanes and it is blocked too."""
    mod = relax_module([(1, 8, width, width), (64, 8, 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, padding=1))
    assert BLOCKED_NAME in _prim_names(mod)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_7_wide_blocked_conv_keeps_its_columns_in_one_tile(target: tvm.target.Target) -> None:
    """ResNet's last stage (7² maps, 2.2x onnxruntime): tiled 2 + 2 + 2 + 1 columns (AVX2's `mr / 2`) the guarded
    column kept its sums in memory; a row tile that divides the 7 columns wins (7 rows of 8 or 16 accumulators)."""
    x = te.placeholder((1, 8, 9, 9, 8), name="x")
    wp = te.placeholder((8, 64, 3, 3, 8), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, 64, [1, 1], [0, 0, 0, 0], [1, 1])])
    text = CPUMatmul().apply(func, target, False).mod["main"].script()
    tile = text[:text.index('"conv_blocked_update"')].rsplit("T.grid", 1)[1]  # kernel width, columns, channels
    assert 7 in [int(n) for n in re.findall(r"T\.unroll\((\d+)\)", tile)]


def _register_tile(text: str) -> dict[str, int]:
    """The unrolled extent of each output index of a scheduled blocked conv's update block: `v0` the output-channel
    vectors, `v1` the output rows, `v2` the columns (1 where the index has no unrolled loop)."""
    unrolled = dict(re.findall(r"for (\w+) in T\.unroll\((\d+)\)", text))
    update = text[text.index('"conv_blocked_update"'):]
    bindings: dict[str, str] = {}
    for v, loop in re.findall(r"(v[012]) = T\.axis\.spatial\(\w+, (?:[^\n]* \+ )?(\w+)\)", update):
        bindings.setdefault(v, loop)  # the update's own, not the store's after it
    return {v: int(unrolled.get(bindings.get(v, ""), 1)) for v in ("v0", "v1", "v2")}


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize(("channels", "width"), [(32, 14), (64, 56), (24, 13)])
def test_a_3x3_blocked_conv_tile_divides_its_extents_and_fills_the_accumulators(
        target: tvm.target.Target, channels: int, width: int) -> None:
    """The register tile of a stride-1 3x3 blocked conv (output-channel vectors x output rows x columns) divides
    every extent (a tail's sums leave the registers) and holds at most the CPU model's accumulators; it builds for
    AVX2 and AVX-512 alike. On AVX2 a 14-wide map (no 4 columns divide it) spans 2 output rows: 2 columns x 4
    channel vectors ran at 57-66 GFLOP/s on a Zen 3 core, 2 x 2 rows x 2 vectors at 78-84."""
    lanes = cpu_model(target).lanes()
    x = te.placeholder((1, channels // 8, width + 2, width + 2, 8), name="x")
    wp = te.placeholder((-(-channels // lanes), channels, 3, 3, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, channels, [1, 1], [0, 0, 0, 0], [1, 1])])
    sch = CPUMatmul().apply(func, target, False)
    tile = _register_tile(sch.mod["main"].script())
    assert wp.shape[0] % tile["v0"] == 0 and width % tile["v1"] == 0 and width % tile["v2"] == 0
    assert tile["v0"] * tile["v1"] * tile["v2"] <= cpu_model(target).accumulators
    if target is AVX2 and width == 14:
        assert tile["v1"] == 2
    cpu_compile(sch.mod, target)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_3x3_blocked_conv_sums_all_its_input_channels_in_each_register_tile(target: tvm.target.Target) -> None:
    """64 input channels of 3x3 weights outgrow L1 for a tile's channel vectors, and still the tile sums all of them
    before it stores its sums: the channel reduction is one loop, inside the tile loops (chunks of channels over a
    row of tiles stored and reloaded the sums per chunk; without them ResNet's 3x3 convs ran 1-10% faster on
    Zen 4)."""
    lanes = cpu_model(target).lanes()
    x = te.placeholder((1, 64 // lanes, 58, 58, lanes), name="x")
    wp = te.placeholder((64 // lanes, 64, 3, 3, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, 64, [1, 1], [0, 0, 0, 0], [1, 1])])
    sch = CPUMatmul().apply(func, target, False)
    text = sch.mod["main"].script()
    nest = text[:text.index('"conv_blocked_update"')]
    extents = [[int(e) for e in group.split(", ")] for group in re.findall(r"in T\.(?:grid|serial|unroll)\(([\d, ]+)\)",
                                                                          nest.split("T.parallel", 1)[1])]
    assert [64, 3] in [group[:2] for group in extents], extents  # all channels, then window rows (no chunk loop)
    cpu_compile(sch.mod, target)


def _first_thread_rows(text: str) -> set[int]:
    """The output rows a scheduled blocked conv's update block writes in the first half of its parallel loop's
    iterations (the first of two threads' share under a static split; a symbolic batch of 1), its other loops at 0;
    a padding stage's parallel loop before it is skipped."""
    fused, extent = conv_tasks(text)
    extent = eval(extent, {}, dict.fromkeys(re.findall(r"[A-Za-z_]\w*", extent), 1))  # a symbolic batch of 1
    update = text[text.index('"conv_blocked_update"'):]
    row = re.search(r"T\.writes\(conv_blocked_local\[([^\]]*)\]\)", update).group(1).split(", ")[2]
    binding = re.search(rf"{row} = T\.axis\.spatial\(\d+, ([^\n]*)\)", update).group(1)
    names = set(re.findall(r"[A-Za-z_]\w*", binding)) - {fused}
    return {eval(binding, {}, {fused: i, **dict.fromkeys(names, 0)}) for i in range(int(extent) // 2)}


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize(("batch", "channels", "width", "size", "by_rows"), [
    (1, 64, 56, 3, True), (2, 64, 56, 3, False), (1, 128, 28, 3, False), (1, 256, 14, 3, False), (1, 64, 56, 1, True),
    (1, 512, 7, 1, False), (None, 64, 56, 3, True), (None, 256, 14, 3, False)])
def test_a_blocked_conv_splits_its_threads_over_the_larger_operand(
        target: tvm.target.Target, batch: int | None, channels: int, width: int, size: int, by_rows: bool) -> None:
    """Where the input outweighs the weight (3x3 64x56²: 861 KB padded, 147 KB of weight; 1x1 64x56²) the threads'
    static split of the parallel loop divides the output rows, so each reads half of the input, not all of it for
    half of the weight (3x3 64x56², 2 threads on an Emerald Rapids VM: 0.69 -> 0.63 ms); where the weight is the
    larger (3x3 128x28² and 256x14², 1x1 512x7²) it divides the output channels. A batch of 2 is split by images; a
    dynamic batch (None) is weighed per image, as batch 1 (with its sizes unknown, it was split by channels whatever
    they were). These inputs come padded already: the kernels have no padding stage."""
    assert _rows_first(target, batch, channels, width, size, 0) is by_rows


def _rows_first(target: tvm.target.Target, batch: int | None, channels: int, width: int, size: int, padding: int
                ) -> bool:
    """Whether the first of two threads computes only the top half of a blocked conv's output rows (a batch of None
    is symbolic)."""
    lanes = cpu_model(target).lanes()
    side = width + size - 1 - 2 * padding
    x = te.placeholder((te.var("n") if batch is None else batch, channels // 8, side, side, 8), name="x")
    wp = te.placeholder((channels // lanes, channels, size, size, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, channels, [1, 1], [padding] * 4, [1, 1])])
    rows = _first_thread_rows(CPUMatmul().apply(func, target, False).mod["main"].script())
    return max(rows) < width // 2


@pytest.mark.parametrize(("channels", "width", "cores", "by_rows"), [
    (96, 14, 2, True), (96, 14, 1, False), (256, 14, 2, False)])
def test_a_padded_conv_whose_weight_fits_l2_splits_its_rows(channels: int, width: int, cores: int, by_rows: bool
                                                             ) -> None:
    """A conv that pads its input in its own kernel splits its rows across more than one core where the whole weight
    fits in half of L2 (3x3 128x28², 590 KB: its threads read the padded copy they have just written, and split by
    output channels each read all of it: 2 threads 0.89-0.96x the time by rows); not on one core (7% slower by
    rows there), nor where the weight is larger (3x3 256x14², 2.4 MB, stays split by channels). 96 channels at 14²
    (332 KB of weight, 98 KB of padded input) fit half of the 1 MiB L2 this AVX-512 cross target assumes."""
    assert _rows_first(avx512(cores), 1, channels, width, 3, 1) is by_rows


def _blocked_output_shapes(mod: tvm.IRModule) -> list[list[int]]:
    with TARGET:
        out = block_conv_regions(TARGET)(mod)
    main = next(f for _, f in out.functions_items() if isinstance(f, relax.Function))
    return [[int(d) for d in b.var.ty.shape] for block in main.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir")
            and b.value.args[0].name_hint.startswith(BLOCKED_NAME)]


@pytest.mark.parametrize(("kw", "rows"), [(dict(), True), (dict(strides=2), False), (dict(padding=1), False)],
                         ids=["1x1", "1x1-stride-2", "1x1-padded"])
def test_a_1x1_conv_computes_its_pixels_as_one_row(kw: dict, rows: bool) -> None:
    """A 1x1 conv of stride 1 without padding is a matmul over its pixels: its blocked kernel computes the 5 x 9 map
    as one row of 45 (reshapes in and out, no copies), so the register tile may take rows dividing 45; a strided or
    padded one keeps its map."""
    w = np.ones((16, 24, 1, 1), np.float32)
    mod = relax_module([(2, 24, 5, 9)], lambda x: relax.op.nn.conv2d(x, relax.const(w), **kw))
    shape = _blocked_output_shapes(mod)[0]
    assert (shape[2:4] == [1, 45]) is rows, shape


@pytest.mark.parametrize(("target", "lanes", "shape"), [(AVX2, 8, (4, 2)), (AVX512, 16, (7, 2))],
                         ids=["avx2", "avx512"])
def test_a_1x1_conv_tile_is_costed_like_a_window_conv_tile(target: tvm.target.Target, lanes: int,
                                                          shape: tuple[int, int]) -> None:
    """256 input channels over 196 pixels: the tile whose reduction step takes the fewest cycles per FMA by
    `_window_tile`'s model (FMA latency and units, loads from L1, weight vectors from L2), fewest weight loads per FMA
    among those. AVX2 takes 4 pixels x 2 lines (the 256x14² conv ran at 56 GFLOP/s in 2 x 4 and 82 in 4 x 2 on a Zen 3
    core); AVX-512 7 x 2, not the 14 x 1 a slab kept in half of L1 allowed, whose 15 loads per 14 FMAs bounded it:
    256x14² 101 -> 83 us, 1024x14² -> 256 442 -> 351, 256x56² -> 64 500 -> 350 (2 threads on an Emerald Rapids VM,
    medians of 6 interleaved rounds)."""
    x = te.placeholder((1, 256, 1, 196), name="x")
    wp = te.placeholder((256 // lanes, 256, 1, 1, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, 256, [1, 1], [0, 0, 0, 0], [1, 1])])
    tile = _register_tile(CPUMatmul().apply(func, target, False).mod["main"].script())
    assert (tile["v1"], tile["v0"]) == shape, tile  # pixels, output-channel vectors


@pytest.mark.parametrize(("batch", "cores", "tasks"), [(1, 2, "2"), (1, 1, "1"), (None, 2, "n * 2")])
def test_a_1x1_conv_on_a_1x1_map_leaves_every_core_a_task(batch: int | None, cores: int, tasks: str) -> None:
    """1024 channels -> 64 (4 lines of 16) on a 1x1 map, a squeeze-excite conv: one tile of all 4 lines would be one
    task, so on 2 cores the tile takes 2 (on 1, all 4). Over a dynamic batch the rows are the batch alone: the tile
    takes 1 row, unguarded, rather than 16 rows guarded one by one (the 960 -> 240 conv at batch 1: 82 -> 18 us, and
    at batch 64 316 -> 235; 960 -> 1280 at 64 1.71 -> 1.29 ms; 2 threads, Emerald Rapids)."""
    target = avx512(cores)
    x = te.placeholder((te.var("n") if batch is None else batch, 64, 1, 1, 16), name="x")
    wp = te.placeholder((4, 1024, 1, 1, 16), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, 1024, [1, 1], [0, 0, 0, 0], [1, 1])])
    text = CPUMatmul().apply(func, target, False).mod["main"].script()
    update = text[text.index('"conv_blocked_update"'):]
    assert re.findall(r"T\.parallel\(([^)]+)\)", text) == [tasks], text  # 4 lines / lines a tile
    assert "T.where" not in update[:update.index("T.writes")], text


@pytest.mark.parametrize(("target", "lanes", "shape"), [
    (AVX512, 16, (7, 2)), (tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2}), 16, (7, 2)),
    (AVX2, 8, (7, 1)), (tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2}), 8, (7, 1))],
    ids=["avx512", "znver4", "avx2", "znver3"])
def test_a_1x1_conv_tile_on_a_7_wide_map_hides_the_fma_latency(target: tvm.target.Target, lanes: int,
                                                               shape: tuple[int, int]) -> None:
    """512 input channels on a 7² map: one line's weight slab (32 KiB of 16 lanes) already outgrows half of L1, but
    7 pixels x 1 line are 7 sums, under the 2 FMA units x 4 cycles; AVX-512 (Zen 4's model too) takes a second line
    (14 of its 16 accumulators; 512x7² ran 201 -> 150 us on an Emerald Rapids core), AVX2 and Zen 3 keep 7 x 1 (8
    accumulators)."""
    x = te.placeholder((1, 512 // lanes, 1, 49, lanes), name="x")
    wp = te.placeholder((512 // lanes, 512, 1, 1, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, 512, [1, 1], [0, 0, 0, 0], [1, 1])])
    sch = CPUMatmul().apply(func, target, False)
    tile = _register_tile(sch.mod["main"].script())
    assert (tile["v1"], tile["v0"]) == shape, tile  # pixels (unit dims have no iterator), output-channel vectors
    cpu_compile(sch.mod, target)


@pytest.mark.parametrize("params", ["bound", "inputs"])
def test_kiln_conv2d_with_both_param_modes(params: str) -> None:
    """A kiln conv2d with a bias on a 20-wide map, 77 output channels (blocked), through `compile_graph` in both
    parameter modes, against torch."""
    rng = np.random.default_rng(1)
    w, bias = rng.standard_normal((77, 6, 3, 3)).astype(np.float32), rng.standard_normal(77).astype(np.float32)
    x = rng.standard_normal((2, 6, 20, 20)).astype(np.float32)
    b = Builder("Conv")
    xv = b.input("x", ((2, 6, 20, 20), "f32"))
    b.ret(b.conv2d(xv, b.param("w", w.shape, data=w), b.param("b", bias.shape, data=bias), padding=(1, 1)))
    got = compile_graph(b.build(), target=TARGET, params=params, fast_math=False)(x)
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(),
                                      torch.from_numpy(bias).double(), padding=1).numpy()
    np.testing.assert_allclose(np.asarray(got[0] if isinstance(got, (list, tuple)) else got), want,
                               rtol=1e-4, atol=1e-4)


def _sweep(text: str) -> list[tuple[int, int]]:
    """(output-channel block, first pixel) of each iteration of a scheduled 1x1 conv's parallel loop, its other loops
    at 0, in order: the tiles the threads' static split hands out one after another."""
    fused, extent = conv_tasks(text)
    update = text[text.index('"conv_blocked_update"'):]
    index = re.search(r"T\.writes\(conv_blocked_local\[([^\]]*)\]\)", update).group(1).split(", ")
    bindings = [re.search(rf"{index[i]} = T\.axis\.spatial\(\d+, ([^\n]*)\)", update).group(1) for i in (1, 3)]
    names = set(re.findall(r"[A-Za-z_]\w*", " ".join(bindings))) - {fused}
    return [tuple(eval(b, {}, {fused: i, **dict.fromkeys(names, 0)}) for b in bindings) for i in range(int(extent))]


def _1x1_conv_text(target: tvm.target.Target, channels: int) -> str:
    """The scheduled TIR of a blocked 1x1 conv, `channels` -> 256 over 3136 pixels (a 56² map as one row)."""
    lanes = cpu_model(target).lanes()
    x = te.placeholder((1, channels // 16, 1, 3136, 16), name="x")
    wp = te.placeholder((256 // lanes, channels, 1, 1, lanes), name="w")
    func = te.create_prim_func([x, wp, blocked_conv(x, wp, channels, [1, 1], [0, 0, 0, 0], [1, 1])])
    return CPUMatmul().apply(func, target, False).mod["main"].script()


@pytest.mark.parametrize(("target", "channels"), [(AVX2, 64), (AVX512, 64), (AVX512, 128)],
                         ids=["avx2-64", "avx512-64", "avx512-128"])
def test_a_1x1_conv_sweeps_chunks_of_pixels_one_line_at_a_time(target: tvm.target.Target, channels: int) -> None:
    """Split by pixels, a 1x1 conv over 3136 pixels (a 56² map, 256 output channels) hands its threads chunks of
    pixels whose input slab takes at most a quarter of L2, and within a chunk one line (output-channel vectors) after
    another: each line then writes a run of pixels, and every line after the first reads the chunk from L2. Lines
    innermost, each row tile touched every output-channel block of the map, 16 concurrent streams of 512 bytes; at
    batch 8 (maps beyond L3) the 64 -> 256 conv with a residual ran at 92 GFLOP/s on Zen 4, 136 in chunks. At least
    two chunks, a number the cores divide, so each of two cores computes its own pixels of one image."""
    model = cpu_model(target)
    sweep = _sweep(_1x1_conv_text(target, channels))
    runs = [[sweep[0]]]
    for prev, step in zip(sweep, sweep[1:]):
        if step[0] == prev[0]:
            runs[-1].append(step)
        else:
            runs.append([step])
    pixels = {len({p for _, p in run}) for run in runs}
    assert len(pixels) == 1 and (tiles := pixels.pop()) > 1, runs[:3]
    rows = sweep[1][1] - sweep[0][1]
    assert tiles * rows * channels * 4 <= model.caches.l2 // 4
    assert {line for line, _ in sweep[:len(sweep) // 2]} == {line for line, _ in sweep}  # every line on each core
    assert max(p for _, p in sweep[:len(sweep) // 2]) < 3136 // 2  # the first core: the first half of the pixels


@pytest.mark.parametrize(("target", "channels"), [(AVX2, 128), (AVX512, 256), (AVX512, 512)],
                         ids=["avx2-128", "avx512-256", "avx512-512"])
def test_a_1x1_conv_over_many_channels_sums_them_in_chunks_outside_its_pixel_tiles(target: tvm.target.Target,
                                                                                  channels: int) -> None:
    """Over more input channels than 8 blocks of them, a 1x1 conv split by pixels sums 8 blocks (8 lanes of
    channels each) at a time, outside the tiles of one task's chunk of pixels, whose sums stay in half of L1
    between chunks: each tile read one line of every channel block (one memory stream each), and at batch 8 on
    Zen 4 the 256 -> 64 conv at 56² took 6.3 ms, 4.6 in chunks of 8 blocks, and 512 -> 128 at 28² 5.2 and 4.1."""
    model = cpu_model(target)
    text = _1x1_conv_text(target, channels)
    update = text[text.index('"conv_blocked_update"'):]
    step = int(re.search(rf"T\.axis\.reduce\({channels}, \w+ \* (\d+) \+", update).group(1))
    assert step == 8 * model.lanes()
    fused, _ = conv_tasks(text)
    loops = re.findall(r"for ([\w, ]+) in T\.(?:grid|unroll|serial)\(([\d, ]+)\)", text)
    extents = {name: int(n) for names, ns in loops for name, n in zip(names.split(", "), ns.split(", "), strict=True)}
    binding = re.search(r"T\.axis\.spatial\(3136, ([^\n]*)\)", update).group(1)  # the pixel
    names = sorted(set(re.findall(r"[A-Za-z_]\w*", binding)) - {fused, "T", "int64"})
    pixels = {eval(binding, {}, {fused: 0, **dict(zip(names, values, strict=True))})
              for values in np.ndindex(*(extents[n] for n in names))}
    rows = _register_tile(text)["v1"]
    assert len(pixels) > rows and len(pixels) * _register_tile(text)["v0"] * model.lanes() * 4 <= model.caches.l1d // 2


def test_a_1x1_conv_over_8_channel_blocks_or_fewer_sums_them_whole() -> None:
    """64 channels on AVX2 are 8 blocks of 8: one chunk, so the sum is not split."""
    update = _1x1_conv_text(AVX2, 64)
    assert re.search(r"T\.axis\.reduce\(64, \w+ \* 4 \+ \w+\)", update), update
