"""Property-style CPU benchmark: random shapes from issue 13's ranges, kiln against onnxruntime, OpenVINO (f32) and
torch eager on each, reporting every ratio and, per peer, the worst ratio and the geometric mean.

    .venv/bin/python bench/shapes.py [--count 24] [--seed 0] [--rounds 3] [--markdown out.md]

Kernel classes, drawn in turn: linear (M 1..4096, batch 1 or batched, widths such as 10, 77, 1000), attention
(K = 64 score and context matmuls), conv2d (1x1, 3x3, 5x5, 7x7, depthwise, strided, dilated at 7..56), pooling,
softmax / layer-norm rows of 64..4096, and attention-head transposes. Shapes are drawn from `--seed`, the work of a
case is capped so one call stays under ~0.5 GFLOP, and every engine runs the same ONNX file (torch its own
functionals with the same weights); kiln's output is checked against onnxruntime's first. Blocks are timed without
waiting for a quiet host but after a pause (`timing.SETTLE_S`) that lets the previous engine's spinning
threads go idle; "vs X" is kiln's time over X's (median of per-round ratios, above 1 = kiln slower).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from inference import traced  # bench/ is the script's directory
from peers import onnxruntime_runner, openvino_runner, openvino_version
from roofline import cpu_model, graph_flops, peak_gflops
from timing import SETTLE_S, Runner, interleaved

import kiln
from kiln import nn
from kiln.frontend.module import Module
from kiln.frontend.tensor import Tensor, apply
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.target import configure_threads, cpu_count

TorchFn = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
MAX_MACS = 2.5e8  # per call: keeps a case's timing blocks to a second or two
WIDTHS = (10, 77, 1000, 64, 128, 256, 384, 768, 1024)


@dataclass
class Case:
    """One drawn shape: the kernel class, a readable shape, the kiln module and input, torch's version of it."""

    kernel: str
    label: str
    module: Module
    shape: tuple[int, ...]
    torch_fn: TorchFn


class _Attention(Module):
    """softmax(x @ xᵀ / 8) @ x over [batch, heads, seq, 64]: the K = 64 score matmul and the context matmul."""

    def forward(self, x: Tensor) -> Tensor:
        scores = apply("matmul", x, apply("transpose", x, perm=(0, 1, 3, 2))) * 0.125
        return apply("matmul", nn.functional.softmax(scores), x)


class _Heads(Module):
    """[batch, seq, heads·d] -> [batch, heads, seq, d]: the attention-head split."""

    def __init__(self, heads: int, d: int):
        self.heads, self.d = heads, d

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        return apply("transpose", x.reshape(b, s, self.heads, self.d), perm=(0, 2, 1, 3))


class _Softmax(Module):
    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.softmax(x)


