"""Issue 13's worst kernels against onnxruntime, one thread each: strided, dilated and depthwise convs at 56²-112²
and the attention batched matmuls (K = 64, 197 tokens), next to the stride-1 3x3 conv they are measured against.

Run from the repository root:

    .venv/bin/python bench/worst_kernels.py [--only conv-s2 bmm ...]

Times are process CPU time (best of 5 blocks of 3 calls), which a host shared with other jobs distorts less than
the wall clock; onnxruntime runs the same kernel as one ONNX node (conv weights as initializers, which MLAS
pre-packs) in the same process, right after kiln's.
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
from kiln.runtime.tvm.pipeline import cpu_pipeline
from kiln.runtime.tvm.target import cpu_target

Case = tuple[str, list[tuple[int, ...]], Callable[..., relax.Expr], int, onnx.NodeProto]


def conv(n: int, c: int, h: int, k: int, stride: int = 1, dilation: int = 1, groups: int = 1) -> Case:
    """A 3x3 conv with 'same' padding for stride 1."""
    pad = dilation
    out = (h + 2 * pad - 2 * dilation - 1) // stride + 1
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride] * 2, pads=[pad] * 4,
                            dilations=[dilation] * 2, group=groups)
    return (f"conv 3x3/s{stride}/d{dilation}/g{groups} {n}x{c}x{h}²->{k}", [(n, c, h, h), (k, c // groups, 3, 3)],
            lambda x, w: relax.op.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation, groups=groups),
            2 * n * k * (c // groups) * 9 * out * out, node)


def bmm(b: int, m: int, k: int, n: int) -> Case:
    return (f"bmm {b}x{m}x{k}x{n}", [(b, m, k), (b, k, n)], relax.op.matmul, 2 * b * m * k * n,
            helper.make_node("MatMul", ["x", "w"], ["y"]))


GROUPS: dict[str, Callable[[], list[Case]]] = {
    "conv-s1": lambda: [conv(1, 64, 56, 64), conv(1, 128, 28, 128), conv(1, 256, 14, 256)],
    "conv-s2": lambda: [conv(1, 64, 56, 128, 2), conv(1, 128, 56, 128, 2), conv(1, 256, 28, 256, 2),
                        conv(3, 256, 28, 64, 2)],
    "conv-dilated": lambda: [conv(1, 64, 56, 64, dilation=2), conv(1, 128, 28, 128, dilation=2)],
    "bmm": lambda: [bmm(48, 197, 64, 197), bmm(48, 197, 197, 64), bmm(12, 197, 64, 197)],
    "depthwise": lambda: [conv(1, 32, 112, 32, groups=32), conv(1, 96, 56, 96, groups=96),
                          conv(1, 32, 112, 32, 2, groups=32), conv(1, 96, 56, 96, 2, groups=96)],
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


def _onnxruntime(case: Case, x: np.ndarray, w: np.ndarray) -> Callable[[], object]:
    name, shapes, _, _, node = case
    constant = name.startswith("conv")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes[0])]
    if not constant:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, shapes[1]))
    graph = helper.make_graph([node], "kernel", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(w, "w")] if constant else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": x} if constant else {"x": x, "w": w}
    return lambda: session.run(None, feeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(GROUPS), default=sorted(GROUPS))
    groups = parser.parse_args().only
    target = cpu_target()
    print(f"load {os.getloadavg()[0]:.1f}; 1 thread, CPU time")
    print("| kernel | kiln ms | kiln GFLOP/s | onnxruntime ms | onnxruntime GFLOP/s | vs onnxruntime |\n"
          "|---|---:|---:|---:|---:|---:|")
    for group in groups:
        for case in GROUPS[group]():
            name, shapes, body, flops, _ = case
            rng = np.random.default_rng(0)
            x, w = (rng.standard_normal(s).astype(np.float32) for s in shapes)
            library = tvm.compile(relax_module(shapes, body), target=target, relax_pipeline=cpu_pipeline(target))
            main_fn = relax.VirtualMachine(library, tvm.cpu())["main"]
            args = [tvm.runtime.tensor(x), tvm.runtime.tensor(w)]
            kiln_ms = _ms(lambda f=main_fn, a=args: f(*a))
            ort_ms = _ms(_onnxruntime(case, x, w))
            print(f"| {name} | {kiln_ms:.3f} | {flops / kiln_ms / 1e6:.1f} | {ort_ms:.3f} | "
                  f"{flops / ort_ms / 1e6:.1f} | {kiln_ms / ort_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
