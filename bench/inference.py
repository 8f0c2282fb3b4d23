"""Inference benchmark: kiln's default build (`kiln.compile`, weights bound, fast-math) against onnxruntime (CPU EP),
torch 2.13 eager and numpy, on four models built with kiln.nn and traced in valid mode; plus kiln's cold and
cached compile times.

Run from the repository root:

    unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
    TVM_NUM_THREADS=$(nproc) OMP_NUM_THREADS=$(nproc) OPENBLAS_NUM_THREADS=$(nproc) \
        .venv/bin/python bench/inference.py [--rounds 5] [--tune TRIALS]

Every approach runs the same weights. onnxruntime runs the graph kiln exports (`kiln.runtime.onnx.export`),
torch runs its own modules/functionals loaded with those weights, numpy the same math where it is simple. Every
output is checked against kiln's interpreter first (rtol 3e-3). "kiln dyn" is the same build traced with a
dynamic batch dim; "kiln tuned" (with --tune) the build after MetaSchedule tuning. Compile times: "cold" builds
into an empty cache (and writes the entry), "cached" compiles again after dropping the in-memory cache, so the
library comes from disk as in a new process.

`--device cuda` (on a GPU machine; docs/gpu.md) compares kiln's CUDA build (`target="cuda"`, TVM's GPU rules) with
torch eager on CUDA and, when `ort.get_available_providers()` offers it, onnxruntime's CUDA execution provider
(otherwise onnxruntime is left out, with a note); numpy is CPU-only and left out. Every approach is timed the same
way, host numpy in and host numpy out: each call copies the input to the GPU, runs the kernels and copies the result
back, and that copy waits for the kernels, so no asynchronous launch is timed as finished. torch runs with TF32 off,
in f32 like kiln. Ratios there are against torch, and blocks are timed without waiting for a quiet host.

    python3 bench/inference.py --device cuda --rounds 3 --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
import tvm
from roofline import graph_flops, peak_gflops  # bench/ is the script's directory
from timing import Runner, interleaved

import kiln
from kiln import nn
from kiln.frontend.module import Module
from kiln.frontend.tensor import Tensor, apply
from kiln.ir import Graph, interpret
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm import compile_cache
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import Executable
from kiln.runtime.tvm.target import configure_threads, cpu_count

Weights = dict[str, np.ndarray]
TorchFn = Callable[[torch.Tensor], torch.Tensor]
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
BASELINE = {"cpu": ("onnxruntime", "ORT"), "cuda": ("torch", "torch")}  # the ratio column's approach and label


@dataclass
class Workload:
    """A kiln model, its input, and the other approaches' runners built from its weights."""

    name: str
    module: Module
    shape: tuple[int, ...]
    torch_fn: Callable[[Weights, str], TorchFn]  # (weights, torch device) -> the model
    numpy_fn: Callable[[Weights, np.ndarray], np.ndarray] | None = None


class SmallCNN(Module):
    """Three conv-bn-relu stages (two max-pooled), global average pool, linear: a CIFAR-sized classifier."""

    def __init__(self) -> None:
        self.conv1, self.bn1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv2, self.bn2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.conv3, self.bn3 = nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128)
        self.pool, self.gap, self.fc = nn.MaxPool2d(2, stride=2), nn.AdaptiveAvgPool2d(1), nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        relu = nn.functional.relu
        x = self.pool(relu(self.bn1(self.conv1(x))))
        x = self.pool(relu(self.bn2(self.conv2(x))))
        x = relu(self.bn3(self.conv3(x)))
        return self.fc(apply("reshape", self.gap(x), shape=(-1, 128)))


def _t(w: Weights, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in w.items()}


def torch_mlp(w: Weights, device: str) -> TorchFn:
    p = _t(w, device)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.addmm(p["layers.0.bias"], x, p["layers.0.weight"]))
        x = torch.relu(torch.addmm(p["layers.2.bias"], x, p["layers.2.weight"]))
        return torch.addmm(p["layers.4.bias"], x, p["layers.4.weight"])
    return run


def _numpy_mlp(w: Weights, x: np.ndarray) -> np.ndarray:
    x = np.maximum(x @ w["layers.0.weight"] + w["layers.0.bias"], 0)
    x = np.maximum(x @ w["layers.2.weight"] + w["layers.2.bias"], 0)
    return x @ w["layers.4.weight"] + w["layers.4.bias"]


