"""Issue 13's worst kernels against onnxruntime, one thread each: strided, dilated and depthwise convs at 56²-112²
(and the matrix's depthwise convs, 56²-7²), 3x3/2 and 2x2 pools and the attention batched matmuls (K = 64, 197
tokens), next to the stride-1 3x3 and 1x1 convs at 56²-7² and a ResNet basic block (two 3x3 convs, residual add
and relus) they are measured against; `conv-7` and `conv-1x1-56` are ResNet-50's last-stage convs (512-2048
channels on 7² maps, batch 1 and 8) and its bottleneck 1x1 convs at 56².

Run from the repository root:

    .venv/bin/python bench/worst_kernels.py [--only conv-s2 bmm ...]

Times are process CPU time (best of 5 blocks of 3 calls), which a host shared with other jobs distorts less than
the wall clock; onnxruntime runs the same kernel as one ONNX node (conv weights as initializers, which MLAS
pre-packs) in the same process, right after kiln's. Conv weights are bound constants in kiln's build too (as a
`params="bound"` build makes them), so its layout step packs them once at build time and keeps a block's
activations NCHW[x]c from conv to conv (`runtime/tvm/conv_regions.py`); the "kiln NCHW" column is the same build
with that step off (`cpu_pipeline(block_convs=False)`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ["TVM_NUM_THREADS"] = "1"  # before TVM's pool starts

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.target import cpu_target

# name, shapes (x first), body, FLOPs, ONNX nodes (reading "x" and "w", "w2", ...; writing "y")
Case = tuple[str, list[tuple[int, ...]], Callable[..., relax.Expr], int, list[onnx.NodeProto]]


def conv(n: int, c: int, h: int, k: int, stride: int = 1, dilation: int = 1, groups: int = 1, size: int = 3) -> Case:
    """A `size` x `size` conv with 'same' padding for stride 1."""
    pad = dilation * (size // 2)
    out = (h + 2 * pad - dilation * (size - 1) - 1) // stride + 1
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride] * 2, pads=[pad] * 4,
                            dilations=[dilation] * 2, group=groups)
    return (f"conv {size}x{size}/s{stride}/d{dilation}/g{groups} {n}x{c}x{h}²->{k}",
            [(n, c, h, h), (k, c // groups, size, size)],
            lambda x, w: relax.op.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation, groups=groups),
            2 * n * k * (c // groups) * size * size * out * out, [node])


def stage(n: int, c: int, h: int) -> Case:
    """A ResNet basic block: relu(conv(relu(conv(x))) + x), both convs 3x3 with c channels."""
    nn = relax.op.nn
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], pads=[1] * 4), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1] * 4), helper.make_node("Add", ["c", "x"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    return (f"stage 2x conv 3x3 {n}x{c}x{h}², add, relu", [(n, c, h, h), (c, c, 3, 3), (c, c, 3, 3)],
            lambda x, w, w2: nn.relu(relax.op.add(nn.conv2d(nn.relu(nn.conv2d(x, w, padding=1)), w2, padding=1), x)),
            2 * 2 * n * c * c * 9 * h * h, nodes)


def bmm(b: int, m: int, k: int, n: int) -> Case:
    return (f"bmm {b}x{m}x{k}x{n}", [(b, m, k), (b, k, n)], relax.op.matmul, 2 * b * m * k * n,
            [helper.make_node("MatMul", ["x", "w"], ["y"])])


def pool(kind: str, n: int, c: int, h: int, size: int, stride: int, pad: int) -> Case:
    """A max or average (padding counted) pool; its FLOPs one per window element."""
    out = (h + 2 * pad - size) // stride + 1
    node = helper.make_node(f"{kind.capitalize()}Pool", ["x"], ["y"], kernel_shape=[size] * 2, strides=[stride] * 2,
                            pads=[pad] * 4, **({"count_include_pad": 1} if kind == "average" else {}))
    window = {"max": relax.op.nn.max_pool2d, "average": relax.op.nn.avg_pool2d}[kind]
    extra = {"count_include_pad": True} if kind == "average" else {}
    return (f"{kind} pool {size}x{size}/s{stride}/p{pad} {n}x{c}x{h}²", [(n, c, h, h)],
            lambda x: window(x, size, stride, pad, **extra), n * c * out * out * size * size, [node])


GROUPS: dict[str, Callable[[], list[Case]]] = {
    "conv-s1": lambda: [conv(1, 64, 56, 64), conv(1, 128, 28, 128), conv(1, 256, 14, 256), conv(1, 256, 7, 256)],
    "conv-1x1": lambda: [conv(1, 64, 56, 256, size=1), conv(1, 128, 28, 128, size=1), conv(1, 256, 14, 256, size=1),
                         conv(1, 256, 7, 256, size=1)],
    "conv-7": lambda: [conv(1, 512, 7, 512), conv(1, 512, 7, 2048, size=1), conv(1, 2048, 7, 512, size=1),
                       conv(8, 512, 7, 512), conv(8, 2048, 7, 512, size=1)],  # ResNet-50's last stage
    "conv-1x1-56": lambda: [conv(1, 64, 56, 64, size=1), conv(1, 256, 56, 64, size=1), conv(8, 64, 56, 256, size=1)],
    "stage": lambda: [stage(1, 64, 56), stage(1, 128, 28), stage(1, 256, 14)],
    "conv-s2": lambda: [conv(1, 64, 56, 128, 2), conv(1, 128, 56, 128, 2), conv(1, 256, 28, 256, 2),
                        conv(3, 256, 28, 64, 2)],
    "conv-dilated": lambda: [conv(1, 64, 56, 64, dilation=2), conv(1, 128, 28, 128, dilation=2)],
    "bmm": lambda: [bmm(48, 197, 64, 197), bmm(48, 197, 197, 64), bmm(12, 197, 64, 197)],
    "depthwise": lambda: [conv(1, 32, 112, 32, groups=32), conv(1, 96, 56, 96, groups=96),
                          conv(1, 32, 112, 32, 2, groups=32), conv(1, 96, 56, 96, 2, groups=96)],
    "depthwise-matrix": lambda: [conv(1, c, h, c, groups=c) for c, h in ((64, 56), (128, 28), (256, 14), (512, 7))],
    "pool": lambda: [pool("max", 1, 64, 112, 3, 2, 1), pool("average", 1, 64, 56, 3, 2, 1),
                     pool("max", 1, 96, 27, 3, 2, 0), pool("max", 8, 64, 56, 2, 2, 0)],
}


def _ms(run: Callable[[], object]) -> float:
    run()
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(3):
            run()
        best = min(best, (time.process_time() - start) / 3 * 1e3)
    return best


def _bound(name: str) -> bool:
    """Whether the case's weights are constants (convs), not inputs (batched matmuls)."""
    return not name.startswith("bmm")


