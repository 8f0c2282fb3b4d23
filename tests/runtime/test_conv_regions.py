"""Blocked regions (issue 13: "conv weights and activations in a blocked channel layout (NCHW[x]c, as onnxruntime's
MLAS and oneDNN use) with layout changes only at the boundaries of blocked regions, padding folded into the conv
kernel"): where the rewrite converts, and chains of convs and elementwise ops against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX2, AVX512
from tvm import relax

from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.conv_layout import BLOCKED_NAME, DEPTHWISE_NAME
from kiln.runtime.tvm.conv_regions import block_conv_regions
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes, cpu_pipeline
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
nn = relax.op.nn
RNG = np.random.default_rng(0)
W1, W2, W3 = (RNG.standard_normal(s).astype(np.float32) / 8 for s in ((36, 20, 3, 3), (36, 36, 1, 1), (36, 36, 3, 3)))
BIAS, SCALE, SHIFT = (RNG.standard_normal((36, 1, 1)).astype(np.float32) for _ in range(3))

pytestmark = pytest.mark.usefixtures("module_cache")  # builds go to a scratch cache, never ~/.cache/kiln


def _chain(x: relax.Expr) -> relax.Expr:
    """3x3/s2 conv + bias + relu, 1x1 conv + batch norm as scale/shift + clip, 3x3 conv + residual add of the first
    relu + relu: 20 and 36 channels (no multiple of 8 or 16 lanes) on 18-wide maps, blocked on AVX2 and AVX-512."""
    c = relax.const
    a = nn.relu(relax.op.add(nn.conv2d(x, c(W1), strides=2, padding=1), c(BIAS)))
    b = relax.op.clip(relax.op.add(relax.op.multiply(nn.conv2d(a, c(W2)), c(SCALE)), c(SHIFT)), 0, 6)
    return nn.relu(relax.op.add(nn.conv2d(b, c(W3), padding=1), a))


def _torch_chain(x: np.ndarray) -> np.ndarray:
    t = {k: torch.from_numpy(v).double() for k, v in dict(x=x, w1=W1, w2=W2, w3=W3, b=BIAS, s=SCALE, h=SHIFT).items()}
    a = torch.relu(torch.nn.functional.conv2d(t["x"], t["w1"], stride=2, padding=1) + t["b"])
    b = torch.clip(torch.nn.functional.conv2d(a, t["w2"]) * t["s"] + t["h"], 0, 6)
    return torch.relu(torch.nn.functional.conv2d(b, t["w3"], padding=1) + a).numpy()


def _calls(mod: tvm.IRModule, target: tvm.target.Target) -> list[str]:
    """The PrimFuncs the module's one function calls after the region rewrite, in order, without the per-channel
    packs (kernels of constants, which FoldConstant runs at build time) and the suffixes that make names unique."""
    with target:
        out = block_conv_regions(target)(mod)
    main = next(f for _, f in out.functions_items() if isinstance(f, relax.Function))
    calls = [b.value for block in main.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir")]
    names = [call.args[0].name_hint.rstrip("0123456789") for call in calls]
    return [n for n in names if n != "pack_per_channel"]


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_three_conv_chain_converts_once_in_and_once_out(target: tvm.target.Target) -> None:
    """"layout changes only at the boundaries of blocked regions": the chain's three convs, its bias, scale/shift,
    clip, relus and the residual add of two blocked values run blocked between the first conv, which reads the NCHW
    input in place, and one `from_blocked` of the result."""
    names = _calls(relax_module([(2, 20, 36, 36)], _chain), target)
    assert names == [BLOCKED_NAME, BLOCKED_NAME, BLOCKED_NAME, "from_blocked"], names


def _pool_chain(x: relax.Expr) -> relax.Expr:
    """conv 3x3 + relu, a 3x3/1 max pool, conv 3x3, + the NCHW input `x` (36 channels)."""
    y = nn.relu(nn.conv2d(x, relax.const(W3), padding=1))
    return relax.op.add(nn.conv2d(nn.max_pool2d(y, 3, 1, 1), relax.const(W3), padding=1), x)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_pool_inside_a_region_adds_no_layout_change(target: tvm.target.Target) -> None:
    """"layout changes only at the boundaries of blocked regions": the max pool between two blocked convs pools the
    blocked map (layout NCHW[x]c, x the lanes) and the next conv reads its result, so the only conversions are the
    skip branch `x` into the blocked add (`to_blocked`) and the result out (before, the pool was a boundary: a
    `from_blocked` of the first conv's map)."""
    names = _calls(relax_module([(2, 36, 18, 18)], _pool_chain), target)
    assert names == [BLOCKED_NAME, BLOCKED_NAME, "to_blocked", "from_blocked"], names
    with target:
        out = block_conv_regions(target)(relax_module([(2, 36, 18, 18)], _pool_chain))
    lanes = 16 if target is AVX512 else 8
    assert f'layout="NCHW{lanes}c"' in out.script() and 'layout="NCHW"' not in out.script()


@pytest.mark.parametrize(("kind", "batch", "kernel", "stride", "pad", "include_pad"), [
    ("max", 1, 3, 2, 1, False), ("avg", 8, 3, 2, 1, True), ("avg", 1, 3, 2, 1, False), ("max", 8, 2, 2, 0, False)],
    ids=["max-3x3-s2-pad1", "avg-batch-8-counting-pad", "avg-not-counting-pad", "max-2x2-batch-8"])
def test_blocked_pools_match_torch(kind: str, batch: int, kernel: int, stride: int, pad: int,
                                   include_pad: bool) -> None:
    """conv -> pool -> 1x1 conv with 36 channels (a partial last block) on a 19-wide map (odd: the pools' last
    windows overhang), the pool blocked between the convs, against torch at batch 1 and 8."""
    pool = {"max": nn.max_pool2d, "avg": nn.avg_pool2d}[kind]

    def body(x: relax.Expr) -> relax.Expr:
        y = pool(nn.relu(nn.conv2d(x, relax.const(W3), padding=1)), kernel, stride, pad,
                 count_include_pad=include_pad)
        return nn.conv2d(y, relax.const(W2))

    x = RNG.standard_normal((batch, 36, 19, 19)).astype(np.float32)
    mod = relax_module([x.shape], body)
    assert _calls(mod, TARGET) == [BLOCKED_NAME, BLOCKED_NAME, "from_blocked"]
    t = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(W3).double(), padding=1))
    t = torch.nn.functional.max_pool2d(t, kernel, stride, pad) if kind == "max" else \
        torch.nn.functional.avg_pool2d(t, kernel, stride, pad, count_include_pad=include_pad)
    want = torch.nn.functional.conv2d(t, torch.from_numpy(W2).double()).numpy()
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-4, atol=1e-4)