def encoder_widths(d: int) -> tuple[int, int, int]:
    """(width, heads, feed-forward width) of the benchmarks' `d`-wide encoder layers: heads of 64, feed-forward 4d."""
    return d, d // 64, 4 * d


def torch_encoder(d: int, heads: int, ff: int) -> Callable[[Weights, str], TorchFn]:
    """torch's own TransformerEncoderLayer (eval + inference_mode takes its fused fast path) of these widths, loaded
    with a kiln `nn.TransformerEncoderLayer(d, heads, ff)`'s weights."""
    return lambda w, device: _torch_transformer(w, device, d, heads, ff)


def _torch_transformer(w: Weights, device: str, d: int, heads: int, ff: int) -> TorchFn:
    layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu", batch_first=True).eval()
    p = _t(w)
    with torch.no_grad():
        a = "attention."
        layer.self_attn.in_proj_weight.copy_(torch.cat([p[a + n + ".weight"].T for n in ("query", "key", "value")]))
        layer.self_attn.in_proj_bias.copy_(torch.cat([p[a + n + ".bias"] for n in ("query", "key", "value")]))
        layer.self_attn.out_proj.weight.copy_(p[a + "output.weight"].T)
        layer.self_attn.out_proj.bias.copy_(p[a + "output.bias"])
        layer.linear1.weight.copy_(p["ff_in.weight"].T)
        layer.linear1.bias.copy_(p["ff_in.bias"])
        layer.linear2.weight.copy_(p["ff_out.weight"].T)
        layer.linear2.bias.copy_(p["ff_out.bias"])
        for i in (1, 2):
            getattr(layer, f"norm{i}").weight.copy_(p[f"norm{i}.gamma"])
            getattr(layer, f"norm{i}").bias.copy_(p[f"norm{i}.beta"])
    return layer.to(device)


def _torch_conv(w: Weights, device: str) -> TorchFn:
    weight = torch.from_numpy(w["weight"]).to(device)
    return lambda x: F.conv2d(x, weight, padding=1)


def _numpy_conv(w: Weights, x: np.ndarray) -> np.ndarray:
    """3x3 conv with padding 1 as im2col and one matmul."""
    n, c, h, wd = x.shape
    cols = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
    out = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * wd, c * 9) @ w["weight"].reshape(w["weight"].shape[0], -1).T
    return out.reshape(n, h, wd, -1).transpose(0, 3, 1, 2)


def _torch_cnn(w: Weights, device: str) -> TorchFn:
    p = _t(w, device)

    def stage(x: torch.Tensor, i: int) -> torch.Tensor:
        x = F.conv2d(x, p[f"conv{i}.weight"], p[f"conv{i}.bias"], padding=1)
        x = F.batch_norm(x, p[f"bn{i}.running_mean"], p[f"bn{i}.running_var"], p[f"bn{i}.gamma"], p[f"bn{i}.beta"],
                         training=False, eps=1e-5)
        return torch.relu(x)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(stage(x, 1), 2)
        x = F.max_pool2d(stage(x, 2), 2)
        x = F.adaptive_avg_pool2d(stage(x, 3), 1).flatten(1)
        return F.linear(x, p["fc.weight"].T, p["fc.bias"])
    return run


def workloads() -> list[Workload]:
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return [
        Workload("mlp 64x784-512-512-10", mlp, (64, 784), torch_mlp, _numpy_mlp),
        Workload("transformer b8 s128 d256 h4", nn.TransformerEncoderLayer(256, 4, 1024), (8, 128, 256),
                 torch_encoder(256, 4, 1024)),
        Workload("conv2d 3x3 8x64x32x32->64", nn.Conv2d(64, 64, 3, padding=1, bias=False), (8, 64, 32, 32),
                 _torch_conv, _numpy_conv),
        Workload("small cnn 8x3x32x32", SmallCNN(), (8, 3, 32, 32), _torch_cnn),
    ]