def _cap(n: int, macs_per_unit: int) -> int:
    """`n` shrunk so that n x macs_per_unit stays under MAX_MACS (at least 1)."""
    return max(1, min(n, int(MAX_MACS // max(1, macs_per_unit))))


def _linear(rng: np.random.Generator) -> Case:
    k, n = (int(rng.choice(WIDTHS)) for _ in range(2))
    m = _cap(int(2 ** rng.uniform(0, 12)), k * n)
    shape = (m, k) if rng.random() < 0.5 or m < 8 else (int(rng.choice((2, 3, 8))), max(1, m // 8), k)
    return Case("linear", f"{'x'.join(map(str, shape))} -> {n}", nn.Linear(k, n), shape,
                lambda w, x: x @ w["weight"] + w["bias"])


def _attention(rng: np.random.Generator) -> Case:
    heads, seq = int(rng.choice((4, 8, 12))), int(rng.choice((16, 50, 77, 128, 197, 256)))
    batch = _cap(int(rng.choice((1, 1, 2, 8))), 2 * heads * seq * seq * 64)
    return Case("attention K=64", f"b{batch} h{heads} s{seq} d64", _Attention(), (batch, heads, seq, 64),
                lambda w, x: F.softmax(x @ x.transpose(-1, -2) * 0.125, dim=-1) @ x)


_CONVS = {"1x1": (1, 1, 1, False), "3x3": (3, 1, 1, False), "5x5": (5, 1, 1, False), "7x7": (7, 1, 1, False),
          "depthwise 3x3": (3, 1, 1, True), "strided 3x3/2": (3, 2, 1, False), "dilated 3x3 d2": (3, 1, 2, False)}


def _conv(rng: np.random.Generator) -> Case:
    kind = str(rng.choice(list(_CONVS)))
    k, stride, dilation, depthwise = _CONVS[kind]
    size, cin = int(rng.choice((7, 14, 28, 56))), int(rng.choice((16, 24, 32, 64, 96, 128, 256)))
    cout = cin if depthwise else int(rng.choice((16, 32, 64, 128, 256)))
    groups, pad = (cin if depthwise else 1), k // 2 * dilation
    batch = _cap(int(rng.choice((1, 1, 3, 8))), (size // stride) ** 2 * cout * (cin // groups) * k * k)
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=pad, dilation=dilation, groups=groups)
    return Case(f"conv {kind}", f"{batch}x{cin}x{size}x{size} -> {cout}", conv, (batch, cin, size, size),
                lambda w, x: F.conv2d(x, w["weight"], w["bias"], stride, pad, dilation, groups))


def _pool(rng: np.random.Generator) -> Case:
    size, channels, batch = int(rng.choice((14, 28, 56, 112))), int(rng.choice((32, 64, 128, 256))), int(
        rng.choice((1, 3, 8)))
    shape = (batch, channels, size, size)
    if rng.random() < 0.5:
        return Case("max pool 3x3/2", "x".join(map(str, shape)), nn.MaxPool2d(3, stride=2, padding=1), shape,
                    lambda w, x: F.max_pool2d(x, 3, 2, 1))
    return Case("avg pool 2x2/2", "x".join(map(str, shape)), nn.AvgPool2d(2, stride=2), shape,
                lambda w, x: F.avg_pool2d(x, 2, 2))


def _rows(rng: np.random.Generator) -> Case:
    d = int(2 ** rng.uniform(6, 12)) if rng.random() < 0.6 else int(rng.choice((77, 1000, 768, 4096)))
    shape = (_cap(int(rng.choice((1, 8, 128, 1024))), 64 * d), d)
    label = "x".join(map(str, shape))
    if rng.random() < 0.5:
        return Case("softmax rows", label, _Softmax(), shape, lambda w, x: F.softmax(x, dim=-1))
    return Case("layer norm rows", label, nn.LayerNorm(d), shape,
                lambda w, x: F.layer_norm(x, (d,), w["gamma"], w["beta"], 1e-5))


def _heads(rng: np.random.Generator) -> Case:
    heads, d, seq, batch = int(rng.choice((4, 8, 12, 16))), int(rng.choice((32, 64))), int(
        rng.choice((77, 128, 197, 512))), int(rng.choice((1, 8)))
    return Case("head transpose", f"b{batch} s{seq} h{heads} d{d}", _Heads(heads, d), (batch, seq, heads * d),
                lambda w, x: x.view(batch, seq, heads, d).permute(0, 2, 1, 3).contiguous())


DRAWS = (_linear, _attention, _conv, _pool, _rows, _heads)


def draw(count: int, seed: int) -> list[Case]:
    """`count` cases, the kernel classes in turn, shapes from one seeded generator."""
    rng = np.random.default_rng(seed)
    return [DRAWS[i % len(DRAWS)](rng) for i in range(count)]


def runners(case: Case, folder: Path, threads: int, index: int) -> tuple[dict[str, Runner], int]:
    """Every engine on one case (kiln checked against onnxruntime), and the case's matmul/conv FLOPs."""
    graph = traced(case.module, case.shape, seed=index)
    x = kiln.aligned(np.random.default_rng(index).standard_normal(case.shape).astype(np.float32))
    exe = kiln.compile(graph)
    path = folder / f"case{index}.onnx"
    path.write_bytes(to_onnx(graph).SerializeToString())
    name = graph.functions["forward"].args[0].name
    feeds = {name: x}
    out: dict[str, Runner] = {"kiln": lambda: exe(x), "onnxruntime": onnxruntime_runner(path, feeds, threads)}
    ov_run = openvino_runner(path, feeds, threads)
    if ov_run is not None:
        out["openvino f32"] = ov_run
    weights = {n: torch.from_numpy(np.asarray(p.data)) for n, p in graph.params.items()}
    tx = torch.from_numpy(x)

    def torch_run() -> np.ndarray:
        with torch.inference_mode():
            return case.torch_fn(weights, tx).numpy()

    out["torch"] = torch_run
    want = out["onnxruntime"]()[0]
    for engine in ("kiln", "torch"):
        np.testing.assert_allclose(out[engine](), want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()),
                                   err_msg=f"{engine} on {case.kernel} {case.label}")
    return out, graph_flops(graph)


def _summary(name: str, ratios: list[float], cases: list[str]) -> str:
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    return f"| vs {name} | {geo:.2f} | {ratios[worst]:.2f} | {cases[worst]} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=24, help="how many shapes to draw (about 5-10 s each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", help="also write the tables to this markdown file")
    args = parser.parse_args()
    threads = cpu_count()
    configure_threads()
    torch.set_num_threads(threads)
    peak, load = peak_gflops(threads), os.getloadavg()[0]
    peers = ["onnxruntime", *(["openvino f32"] if openvino_version() else []), "torch"]
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}: {cpu_model()}, {threads} "
             f"threads, FMA peak {peak or 0:.0f} GFLOP/s (bench/peak.c), load average {load:.1f} at the start; "
             f"OpenVINO {openvino_version() or 'not installed'}; kiln ms = median of per-round medians", "",
             f"| # | kernel | shape | kiln ms | kiln GFLOP/s | % peak | {' | '.join('vs ' + p for p in peers)} |",
             "|---:|---|---|---:|---:|---:|" + "---:|" * len(peers)]
    ratios: dict[str, list[float]] = {p: [] for p in peers}
    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kiln-shapes-") as tmp:
        for i, case in enumerate(draw(args.count, args.seed)):
            print(f"{i}: {case.kernel} {case.label}", flush=True)
            runs, flops = runners(case, Path(tmp), threads, i)
            per_round = interleaved(runs, args.rounds, quiet=False, settle_s=SETTLE_S)
            ms = statistics.median(per_round["kiln"])
            rate = flops / ms / 1e6
            share = f"{100 * rate / peak:.0f}" if peak and flops else "-"
            cells = []
            for p in peers:
                r = statistics.median(k / o for k, o in zip(per_round["kiln"], per_round[p], strict=True))
                ratios[p].append(r)
                cells.append(f"{r:.2f}")
            names.append(f"#{i} {case.kernel} {case.label}")
            lines.append(f"| {i} | {case.kernel} | {case.label} | {ms:.3f} | {rate:.0f} | {share} | "
                         f"{' | '.join(cells)} |")
    lines += ["", "| kiln time over | geometric mean | worst | worst case |", "|---|---:|---:|---|"]
    lines += [_summary(p, ratios[p], names) for p in peers]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