DEPTHWISE = np.random.default_rng(4).standard_normal((36, 1, 3, 3)).astype(np.float32)


def _depthwise_chain(x: relax.Expr, stride: int = 1, dilation: int = 1) -> relax.Expr:
    """1x1 conv + relu, a 3x3 depthwise conv (36 channels: a partial last block), relu, 1x1 conv."""
    y = nn.relu(nn.conv2d(x, relax.const(W2)))
    y = nn.relu(nn.conv2d(y, relax.const(DEPTHWISE), strides=stride, padding=dilation, dilation=dilation, groups=36))
    return nn.conv2d(y, relax.const(W2))


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_depthwise_conv_inside_a_region_adds_no_layout_change(target: tvm.target.Target) -> None:
    """Issue 13: "depthwise convs that read and write the blocked layout inside a region": between two blocked
    1x1 convs it is a blocked kernel too, and the chain converts once, out (before: `from_blocked` into it)."""
    names = _calls(relax_module([(2, 36, 18, 18)], _depthwise_chain), target)
    assert names == [BLOCKED_NAME, DEPTHWISE_NAME, BLOCKED_NAME, "from_blocked"], names


@pytest.mark.parametrize(("batch", "width", "stride", "dilation"), [(8, 19, 2, 1), (1, 19, 1, 2)],
                         ids=["s2-batch-8", "dilated-s1"])