def traced(module: Module, shape: tuple[int | None, ...], seed: int = 0) -> Graph:
    """The module in valid mode, traced, with every weight drawn once (batch-norm statistics made non-trivial)."""
    graph = kiln.trace(module.valid(), (shape, "f32"))
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in graph.params.items():
        fan_in = math.prod(p.type.shape[1:]) if "conv" in name or name == "weight" else p.type.shape[0]
        scale = 1 / math.sqrt(fan_in) if name.endswith("weight") else 0.1
        wide = name.endswith(("var", "gamma"))
        data = rng.uniform(0.5, 1.5, p.type.shape) if wide else rng.normal(0, scale, p.type.shape)
        params[name] = p.replace(data=data.astype(np.float32))
    return graph.replace(params=params)


def _ort_runner(graph: Graph, x: np.ndarray, threads: int, provider: str, notes: set[str]
                ) -> tuple[Runner | None, float | None]:
    """onnxruntime on `provider`, and the seconds its session took to create; (None, None) and a note in `notes`
    where onnxruntime cannot run there."""
    available = ort.get_available_providers()
    if provider not in available:
        notes.add(f"onnxruntime {ort.__version__} offers no {provider} here (only {', '.join(available)}); left out")
        return None, None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    start = time.perf_counter()
    sess = ort.InferenceSession(to_onnx(graph).SerializeToString(), opts, providers=[provider])
    seconds = time.perf_counter() - start
    if sess.get_providers()[0] != provider:  # it could not start the provider and fell back to another
        notes.add(f"onnxruntime {ort.__version__} could not start {provider}; left out")
        return None, None
    feed = {sess.get_inputs()[0].name: x}
    return (lambda: sess.run(None, feed)[0]), seconds


def _timed_compile(graph: Graph, target: str) -> tuple[Executable, float, float]:
    """(executable, cold seconds into an empty cache, seconds for a disk-cache hit)."""
    start = time.perf_counter()
    compile_graph(graph, target=target)
    cold = time.perf_counter() - start
    compile_cache.clear_memory()
    start = time.perf_counter()
    exe = compile_graph(graph, target=target)
    return exe, cold, time.perf_counter() - start


def runners(wl: Workload, threads: int, device: str, notes: set[str], tune: int = 0
            ) -> tuple[dict[str, Runner], dict[str, float | None]]:
    """Every approach for a workload on `device`, each checked against the interpreter; and the compile/session
    times. Why an approach is left out goes to `notes`. `tune=N` adds "kiln tuned": `kiln.compile(tune=N)`,
    MetaSchedule with N trials and kiln's rules for whatever the database does not cover."""
    graph = traced(wl.module, wl.shape)
    dynamic = graph.replace(functions=kiln.trace(wl.module.valid(), ((None, *wl.shape[1:]), "f32")).functions)
    weights = {n: p.data for n, p in graph.params.items()}
    x = np.random.default_rng(1).standard_normal(wl.shape).astype(np.float32)
    target = "cuda" if device == "cuda" else "llvm"
    exe, cold, cached = _timed_compile(graph, target)
    exe_dyn = compile_graph(dynamic, target=target)
    out: dict[str, Runner] = {"kiln": lambda: exe(x), "kiln dyn": lambda: exe_dyn(x)}
    times: dict[str, float | None] = {"cold": cold, "cached": cached}
    if tune and device == "cpu":
        start = time.perf_counter()
        exe_tuned = kiln.compile(graph, tune=tune)
        times["tune"] = time.perf_counter() - start
        out["kiln tuned"] = lambda: exe_tuned(x)
    ort_run, session_s = _ort_runner(graph, x, threads, ORT_PROVIDERS[device], notes)
    if ort_run is not None:
        out["onnxruntime"] = ort_run
    torch_fn, tx = wl.torch_fn(weights, device), torch.from_numpy(x)

    def torch_run() -> np.ndarray:
        with torch.inference_mode():
            return torch_fn(tx).numpy()

    def torch_cuda_run() -> np.ndarray:
        with torch.inference_mode():
            return torch_fn(tx.cuda()).cpu().numpy()  # `.cpu()` waits for the kernels

    out["torch"] = torch_cuda_run if device == "cuda" else torch_run
    if wl.numpy_fn is not None and device == "cpu":
        out["numpy"] = lambda: wl.numpy_fn(weights, x)
    want = interpret(graph, [x])[0]
    for name, run in out.items():
        np.testing.assert_allclose(run(), want, rtol=3e-3, atol=3e-3 * float(np.abs(want).max()), err_msg=name)
    return out, {**times, "ort session": session_s}