def _onnxruntime(case: Case, x: np.ndarray, *ws: np.ndarray) -> Callable[[], object]:
    name, shapes, _, _, nodes = case
    constant = _bound(name)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes[0])]
    if not constant:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, shapes[1]))
    names = ["w", *(f"w{i}" for i in range(2, len(ws) + 1))]
    initializers = [numpy_helper.from_array(w, n) for n, w in zip(names, ws)] if constant else []
    graph = helper.make_graph(nodes, "kernel", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": x} if constant else {"x": x, "w": ws[0]}
    return lambda: session.run(None, feeds)


def _kiln_ms(module: tvm.IRModule, args: list, target: tvm.target.Target, block_convs: bool) -> float:
    """kiln's time, with convs blocked where the CPU model says so, or all of them NCHW (the A/B column)."""
    library = cpu_compile(module, target, cpu_pipeline(target, block_convs=block_convs))
    main_fn = relax.VirtualMachine(library, tvm.cpu())["main"]
    return _ms(lambda: main_fn(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(GROUPS), default=sorted(GROUPS))
    groups = parser.parse_args().only
    target = cpu_target()
    print(f"load {os.getloadavg()[0]:.1f}; 1 thread, CPU time")
    print("| kernel | kiln NCHW ms | kiln ms | kiln GFLOP/s | onnxruntime ms | onnxruntime GFLOP/s | vs onnxruntime |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for group in groups:
        for case in GROUPS[group]():
            name, shapes, body, flops, _ = case
            rng = np.random.default_rng(0)
            x, *ws = (rng.standard_normal(s).astype(np.float32) for s in shapes)
            if _bound(name):
                module = relax_module(shapes[:1], lambda v, f=body, c=ws: f(v, *(relax.const(w) for w in c)))
                args = [tvm.runtime.tensor(x)]
            else:
                module, args = relax_module(shapes, body), [tvm.runtime.tensor(a) for a in (x, *ws)]
            nchw_ms, kiln_ms = (_kiln_ms(module, args, target, block) for block in (False, True))
            ort_ms = _ms(_onnxruntime(case, x, *ws))
            print(f"| {name} | {nchw_ms:.3f} | {kiln_ms:.3f} | {flops / kiln_ms / 1e6:.1f} | {ort_ms:.3f} | "
                  f"{flops / ort_ms / 1e6:.1f} | {kiln_ms / ort_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
