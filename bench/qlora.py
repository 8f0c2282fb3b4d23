"""Benchmark of quantized weights in kiln's TVM builds: bits per parameter, one training step's peak memory and time
(dense f32, LoRA on a dense base, QLoRA on quantized bases), and inference latency of quantized bases against f32 and
onnxruntime f32.

The model is a transformer-style MLP block d -> 4d -> d (ReLU), every linear weight quantized or adapted (biases stay
f32 here). Each training configuration runs in its own process (Adam, lr 1e-3, squared error); its memory is the
process's resident-set high-water mark (VmHWM) over the timed steps, reset (/proc/self/clear_refs) after the model,
the build and a warm-up step, less the process's RSS before the model existed.

    .venv/bin/python bench/qlora.py                    # d 1024 (1024 -> 4096 -> 1024), about 2 minutes on 2 cores
    .venv/bin/python bench/qlora.py --dim 2048 --batch 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024, help="model width d (hidden 4d)")
    parser.add_argument("--batch", type=int, default=32, help="training batch; inference runs 1 and this")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (the median is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved inference rounds")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a training configuration, in a child process
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts: before kiln imports TVM

import kiln  # noqa: E402
from kiln import nn, optim  # noqa: E402
from kiln.frontend.optim.optimizer import with_values  # noqa: E402
from kiln.frontend.reparam import Lora, QLora, Quantizer, QuantScheme  # noqa: E402
from kiln.ir.ops.quant import VALUE_KINDS  # noqa: E402
from kiln.runtime.backend import set_default_backend  # noqa: E402

DEVICE = kiln.Device("cpu").autodiff()
LR = 1e-3
WEIGHTS = ("layers.0.weight", "layers.2.weight")
# (label, quantizer scheme or None, LoRA or not). A new value kind becomes a row once the op knows it.
SCHEMES = {"q8f": QuantScheme("q8f"), "q4f b64": QuantScheme("q4f", (64,)), "nf4 b64": QuantScheme.nf4(64),
           "nf4 b64 double-quant": QuantScheme.nf4(64, double_quant=True)}
TRAINING = [("dense f32 (full fine-tune)", None, False), ("LoRA on dense f32 base", None, True),
            *((f"QLoRA on {k} base", k, True) for k in SCHEMES)]
INFERENCE = [("f32", None), *((k, k) for k in SCHEMES)]


def known(scheme: str | None) -> bool:
    return scheme is None or SCHEMES[scheme].value in VALUE_KINDS


def seeded(model: kiln.Module) -> kiln.Module:
    """Weights U(+-1/sqrt(fan_in)) from a fixed seed (ParamIds, which seed lazy initializers, are random)."""
    rng = np.random.default_rng(0)
    values = {}
    for _path, p in model.leaves():
        if isinstance(p, kiln.Param):
            shape = p.lazy_shape()
            values[p.id] = (rng.uniform(-1, 1, shape) / np.sqrt(shape[0] if len(shape) == 2 else ARGS.dim)
                            ).astype(np.float32)
    return with_values(model, values)


def block(scheme: str | None, lora: bool) -> kiln.Module:
    """The d -> 4d -> d block; weights quantized with `scheme` and/or adapted with LoRA."""
    d = ARGS.dim
    model = seeded(nn.Sequential(nn.Linear(d, 4 * d, device=DEVICE), nn.ReLU(), nn.Linear(4 * d, d, device=DEVICE)))
    group = kiln.ParamGroup.from_paths(WEIGHTS)
    adapter = Lora(ARGS.rank, 2.0 * ARGS.rank, param_group=group)
    if scheme is not None:
        quantizer = Quantizer(scheme=SCHEMES[scheme], param_group=group)
        return model.apply_qlora(QLora(adapter, quantizer)) if lora else model.quantize_weights(quantizer)
    return model.apply_lora(adapter) if lora else model


def stored_bits(model: kiln.Module) -> tuple[float, float]:
    """(bits per weight parameter in the executable's buffers, in a record): codes, scales or f32 values over the
    parameters they stand for; LoRA factors and biases left out."""
    from kiln.runtime.tvm.dtypes import storage_numpy

    graph = model.state_graph()
    stored = [p for name, p in graph.params.items() if name.startswith(WEIGHTS) and ".lora." not in name]
    count = sum(int(np.prod(p.type.shape)) for p in stored if not p.name.endswith(".scales"))
    runtime = sum(int(np.prod(p.type.shape)) * storage_numpy(p.type.dtype).itemsize * 8 for p in stored)
    record = sum(int(np.prod(p.type.shape)) * p.type.dtype.bits for p in stored)
    return runtime / count, record / count


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def train(index: int) -> dict:
    """One training configuration in this process: step ms, memory, bits/param."""
    from kiln.runtime.tvm.backend import TVMBackend

    label, scheme, lora = TRAINING[index]
    set_default_backend(TVMBackend())
    baseline = _status_kib("VmRSS")  # interpreter, numpy, TVM and kiln loaded; no model yet
    model = block(scheme, lora)
    x = np.random.default_rng(1).standard_normal((ARGS.batch, ARGS.dim)).astype(np.float32)
    target = np.random.default_rng(2).standard_normal((ARGS.batch, ARGS.dim)).astype(np.float32)

    def loss_fn(m: kiln.Module, x: kiln.Tensor, t: kiln.Tensor) -> kiln.Tensor:
        e = m(x) - t
        return (e * e).mean()

    start = time.perf_counter()
    step = kiln.compile_step(model, loss_fn, optim.Adam(), ((ARGS.batch, ARGS.dim), "f32"), ((ARGS.batch, ARGS.dim),
                                                                                               "f32"))
    step(LR, x, target)
    first = time.perf_counter() - start
    step(LR, x, target)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    times = []
    for _ in range(ARGS.steps):
        t0 = time.perf_counter()
        step(LR, x, target)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = _status_kib("VmHWM")
    state = sum(a.nbytes for a in [*step._params, *step._states])
    runtime_bits, record_bits = stored_bits(model)
    return {"label": label, "ms": statistics.median(times), "peak_mib": peak / 1024,
            "over_mib": (peak - baseline) / 1024, "state_mib": state / 2**20, "bits": runtime_bits,
            "record_bits": record_bits, "first_s": first}


def isolated(index: int) -> dict | None:
    argv = [sys.executable, __file__, "--run", str(index), *sys.argv[1:]]
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "KILN_CACHE_DIR": cache})
    if proc.returncode:
        print(f"note: {TRAINING[index][0]} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.splitlines()[-1])


def inference_rows() -> list[str]:
    """ms per call at batch 1 and --batch, one dynamic-batch build each (weights bound), interleaved rounds."""
    import onnxruntime as ort
    from timing import interleaved  # bench/ is the script's directory

    from kiln.runtime.onnx.export import to_onnx

    rng = np.random.default_rng(3)
    batches = [1, ARGS.batch]
    xs = {b: rng.standard_normal((b, ARGS.dim)).astype(np.float32) for b in batches}
    runners, bits = {}, {}
    for label, scheme in INFERENCE:
        if not known(scheme):
            continue
        model = block(scheme, False).valid()
        exe = kiln.compile(model, ((None, ARGS.dim), "f32"))
        bits[label] = stored_bits(model)
        for b in batches:
            runners[f"kiln {label}|{b}"] = (lambda e, x: lambda: e(x))(exe, xs[b])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = ARGS.threads, 1
    graph = kiln.trace(block(None, False).valid(), ((None, ARGS.dim), "f32"))
    sess = ort.InferenceSession(to_onnx(graph).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for b in batches:
        runners[f"onnxruntime f32|{b}"] = (lambda x: lambda: sess.run(None, {name: x}))(xs[b])
    per_round = interleaved(runners, ARGS.rounds)
    rows = []
    for b in batches:
        base = per_round[f"kiln f32|{b}"]
        for key, ms in per_round.items():
            label, batch = key.split("|")
            if int(batch) != b:
                continue
            ratio = statistics.median(t / o for t, o in zip(ms, base, strict=True))
            weight_bits = bits.get(label.removeprefix("kiln "), (32.0, 32.0))[0]
            rows.append(f"| {b} | {label} | {weight_bits:.2f} | {statistics.median(ms):.3f} | {min(ms):.3f} | "
                        f"{ratio:.2f} |")
    return rows


def main() -> None:
    if ARGS.run is not None:
        print(json.dumps(train(int(ARGS.run))))
        return
    from roofline import cpu_model, peak_gflops  # bench/ is the script's directory

    d = ARGS.dim
    print(f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}: {cpu_model()}, "
          f"{ARGS.threads} threads, FMA peak {peak_gflops(ARGS.threads) or 0:.0f} GFLOP/s (bench/peak.c); CPython "
          f"{platform.python_version()}, numpy {np.__version__}; block {d} -> {4 * d} -> {d}, LoRA rank {ARGS.rank}, "
          f"load average {os.getloadavg()[0]:.1f}.\n")
    rows = []
    for i, (label, scheme, _lora) in enumerate(TRAINING):
        if not known(scheme):
            continue
        print(f"training: {label} ...", file=sys.stderr, flush=True)
        r = isolated(i)
        rows.append(f"| {label} | failed | | | | | |" if r is None else
                    f"| {label} | {r['bits']:.2f} ({r['record_bits']:.2f}) | {r['state_mib']:.1f} | "
                    f"{r['over_mib']:.0f} | {r['peak_mib']:.0f} | {r['ms']:.1f} | {r['first_s']:.1f} |")
    print(f"Training step, batch {ARGS.batch}, Adam, TVM backend; median of {ARGS.steps} steps, each configuration "
          "in its own process. bits/param: weight storage in the executable's buffers (in a burnpack record); "
          "state: parameters and optimizer state the step holds (exact bytes); over baseline: the process's RSS "
          "high-water mark during the timed steps minus its RSS before the model was built (so it also counts the "
          "executable and what compiling left resident); peak: that high-water mark.\n")
    print("| configuration | bits/param | state MiB | RSS over baseline MiB | peak RSS MiB | ms / step | "
          "first step s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\nInference, weights bound, one dynamic-batch build each; median / best ms of {ARGS.rounds} interleaved "
          "rounds; ratio = median of per-round ratios to kiln f32.\n")
    print("| batch | approach | weight bits/param | ms median | ms best | x kiln f32 |")
    print("|---:|---|---:|---:|---:|---:|")
    print("\n".join(inference_rows()))


if __name__ == "__main__":
    main()