def test_blocked_depthwise_convs_match_torch(batch: int, width: int, stride: int, dilation: int) -> None:
    """The chain above, strided at batch 8 and dilated at batch 1, on a 19-wide map (odd), against torch."""
    x = RNG.standard_normal((batch, 36, width, width)).astype(np.float32)
    mod = relax_module([x.shape], lambda v: _depthwise_chain(v, stride, dilation))
    assert DEPTHWISE_NAME in _calls(mod, TARGET)
    t = {k: torch.from_numpy(v).double() for k, v in dict(x=x, w=W2, d=DEPTHWISE).items()}
    y = torch.relu(torch.nn.functional.conv2d(t["x"], t["w"]))
    y = torch.relu(torch.nn.functional.conv2d(y, t["d"], stride=stride, padding=dilation, dilation=dilation,
                                              groups=36))
    want = torch.nn.functional.conv2d(y, t["w"]).numpy()
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-4, atol=1e-4)


def test_without_block_convs_the_program_stays_nchw() -> None:
    """`block_convs=False` gives the old program: NCHW convs, no conversion."""
    with AVX2:
        out = tvm.transform.Sequential(cpu_fusion_passes(AVX2, fast_math=False, block_convs=False))(
            relax_module([(2, 20, 36, 36)], _chain))
    names = [g.name_hint for g, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not [n for n in names if "blocked" in n] and any("conv2d" in n for n in names), names


def _run(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False))
    return relax.VirtualMachine(exe, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


def test_the_blocked_chain_matches_torch() -> None:
    """The chain above (batch 2, strided, 1x1, 3x3, bias, scale/shift, clip, residual) equals torch's."""
    x = RNG.standard_normal((2, 20, 36, 36)).astype(np.float32)
    assert BLOCKED_NAME in _calls(relax_module([x.shape], _chain), TARGET)
    np.testing.assert_allclose(_run(relax_module([x.shape], _chain), x), _torch_chain(x), rtol=1e-4, atol=1e-4)


def _kiln_graph() -> tuple[object, dict[str, np.ndarray]]:
    """conv + bias -> batch norm (running statistics) -> relu -> conv on 20 channels, 18 wide, batch 2, as kiln's
    layers lower them (the batch norm as subtract, multiply and add of per-channel vectors)."""
    rng = np.random.default_rng(2)
    shapes = dict(w1=(20, 20, 3, 3), b1=(20,), gamma=(20,), beta=(20,), mean=(20,), var=(20,), w2=(20, 20, 3, 3))
    data = {k: rng.standard_normal(s).astype(np.float32) / 4 for k, s in shapes.items()}
    data["var"] = np.abs(data["var"]) + 0.5
    b = Builder("Block")
    x = b.input("x", ((2, 20, 18, 18), "f32"))
    p = {k: b.param(k, v.shape, data=v) for k, v in data.items()}
    y = b.conv2d(x, p["w1"], p["b1"], padding=(1, 1))
    y = b.relu(b.batch_norm(y, p["gamma"], p["beta"], p["mean"], p["var"], b.flag("training", False))[0])
    b.ret(b.conv2d(y, p["w2"], padding=(1, 1)))
    return b.build(), data


def test_a_kiln_conv_batch_norm_relu_conv_is_one_region() -> None:
    """Batch norm with running statistics folds to a per-channel scale and shift: kiln's lowering of conv, batch
    norm, relu, conv reads NCHW once (the first conv) and converts once out."""
    names = _calls(lower(_kiln_graph()[0]).module, AVX2)
    assert names == [BLOCKED_NAME, BLOCKED_NAME, "from_blocked"], names


@pytest.mark.parametrize("params", ["bound", "inputs"])
def test_the_kiln_block_matches_torch(params: str) -> None:
    """The block above through `compile_graph`, weights bound (packed at build time) or inputs (packed by kernels),
    against torch's conv2d and batch_norm in eval mode."""
    graph, d = _kiln_graph()
    x = np.random.default_rng(3).standard_normal((2, 20, 18, 18)).astype(np.float32)
    got = compile_graph(graph, target=TARGET, params=params, fast_math=False)(x)
    t = {k: torch.from_numpy(v).double() for k, v in d.items()}
    y = torch.nn.functional.conv2d(torch.from_numpy(x).double(), t["w1"], t["b1"], padding=1)
    y = torch.relu(torch.nn.functional.batch_norm(y, t["mean"], t["var"], t["gamma"], t["beta"], eps=1e-5))
    want = torch.nn.functional.conv2d(y, t["w2"], padding=1).numpy()
    np.testing.assert_allclose(np.asarray(got[0] if isinstance(got, (list, tuple)) else got), want,
                               rtol=1e-4, atol=1e-4)


BATCH = tvm.tirx.Var("batch", "int64")  # a dynamic batch, as an ONNX model exported with `dynamic_axes` has


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_dynamic_batch_keeps_the_region_blocked(target: tvm.target.Target) -> None:
    """A symbolic batch changes nothing of the region: its kernels need every dim but the batch (before, any
    symbolic dim left the whole network NCHW, and an imported MobileNetV3-Large ran 3.3x onnxruntime)."""
    names = _calls(relax_module([(BATCH, 20, 36, 36)], _chain), target)
    assert names == [BLOCKED_NAME, BLOCKED_NAME, BLOCKED_NAME, "from_blocked"], names


def test_the_dynamic_batch_chain_matches_torch_at_every_batch() -> None:
    """One build of the chain over a symbolic batch, run at batch 1 and 3, against torch."""
    mod = relax_module([(BATCH, 20, 36, 36)], _chain)
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 20, 36, 36)).astype(np.float32)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), _torch_chain(x), rtol=1e-4, atol=1e-4)