Row = tuple[str, str, float, float, float]  # workload, approach, ms median, ms best, ratio to the baseline


def report(where: str, rounds: int, label: str, rows: list[Row], compiles: list[tuple[str, dict[str, float | None]]],
           notes: set[str], flops: dict[str, int], peak: float | None) -> list[str]:
    """The figures as markdown lines (after a blank line), then the notes. GFLOP/s counts the matmul/conv work
    (`roofline.graph_flops`) at the median time; "% peak" compares it with the measured FMA peak."""
    peak_note = f"; FMA peak measured by bench/peak.c: {peak:.0f} GFLOP/s" if peak else ""
    lines = ["", f"{where}, {rounds} rounds; ms = median / best of per-round medians; "
             f"vs {label} = median of per-round ratios (lower is faster){peak_note}", "",
             f"| workload | approach | ms median | ms best | vs {label} | GFLOP/s | % peak |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for wl_name, name, med, best, ratio in rows:
        rate = flops[wl_name] / med / 1e6
        share = f"{100 * rate / peak:.0f}" if peak else "-"
        lines.append(f"| {wl_name} | {name} | {med:.3f} | {best:.3f} | {ratio:.2f} | {rate:.0f} | {share} |")
    lines += ["", "| workload | kiln compile, cold (s) | kiln compile, disk cache (s) | kiln tune + compile (s) | "
              "ORT session (s) |", "|---|---:|---:|---:|---:|"]
    for wl_name, t in compiles:
        session = "-" if t["ort session"] is None else f"{t['ort session']:.2f}"
        tuned = f"{t['tune']:.1f}" if "tune" in t else "-"
        lines.append(f"| {wl_name} | {t['cold']:.2f} | {t['cached']:.3f} | {tuned} | {session} |")
    return lines + ([""] + [f"Note: {note}" for note in sorted(notes)] if notes else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                        help="also time a MetaSchedule-tuned build (CPU; minutes per workload)")
    parser.add_argument("--device", choices=sorted(ORT_PROVIDERS), default="cpu")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--markdown", help="also write the tables to this markdown file")
    args = parser.parse_args()
    if args.device == "cuda" and not (torch.cuda.is_available() and tvm.cuda(0).exist):
        parser.error("--device cuda needs a GPU that both torch and TVM see")
    os.environ[compile_cache.CACHE_ENV] = tempfile.mkdtemp(prefix="kiln-bench-cache-")  # every build starts cold
    threads = cpu_count()
    configure_threads()
    torch.set_num_threads(threads)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    baseline, label = BASELINE[args.device]
    peak = peak_gflops(threads) if args.device == "cpu" else None
    flops = {wl.name: graph_flops(traced(wl.module, wl.shape)) for wl in workloads()}
    rows: list[Row] = []
    compiles: list[tuple[str, dict[str, float | None]]] = []
    notes: set[str] = set()
    for wl in workloads():
        print(f"{wl.name}:", flush=True)
        runs, times = runners(wl, threads, args.device, notes, args.tune)
        compiles.append((wl.name, times))
        per_round = interleaved(runs, args.rounds, quiet=args.device == "cpu")
        for name, ms in per_round.items():
            ratios = [t / o for t, o in zip(ms, per_round[baseline], strict=True)]
            rows.append((wl.name, name, statistics.median(ms), min(ms), statistics.median(ratios)))
    where = f"{threads} threads" if args.device == "cpu" else torch.cuda.get_device_name(0)
    lines = report(where, args.rounds, label, rows, compiles, notes, flops, peak)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write("\n".join(lines[1:]) + "\n")
    if args.json:
        fields = ("workload", "approach", "ms_median", "ms_best", f"vs_{baseline}")
        figures = {"device": args.device, "where": where, "rounds": args.rounds, "baseline": baseline,
                   "peak_gflops": peak, "flops": flops,
                   "versions": {"tvm": tvm.__version__, "torch": torch.__version__, "onnxruntime": ort.__version__,
                                "numpy": np.__version__},
                   "rows": [dict(zip(fields, row)) for row in rows],
                   "compile_s": [{"workload": name, **t} for name, t in compiles], "notes": sorted(notes)}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
