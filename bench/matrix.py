"""The figures matrix of issue 13: kiln f32 beside onnxruntime, OpenVINO (f32 and its own precision choice) and
torch eager, with GFLOP/s and % of the measured FMA peak, on MLPs, encoder layers and ResNet-style convs.

    .venv/bin/python bench/matrix.py [--rounds 3] [--only SUBSTRING] [--markdown out.md] [--isa avx2]

`KILN_CPU=haswell ... --isa avx2` measures kiln's AVX2 build on this CPU against peak.c's AVX2 peak.

Rows: the MLP 784-512-512-10 at batch 1 and 256, the odd MLP 37-77-1000-10 at batch 7; encoder layers
(`inference.encoder_widths(d)`: d/64 heads, 4d) with d = 256/512/768 at batch 1 x 128 and 8 x 128 tokens, and d =
768 at ViT-B/16's 1 x 197 and 8 x 197; conv 1x1, 3x3, depthwise 3x3 and strided 3x3/2 at 56² (64 channels), 28²
(128), 14² (256) and 7² (512), batch 1. onnxruntime and both OpenVINO columns run one ONNX file
(`kiln.runtime.onnx.export`) with all graph optimizations; OpenVINO f32 is `INFERENCE_PRECISION_HINT=f32`, OpenVINO
default lets it choose (bf16 through AMX where the CPU has it); kiln bf16 is `precision="bf16!"` (AMX tiles or
`vdpbf16ps` kernels where the CPU has them, elsewhere bf16 operands widened to f32: docs/precision.md), on every
row. Every output is checked against onnxruntime's (the bf16 engines within bf16's 3e-2). Each cell: ms (median of
per-round medians) / GFLOP/s / % peak; "kiln vs best f32" is kiln over the faster of onnxruntime and OpenVINO f32,
"kiln bf16 vs OpenVINO default" kiln bf16 over OpenVINO default (medians of per-round ratios).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from inference import (  # bench/ is the script's directory
    TorchFn,
    Weights,
    Workload,
    encoder_widths,
    torch_encoder,
    torch_mlp,
    traced,
)
from peers import onnxruntime_runner, openvino_runner, openvino_version
from roofline import ISA_FLAGS, cpu_model, graph_flops, peak_gflops
from timing import SETTLE_S, Runner, interleaved

import kiln
from kiln import nn
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.target import configure_threads, cpu_count

LOWP = ("openvino default", "kiln bf16")  # engines held to bf16's tolerance
ENGINES = ("kiln f32", "onnxruntime", "openvino f32", "openvino default", "torch", "kiln bf16")
F32_PEERS = ("onnxruntime", "openvino f32")


def _torch_conv(stride: int, padding: int, groups: int) -> Callable[[Weights, str], TorchFn]:
    def make(w: Weights, device: str) -> TorchFn:
        weight = torch.from_numpy(w["weight"]).to(device)
        return lambda x: F.conv2d(x, weight, None, stride, padding, 1, groups)
    return make


def rows() -> list[Workload]:
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    out = [Workload(f"mlp b{b} 784-512-512-10", mlp, (b, 784), torch_mlp) for b in (1, 256)]
    odd = nn.Sequential(nn.Linear(37, 77), nn.ReLU(), nn.Linear(77, 1000), nn.ReLU(), nn.Linear(1000, 10))
    out.append(Workload("mlp b7 37-77-1000-10", odd, (7, 37), torch_mlp))  # issue 13's widths no vector divides
    for d in (256, 512, 768):
        layer = nn.TransformerEncoderLayer(*encoder_widths(d))
        out += [Workload(f"encoder d{d} {b}x128", layer, (b, 128, d), torch_encoder(*encoder_widths(d)))
                for b in (1, 8)]
        if d == 768:  # ViT-B/16's 197 tokens (a prime: rows and attention widths no tile or vector divides)
            out += [Workload(f"encoder d768 {b}x197 (ViT-B)", layer, (b, 197, d), torch_encoder(*encoder_widths(d)))
                    for b in (1, 8)]
    for size, c in ((56, 64), (28, 128), (14, 256), (7, 512)):
        for kind, k, stride, groups in (("1x1", 1, 1, 1), ("3x3", 3, 1, 1), ("depthwise 3x3", 3, 1, c),
                                        ("strided 3x3/2", 3, 2, 1)):
            conv = nn.Conv2d(c, c, k, stride=stride, padding=k // 2, groups=groups, bias=False)
            out.append(Workload(f"conv {kind} {c}x{size}²", conv, (1, c, size, size),
                                _torch_conv(stride, k // 2, groups)))
    return out


def runners(wl: Workload, folder: Path, threads: int) -> dict[str, Runner]:
    """Every engine on one row, each checked against onnxruntime."""
    graph = traced(wl.module, wl.shape)
    x = kiln.aligned(np.random.default_rng(1).standard_normal(wl.shape).astype(np.float32))
    exe = kiln.compile(graph)
    path = folder / "model.onnx"
    path.write_bytes(to_onnx(graph).SerializeToString())
    feeds = {graph.functions["forward"].args[0].name: x}
    torch_fn, tx = wl.torch_fn({n: np.asarray(p.data) for n, p in graph.params.items()}, "cpu"), torch.from_numpy(x)

    def torch_run() -> np.ndarray:
        with torch.inference_mode():
            return torch_fn(tx).numpy()

    bf16 = kiln.compile(graph, precision="bf16!")
    out: dict[str, Runner | None] = {
        "kiln f32": lambda: exe(x), "onnxruntime": onnxruntime_runner(path, feeds, threads),
        "openvino f32": openvino_runner(path, feeds, threads),
        "openvino default": openvino_runner(path, feeds, threads, f32=False), "torch": torch_run,
        "kiln bf16": lambda: bf16(x)}
    ready = {name: run for name, run in out.items() if run is not None}
    want = ready["onnxruntime"]()[0]

    for name, run in ready.items():
        tol = 3e-2 if name in LOWP else 3e-3
        got = run()  # kiln and torch: the array; onnxruntime a list, OpenVINO a dict-like indexed by output number
        np.testing.assert_allclose(got if isinstance(got, np.ndarray) else got[0], want, rtol=tol,
                                   atol=tol * float(np.abs(want).max()),
                                   err_msg=f"{name} on {wl.name}")
    return ready


def _ratio(per_round: dict[str, list[float]], engine: str, peer: str) -> str:
    """The median per-round ratio of `engine`'s time over `peer`'s, or "-" where either did not run."""
    if engine not in per_round or peer not in per_round:
        return "-"
    return f"{statistics.median(a / b for a, b in zip(per_round[engine], per_round[peer], strict=True)):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the rows whose name contains this")
    parser.add_argument("--markdown", help="also write the table to this markdown file")
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native",
                        help="the ISA of the peak %% peak divides by: avx2 beside KILN_CPU=haswell (an AVX2 build)")
    args = parser.parse_args()
    threads = cpu_count()
    configure_threads()
    torch.set_num_threads(threads)
    peak, load = peak_gflops(threads, args.isa), os.getloadavg()[0]
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}: {cpu_model()}, {threads} "
             f"threads, FMA peak {peak or 0:.0f} GFLOP/s (bench/peak.c, {args.isa}), load average {load:.1f} at the "
             "start; "
             f"OpenVINO {openvino_version() or 'not installed'}; each cell ms / GFLOP/s / % peak", "",
             f"| workload | {' | '.join(ENGINES)} | kiln vs best f32 | kiln bf16 vs OpenVINO default |",
             "|---|" + "---:|" * (len(ENGINES) + 2)]
    with tempfile.TemporaryDirectory(prefix="kiln-matrix-") as tmp:
        for wl in rows():
            if args.only not in wl.name:
                continue
            print(f"{wl.name}:", flush=True)
            flops = graph_flops(traced(wl.module, wl.shape))
            per_round = interleaved(runners(wl, Path(tmp), threads), args.rounds, quiet=False, settle_s=SETTLE_S)
            cells = []
            for name in ENGINES:
                if name not in per_round:
                    cells.append("-")
                    continue
                ms = statistics.median(per_round[name])
                rate = flops / ms / 1e6
                cells.append(f"{ms:.3f} / {rate:.0f} / {100 * rate / peak:.0f}%" if peak else f"{ms:.3f} / {rate:.0f}")
            best = [min(per_round[p][r] for p in F32_PEERS if p in per_round) for r in range(args.rounds)]
            ratio = statistics.median(k / b for k, b in zip(per_round["kiln f32"], best, strict=True))
            lines.append(f"| {wl.name} | {' | '.join(cells)} | {ratio:.2f} | {_ratio(per_round, *LOWP[::-1])} |")
            print(lines[-1], flush=True)  # a row as soon as it is measured: an interrupted run keeps its rows
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