SE = {k: RNG.standard_normal(s).astype(np.float32) / 4 for k, s in dict(
    w1=(32, 32, 1, 1), b=(32, 1, 1), s1=(8, 32, 1, 1), s2=(32, 8, 1, 1), w3=(32, 32, 3, 3)).items()}


def _squeeze_excite(x: relax.Expr) -> relax.Expr:
    """MobileNetV3's block tail over 32 channels (blocked on AVX2 and AVX-512): 1x1 conv + bias + hard-swish (as
    ONNX import spells it), global average pool, 1x1 conv + relu, 1x1 conv + hard-sigmoid, the map times that
    per-image gate, and a 3x3 conv."""
    c, op = relax.const, relax.op

    def hard_sigmoid(v: relax.Expr) -> relax.Expr:
        return op.minimum(op.maximum(op.add(op.multiply(v, c(1 / 6, "float32")), c(0.5, "float32")),
                                     c(0.0, "float32")), c(1.0, "float32"))

    y = op.add(nn.conv2d(x, c(SE["w1"])), c(SE["b"]))
    y = op.multiply(y, hard_sigmoid(y))
    squeeze = nn.relu(nn.conv2d(op.mean(y, axis=[2, 3], keepdims=True), c(SE["s1"])))
    return nn.conv2d(op.multiply(y, hard_sigmoid(nn.conv2d(squeeze, c(SE["s2"])))), c(SE["w3"]), padding=1)


