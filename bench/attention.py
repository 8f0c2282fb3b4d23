"""The fused attention kernel's two variants on this CPU, in one process: f32 against bf16 pairs
(`runtime/tvm/attention.py`), as kernels and inside bf16 encoder layers.

    .venv/bin/python bench/attention.py [--rounds 7] [--kernels 6x8x197x64 ...] [--layers 768x8x197 ...]

Kernels (batch x heads x tokens x d, d = dv, scale 1/8): `attention_kernel` of both variants built for this host.
Layers (d x batch x tokens, `inference.encoder_widths(d)`): the bf16 build twice, the attention pass told to leave
the products f32 in one. Both are timed interleaved (`timing.interleaved`, without waiting for a quiet host): ms =
median of per-round medians, ratio = median of per-round ratios. The pairs variant needs 512-bit `vdpbf16ps`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import numpy as np
import tvm
from inference import encoder_widths, traced  # bench/ is the script's directory
from roofline import cpu_model as cpu_name
from timing import SETTLE_S, Runner, interleaved

import kiln
from kiln import nn
from kiln.runtime.tvm import pipeline
from kiln.runtime.tvm.attention import Attention, attention_kernel
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.target import configure_threads, cpu_count, cpu_target

KERNELS = ("6x8x197x64", "8x12x197x64", "8x12x128x64", "1x12x128x64", "1x8x512x64", "1x4x50x64", "2x16x100x128")
LAYERS = ("768x8x197", "768x1x197", "768x8x128", "512x8x128", "256x8x128")


def kernel_runners(batch: int, heads: int, tokens: int, d: int) -> tuple[dict[str, Runner], float]:
    """(both variants of the kernel on random operands, the work in GFLOP)."""
    target = cpu_target()
    model = cpu_model(target)
    rng = np.random.default_rng(0)
    shapes = [(batch, heads, tokens, d)] * 4
    out: dict[str, Runner] = {}
    for name, pairs in (("f32", False), ("pairs", True)):
        spec = Attention(heads, tokens, tokens, d, d, 0.125, pairs=pairs)
        func = attention_kernel(spec, model).with_attr("global_symbol", "main")
        kernel = pipeline.cpu_compile(tvm.IRModule({"main": func}), target, "default").jit()["main"]
        args = [tvm.runtime.tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        out[name] = (lambda k, a: lambda: k(*a))(kernel, args)
    return out, 4 * batch * heads * tokens * tokens * d / 1e9


def layer_runners(d: int, batch: int, tokens: int) -> dict[str, Runner]:
    """The bf16 encoder layer with attention on the f32 kernel and on the pairs kernel (uncached builds)."""
    graph = traced(nn.TransformerEncoderLayer(*encoder_widths(d)), (batch, tokens, d))
    x = kiln.aligned(np.random.default_rng(1).standard_normal((batch, tokens, d)).astype(np.float32))
    pairing = pipeline.fused_attention
    try:
        pipeline.fused_attention = lambda target, bf16=False: pairing(target, False)
        f32 = compile_graph(graph, precision="bf16", cache=False)
    finally:
        pipeline.fused_attention = pairing
    pairs = compile_graph(graph, precision="bf16", cache=False)
    return {"f32": lambda: f32(x), "pairs": lambda: pairs(x)}


def table(rows: list[str], make: Callable[[list[int]], tuple[dict[str, Runner], float | None]], rounds: int,
          header: str) -> list[str]:
    """A markdown table, a row per entry of `rows` (its dims, as `make` takes them): both variants' ms and their
    ratio, and the pairs kernel's GFLOP/s where `make` gives the work."""
    cells = []
    for row in rows:
        runners, gflop = make([int(v) for v in row.split("x")])
        per_round = interleaved(runners, rounds, quiet=False, settle_s=SETTLE_S)
        f32, pairs = (statistics.median(per_round[name]) for name in ("f32", "pairs"))
        ratio = statistics.median(p / f for p, f in zip(per_round["pairs"], per_round["f32"], strict=True))
        cells.append([row, f"{f32:.3f}", f"{pairs:.3f}", f"{ratio:.3f}",
                      *([] if gflop is None else [f"{gflop / pairs * 1e3:.0f}"])])
        print(" ".join(cells[-1]), file=sys.stderr, flush=True)
    names = [header, "f32 ms", "pairs ms", "pairs / f32", "pairs GFLOP/s"][:len(cells[0])]
    return [f"| {' | '.join(names)} |", "|---" + "|---:" * (len(names) - 1) + "|",
            *(f"| {' | '.join(c)} |" for c in cells)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), help="BxHxSxD")
    parser.add_argument("--layers", nargs="*", default=list(LAYERS), help="DxBxS")
    args = parser.parse_args()
    configure_threads()
    if not Attention(1, 16, 16, 32, 16, 1.0).takes_pairs(cpu_model(cpu_target())):
        raise SystemExit("this CPU has no 512-bit vdpbf16ps (AVX512-BF16): no pairs kernel to time")
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}`: {cpu_name()}, {cpu_count()} threads, load average "
             f"{os.getloadavg()[0]:.1f} at the start; ms = median of per-round medians, ratio = median of per-round "
             "ratios", ""]
    if args.kernels:
        lines += [*table(args.kernels, lambda dims: kernel_runners(*dims), args.rounds, "kernel (BxHxSxD)"), ""]
    if args.layers:
        lines += table(args.layers, lambda dims: (layer_runners(*dims), None), args.rounds, "bf16 layer (DxBxS)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
