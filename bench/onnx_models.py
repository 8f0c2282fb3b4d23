"""ONNX models through kiln beside onnxruntime and OpenVINO: import time, cold compile time, latency.

    .venv/bin/python bench/onnx_models.py [--rounds 5] [--opset 17] [--only NAME ...] [--static] [--markdown out.md]

The models are `tests/frontend/torch_zoo.py`'s (ResNet, MobileNetV3, EfficientNet, ViT, BERT-style encoder,
YOLO-style detector, GPT-2-style decoder; tiny widths, random weights), exported once by `torch.onnx.export` with a
dynamic batch, the zoo's full-size ResNet-50, MobileNetV3-Large (224x224) and BERT-base layer (128 tokens) likewise,
and the nine `light` models shipped with the onnx package (opset 9 ImageNet CNNs at 224x224 and batch 1, fed as
`tests/runtime/onnx_import/test_backend_light.py` feeds them; their rows are named `light/...`); every engine runs
that same file at batch 1 (and 8 for the zoo's CNNs and the full-size models) on the same inputs, with the same
thread count, in interleaved rounds (`timing.interleaved`); ratios are medians of per-round ratios to kiln. OpenVINO
runs where `import openvino` works, on its CPU plugin with `INFERENCE_PRECISION_HINT=f32`, so that it computes in
f32 as the others do. Compiles start from an empty cache. A model kiln cannot import or build yet is listed with the
reason and the others still run. `--only` picks models by row name (`resnet`, `light/squeezenet`). `--static` adds
`kiln static`, a build per batch with the batch fixed (what a dynamic batch costs, in the same rounds). `--bf16`
adds `kiln bf16` (`precision="bf16!"`, docs/precision.md) and `openvino default` (its own precision choice, bf16
where the CPU has it), both held to a relative L2 distance from onnxruntime's f32 output of at most
`BF16_L2_TOLERANCE`: bf16 rounds every conv's input, so a deep net's elementwise error grows with its depth (on
MobileNetV3-Large, batch 8: kiln bf16 3.6%, OpenVINO's default 4.7%, both picking the same classes).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from peers import onnxruntime_runner, openvino_runner  # bench/ is the script's directory
from roofline import cpu_model, peak_gflops
from timing import interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "frontend"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime" / "onnx_import"))
import backend_suites  # noqa: E402  (the light models as the tests find and feed them)
import torch_zoo  # noqa: E402  (the models the ecosystem tests use)

import kiln  # noqa: E402
from kiln.runtime.tvm import compile_cache  # noqa: E402
from kiln.runtime.tvm.target import configure_threads, cpu_count  # noqa: E402

CNNS = {"resnet", "mobilenetv3", "efficientnet"}
BF16_L2_TOLERANCE = 0.06  # the largest relative L2 distance of a bf16 engine's output from onnxruntime's f32
Runner = Callable[[], object]


def inputs_at(example: tuple, batch: int) -> list[np.ndarray]:
    return [np.resize(t.numpy(), (batch, *t.shape[1:])) for t in example]


@dataclass
class Prepared:
    """One model file ready to time: its graph inputs' names, the inputs at each batch, the agreement with
    onnxruntime required before timing."""

    path: Path
    names: list[str]
    batches: dict[int, list[np.ndarray]]
    rtol: float = 1e-3
    atol: float = 1e-4


def zoo_model(name: str, opset: int, folder: Path) -> Prepared:
    """A zoo model (tiny: batch 1, and 8 for the CNNs) or a full-size one (batch 1 and 8), exported to `folder`."""
    full = torch_zoo.full_size()
    model, example, names = full[name] if name in full else torch_zoo.zoo()[name]
    path = folder / f"{name}.onnx"
    path.write_bytes(torch_zoo.export(model, example, names, opset))
    batches = (1, 8) if name in CNNS or name in full else (1,)
    return Prepared(path, list(names), {b: inputs_at(example, b) for b in batches})


def light_model(name: str) -> Prepared:
    """A `light` model from the onnx package, on the dummy input and tolerances onnx's own runner uses for it."""
    path, feeds = backend_suites.light_model(name)
    case = backend_suites.LIGHT_MODELS[name]
    return Prepared(path, list(feeds), {1: list(feeds.values())}, case.rtol, case.atol)


def static_build(imported: kiln.Module, batch: int) -> Callable[..., object]:
    """A build of `imported` whose inputs' dynamic first dims are `batch`: the static-batch baseline."""
    args = imported.graph.functions["forward"].args
    return kiln.compile(imported, *(((batch if a.type.shape[0] is None else a.type.shape[0], *a.type.shape[1:]),
                                    a.type.dtype) for a in args))


