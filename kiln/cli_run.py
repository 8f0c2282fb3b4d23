"""`kiln run MODEL --input name=x.npy ...`: run an ONNX model, a `.kir` module (in valid state) or a compiled `.so`
through kiln's TVM build on inputs read from `.npy` files; `-o out.npz` saves the outputs, `--bench` prints the
median latency, beside onnxruntime's on the same model with `--against onnxruntime` (interleaved rounds, same
inputs, onnxruntime at its default threads as TVM is)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.ir import KilnError, parse_file
from kiln.passes import PassManager

if TYPE_CHECKING:
    from kiln.runtime.tvm.executable import Executable

Runner = Callable[[], object]


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run an .onnx, .kir or .so model on .npy inputs (and time it)")
    run.add_argument("model", help="an .onnx model, a .kir module or a .so library kiln compiled")
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="an input by name, read from a .npy file (repeat for each input)")
    run.add_argument("--record", help="a .bpk record the .kir module's parameters load from (import-onnx --record)")
    run.add_argument("-o", "--output", help="save the outputs to this .npz (output, or output_0, output_1...)")
    run.add_argument("--bench", action="store_true", help="print the median latency over interleaved rounds")
    run.add_argument("--against", choices=("onnxruntime",), help="with --bench: time onnxruntime on the same model")
    run.add_argument("--rounds", type=int, default=5, help="rounds of --bench (default 5)")
    run.set_defaults(run=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    if args.against and not args.bench:
        raise KilnError("--against onnxruntime needs --bench")
    names, build, onnx_model = _load(Path(args.model), args.against is not None, args.record)
    inputs = _inputs(args.input, names)
    exe = build()
    outs = exe.run(*inputs, function=exe.default_function)
    keys = ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]
    if args.output:
        from kiln.runtime.atomic import atomic_file

        with atomic_file(args.output) as f:
            np.savez(f, **dict(zip(keys, outs)))
    else:
        for key, out in zip(keys, outs):
            print(f"{key}: {out.dtype}{list(out.shape)} {np.array2string(out.ravel()[:8], precision=4)}")
    if args.bench:
        runners = {"kiln": lambda: exe.run(*inputs, function=exe.default_function)}
        if onnx_model is not None:
            runners["onnxruntime"] = _onnxruntime(onnx_model, dict(zip(names, inputs)))
        _report(_interleaved(runners, max(args.rounds, 1)))
    return 0


def _load(path: Path, with_onnx: bool, record: str | None) -> tuple[list[str], Callable[[], Executable], Any]:
    """The model's input names, how to build its executable (TVM compiles only once the inputs are read), and
    (when asked) the ONNX model onnxruntime runs for comparison."""
    from kiln.runtime.tvm.compile import compile_graph  # TVM loads only for this command

    suffix = path.suffix.lower()
    if record and suffix != ".kir":
        raise KilnError(f"{path}: --record goes with a .kir module")
    if suffix == ".so":
        from kiln.runtime.tvm.executable import load_executable

        if with_onnx:
            raise KilnError(f"{path}: --against onnxruntime needs the .onnx or .kir model, not a compiled .so")
        exe = load_executable(str(path))
        return [name for name, _ in exe.signatures[exe.default_function].inputs], lambda: exe, None
    if suffix == ".onnx":
        import onnx

        from kiln.frontend import import_onnx, trace

        module = import_onnx(path).valid()
        args = module.graph.functions["forward"].args
        graph = trace(module, *(a.type for a in args), names=[a.name for a in args])
        onnx_model = onnx.load(str(path)) if with_onnx else None
    elif suffix == ".kir":
        graph = PassManager.parse("valid").run(parse_file(str(path)))
        if record:
            from kiln.passes.load_record import LoadRecord
            from kiln.runtime.records.record import ModuleRecord

            graph = LoadRecord(ModuleRecord.load(record)).apply(graph)
        onnx_model = None
        if with_onnx:
            from kiln.runtime.onnx.export import to_onnx

            onnx_model = to_onnx(graph)
    else:
        raise KilnError(f"{path}: kiln run takes an .onnx, .kir or .so model, not {suffix or 'a file without suffix'}")
    return [a.name for a in graph.functions["forward"].args], lambda: compile_graph(graph), onnx_model


def _inputs(given: Sequence[str], names: Sequence[str]) -> list[np.ndarray]:
    """The arrays of `--input name=file.npy`, in the model's input order; every input named exactly once."""
    arrays: dict[str, np.ndarray] = {}
    for item in given:
        name, eq, file = item.partition("=")
        if not eq or not name or not file:
            raise KilnError(f"--input {item!r}: expected NAME=FILE.npy")
        if name not in names:
            raise KilnError(f"--input {name!r}: the model has no such input (inputs: {', '.join(names)})")
        if name in arrays:
            raise KilnError(f"--input {name!r} is given twice")
        try:
            arrays[name] = np.load(file, allow_pickle=False)
        except ValueError as error:
            raise KilnError(f"--input {name}={file}: not a .npy array ({error})") from None
    missing = [n for n in names if n not in arrays]
    if missing:
        raise KilnError(f"missing --input for {', '.join(missing)} (inputs: {', '.join(names)})")
    return [arrays[n] for n in names]


def _onnxruntime(model, feeds: dict[str, np.ndarray]) -> Runner:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def _interleaved(runners: dict[str, Runner], rounds: int, min_s: float = 0.2) -> dict[str, float]:
    """Median ms per call of each runner: per round a block of >= 5 calls and >= `min_s` s each, after a warm-up,
    the order reversed every other round; the medians of per-round medians."""
    for run in runners.values():
        run()
    per_round: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name in (list(runners) if r % 2 == 0 else list(reversed(runners))):
            times, start = [], time.perf_counter()
            while len(times) < 5 or time.perf_counter() - start < min_s:
                t0 = time.perf_counter()
                runners[name]()
                times.append((time.perf_counter() - t0) * 1e3)
            per_round[name].append(statistics.median(times))
    return {name: statistics.median(ms) for name, ms in per_round.items()}


def _report(ms: dict[str, float]) -> None:
    base = ms["kiln"]
    for name, value in ms.items():
        ratio = "" if name == "kiln" else f"  ({value / base:.2f}x kiln's time)"
        print(f"{name:12s} {value:10.3f} ms{ratio}", file=sys.stdout)