def _torch_squeeze_excite(x: np.ndarray) -> np.ndarray:
    f = torch.nn.functional
    t = {k: torch.from_numpy(v).double() for k, v in dict(SE, x=x).items()}
    y = f.hardswish(f.conv2d(t["x"], t["w1"]) + t["b"])
    gate = f.hardsigmoid(f.conv2d(torch.relu(f.conv2d(y.mean((2, 3), keepdim=True), t["s1"])), t["s2"]))
    return f.conv2d(y * gate, t["w3"], padding=1).numpy()


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_squeeze_excite_stays_blocked(target: tvm.target.Target) -> None:
    """The global average pool of a blocked map is blocked, so are the squeeze-excite's 1x1 convs over it and the
    product of the map with its per-image gate: the block converts once, out (before, the pool and the product
    left the region: a `from_blocked` of the map, NCHW gate and product, and the map's next conv read NCHW)."""
    names = _calls(relax_module([(BATCH, 32, 14, 14)], _squeeze_excite), target)
    assert names == [BLOCKED_NAME] * 4 + ["from_blocked"], names


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_1x1_convs_epilogue_fuses_into_its_kernel(target: tvm.target.Target) -> None:
    """A 1x1 conv computes its map as pixel rows; its bias and hard-swish are computed on those rows, so they fuse
    into the conv's kernel (reshaped back to the map between them, they were a kernel of their own: a second pass
    over the map)."""
    with target:
        fused = tvm.transform.Sequential(cpu_fusion_passes(target, fast_math=False))(
            relax_module([(BATCH, 32, 14, 14)], _squeeze_excite))
    names = [g.name_hint for g, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any(n.startswith(f"fused_{BLOCKED_NAME}") and "add" in n and "minimum" in n for n in names), names
    assert not any(n.startswith("fused_reshape") for n in names), names


def test_the_squeeze_excite_matches_torch_at_every_batch() -> None:
    """One build over a symbolic batch, run at batch 1 and 2, against torch's hardswish, mean and hardsigmoid."""
    mod = relax_module([(BATCH, 32, 14, 14)], _squeeze_excite)
    vm = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False)),
                              tvm.cpu())
    for batch in (1, 2):
        x = RNG.standard_normal((batch, 32, 14, 14)).astype(np.float32)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), _torch_squeeze_excite(x),
                                   rtol=1e-4, atol=1e-4)


def _bottleneck_tail(x: relax.Expr) -> relax.Expr:
    """A 3x3 conv + relu (a blocked map), then a 1x1 conv whose sum with that map (ResNet's residual) is relu'd."""
    c, op = relax.const, relax.op
    y = nn.relu(nn.conv2d(x, c(SE["w3"]), padding=1))
    return nn.relu(op.add(op.add(nn.conv2d(y, c(SE["w1"])), c(SE["b"])), y))


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_residual_add_fuses_into_the_1x1_convs_kernel(target: tvm.target.Target) -> None:
    """The skip branch's map is viewed as pixel rows, so the residual add and relu fuse into the 1x1 conv (before,
    ResNet-50's 13 residual adds were kernels of their own: a third pass over two maps)."""
    with target:
        fused = tvm.transform.Sequential(cpu_fusion_passes(target, fast_math=False))(
            relax_module([(BATCH, 32, 14, 14)], _bottleneck_tail))
    names = [g.name_hint for g, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any(n.startswith(f"fused_{BLOCKED_NAME}") and n.count("add") == 2 and "relu" in n for n in names), names
    assert not any(n.startswith("fused_add") for n in names), names


def test_the_bottleneck_tail_matches_torch() -> None:
    """The fused residual against torch, over a symbolic batch run at batch 2."""
    mod = relax_module([(BATCH, 32, 14, 14)], _bottleneck_tail)
    vm = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False)),
                              tvm.cpu())
    f, x = torch.nn.functional, RNG.standard_normal((2, 32, 14, 14)).astype(np.float32)
    t = {k: torch.from_numpy(v).double() for k, v in dict(SE, x=x).items()}
    y = torch.relu(f.conv2d(t["x"], t["w3"], padding=1))
    want = torch.relu(f.conv2d(y, t["w1"]) + t["b"] + y).numpy()
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want, rtol=1e-4, atol=1e-4)