def bench_model(name: str, prepared: Prepared, rounds: int, threads: int, static: bool = False,
                bf16: bool = False) -> tuple[list[str], str | None]:
    """The table rows of one model, and why it was skipped (None when it ran); with `static`, a static-batch kiln
    build beside the dynamic one; with `bf16`, kiln's bf16 build and OpenVINO's default precision."""
    path = prepared.path
    start = time.perf_counter()
    try:
        imported = kiln.import_onnx(path).valid()
    except kiln.KilnError as error:
        return [], str(error).splitlines()[0] + " " + "; ".join(line.strip() for line in str(error).splitlines()[1:4])
    import_s = time.perf_counter() - start
    args = imported.graph.functions["forward"].args
    start = time.perf_counter()
    try:
        exe = kiln.compile(imported, *(a.type for a in args))
        compile_s = time.perf_counter() - start
        lowp = kiln.compile(imported, *(a.type for a in args), precision="bf16!") if bf16 else None
    except kiln.KilnError as error:
        return [], "imported, but the TVM build failed: " + str(error).splitlines()[0][:300]
    rows = []
    for batch, xs in prepared.batches.items():
        feeds = dict(zip(prepared.names, xs))
        runners: dict[str, Runner] = {"kiln": lambda xs=xs: exe(*xs),
                                      "onnxruntime": onnxruntime_runner(path, feeds, threads)}
        if static:
            fixed = static_build(imported, batch)
            runners["kiln static"] = lambda xs=xs, fixed=fixed: fixed(*xs)
        ov_run = openvino_runner(path, feeds, threads)
        if ov_run is not None:
            runners["openvino"] = ov_run
        want = runners["onnxruntime"]()[0]
        np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=prepared.rtol, atol=prepared.atol, err_msg=name)
        if lowp is not None:
            runners["kiln bf16"] = lambda xs=xs: lowp(*xs)
            ov_default = openvino_runner(path, feeds, threads, f32=False)
            if ov_default is not None:
                runners["openvino default"] = ov_default
            for engine in (e for e in ("kiln bf16", "openvino default") if e in runners):
                got = runners[engine]()  # kiln: the array; OpenVINO: indexed by output number
                got = got if isinstance(got, np.ndarray) else got[0]
                distance = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                assert distance <= BF16_L2_TOLERANCE, f"{engine} on {name}: relative L2 distance {distance:.3g}"
        per_round = interleaved(runners, rounds)
        for engine, ms in per_round.items():
            ratio = statistics.median(t / k for t, k in zip(ms, per_round["kiln"], strict=True))
            rows.append(f"| {name} | {batch} | {engine} | {import_s:.2f} | {compile_s:.1f} | "
                        f"{statistics.median(ms):.3f} | {min(ms):.3f} | {ratio:.3g} |")
    return rows, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--markdown", help="also write the table to this markdown file")
    models = [*torch_zoo.zoo(), *torch_zoo.full_size(), *(f"light/{n}" for n in backend_suites.LIGHT_MODELS)]
    parser.add_argument("--only", action="append", choices=models, help="run this model only (repeatable)")
    parser.add_argument("--static", action="store_true", help="also time a static-batch kiln build per batch")
    parser.add_argument("--bf16", action="store_true", help="also time kiln bf16 and OpenVINO's default precision")
    args = parser.parse_args()
    os.environ[compile_cache.CACHE_ENV] = tempfile.mkdtemp(prefix="kiln-bench-cache-")  # every build starts cold
    threads = cpu_count()
    configure_threads()
    peak = peak_gflops(threads)
    peak_note = f", FMA peak {peak:.0f} GFLOP/s (bench/peak.c)" if peak else ""
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}: {cpu_model()}, "
             f"{threads} threads{peak_note}; zoo exports at opset {args.opset}, {args.rounds} rounds; "
             "ms = median / best of per-round medians; vs kiln = median of per-round ratios (lower is faster)", "",
             "| model | batch | engine | kiln import (s) | kiln compile, cold (s) | ms median | ms best | vs kiln |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    skipped = []
    with tempfile.TemporaryDirectory(prefix="kiln-onnx-models-") as tmp:
        for name in args.only or models:
            print(f"{name}:", flush=True)
            prepared = light_model(name.removeprefix("light/")) if name.startswith("light/") else \
                zoo_model(name, args.opset, Path(tmp))
            rows, why = bench_model(name, prepared, args.rounds, threads, args.static, args.bf16)
            lines += rows
            if why is not None:
                skipped.append(f"Note: {name} not benchmarked: {why}")
    lines += [""] + skipped if skipped else []
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
