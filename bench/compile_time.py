"""Cold and cached compile time of ONNX models, stage by stage (issue 13: ResNet-50 cold < 20 s, cached < 0.3 s).

    .venv/bin/python bench/compile_time.py [--only light/resnet50 ...] [--baseline] [--markdown out.md]

Each model is imported once and compiled (bound weights, llvm, 2 threads) into an empty `KILN_CACHE_DIR`: `cold` is
that compile's wall and process-CPU seconds with the `kiln.compile` logger's stages, then its executable's first
call; `disk` the next compile with the in-memory cache cleared (key, library load), `memory` the one after (key
only), both in this process with TVM imported (a fresh process first pays `import tvm`, which imports torch too
when it is installed: timed once in a subprocess). `CPU ms` is the built model's best call in process CPU time
(`timing.best_ms`; both threads, spinning included: steadier than wall time on a shared host), so a change that
slowed a kernel shows. `--baseline` also compiles each model with Relax's FoldConstant alone (no
`fold_constant_kernels`: the path before session 12), right after the current one in the same process. Models:
the onnx package's `light` ones (`light/resnet50`, `light/densenet121`...) and `tests/frontend/torch_zoo.py`'s.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tvm
from onnx_models import Prepared, light_model, zoo_model  # bench/ is the script's directory
from timing import best_ms

import kiln
from kiln.runtime.tvm import compile_cache, pipeline
from kiln.runtime.tvm.target import configure_threads, cpu_count

DEFAULT = ("light/resnet50", "light/densenet121", "resnet")
STAGE = re.compile(r"^(lowering|building|storing) .*: ([\d.]+)s$")


class Stages(logging.Handler):
    """Collects the seconds of the `kiln.compile` stages one compile logs (lowering, building, storing)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = STAGE.match(record.getMessage())
        if match:
            self.seconds[match[1]] = float(match[2])


def timed_compile(model: kiln.Module, prepared: Prepared) -> tuple[float, float, object]:
    """(wall s, process CPU s, executable) of one compile."""
    args = model.graph.functions["forward"].args
    wall, cpu = time.perf_counter(), time.process_time()
    exe = kiln.compile(model, *(a.type for a in args))
    return time.perf_counter() - wall, time.process_time() - cpu, exe


def without_kernel_folding() -> object:
    """Swap `fold_constant_kernels` for a pass that does nothing (the baseline); returns the real one."""
    real = pipeline.fold_constant_kernels
    pipeline.fold_constant_kernels = lambda: tvm.transform.module_pass(lambda mod, _ctx: mod, opt_level=0,
                                                                       name="KilnFoldConstantKernels")
    return real


def bench(name: str, prepared: Prepared, variant: str, stages: Stages) -> str:
    model = kiln.import_onnx(prepared.path).valid()
    os.environ[compile_cache.CACHE_ENV] = tempfile.mkdtemp(prefix="kiln-compile-time-")
    compile_cache.clear_memory()
    stages.seconds = {}
    cold, cold_cpu, exe = timed_compile(model, prepared)
    seen = dict(stages.seconds)
    xs = prepared.batches[1]
    start = time.perf_counter()
    exe(*xs)
    first = time.perf_counter() - start
    compile_cache.clear_memory()
    disk, _, _ = timed_compile(model, prepared)
    memory, _, _ = timed_compile(model, prepared)
    ms = best_ms(lambda: exe(*xs), clock=time.process_time, calls=3)
    parts = " | ".join(f"{seen.get(s, 0.0):.1f}" for s in ("lowering", "building", "storing"))
    return (f"| {name} | {variant} | {cold:.1f} | {cold_cpu:.1f} | {parts} | {first:.2f} | {disk:.3f} | {memory:.3f} | "
            f"{ms:.2f} | {os.getloadavg()[0]:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a model (repeatable): light/NAME or a zoo name")
    parser.add_argument("--baseline", action="store_true", help="also compile with FoldConstant alone")
    parser.add_argument("--markdown", help="also write the table to this markdown file")
    args = parser.parse_args()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tvm"], check=True)  # what a fresh process pays first
    import_s = time.perf_counter() - start
    configure_threads()
    stages = Stages()
    logging.getLogger("kiln.compile").addHandler(stages)
    logging.getLogger("kiln.compile").setLevel(logging.INFO)
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}, {cpu_count()} threads, "
             f"a fresh `import tvm` {import_s:.1f} s; load = 1-minute load average after the model", "",
             "| model | variant | cold s | cold CPU s | lowering s | building s | storing s | first call s | "
             "disk hit s | memory hit s | CPU ms | load |", "|---|---|" + "---:|" * 10]
    with tempfile.TemporaryDirectory(prefix="kiln-compile-time-") as tmp:
        for name in args.only or DEFAULT:
            prepared = light_model(name.removeprefix("light/")) if name.startswith("light/") else \
                zoo_model(name, 17, Path(tmp))
            variants = ["kiln", "baseline"] if args.baseline else ["kiln"]
            for variant in variants:
                real = without_kernel_folding() if variant == "baseline" else None
                try:
                    lines.append(bench(name, prepared, variant, stages))
                finally:
                    if real is not None:
                        pipeline.fold_constant_kernels = real
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
