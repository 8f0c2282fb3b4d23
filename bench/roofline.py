"""Roofline context for the benchmarks: this CPU's measured float32 FMA peak, and a graph's matmul/conv FLOPs.

A time is only as good as the work it does: `GFLOP/s = graph_flops / time`, and against the peak it says how much
any runtime could still gain. Run alone it prints the peak for 1 and all cores:

    .venv/bin/python bench/roofline.py [--isa avx2]

`--isa avx2` (`make peak-avx2`) builds peak.c with `-mavx2 -mfma` instead of `-march=native`: the ceiling of an AVX2
build (`KILN_CPU=haswell`) on any CPU, AVX-512 ones included.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import tempfile

from kiln.ir import Graph

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.c")
_CONTRACTIONS = {"matmul", "linear", "conv1d", "conv2d"}
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma"]}  # what peak.c is built for


def peak_gflops(threads: int, isa: str = "native", cpu_time: bool = False) -> float | None:
    """The FMA peak in GFLOP/s on `threads` cores, measured by bench/peak.c built for `isa` (this CPU's widest, or
    AVX2), per second of wall time or, with `cpu_time`, of CPU time (x threads); None without a C compiler or AVX2."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kiln-peak-") as tmp:
        binary = os.path.join(tmp, "peak")
        build = subprocess.run([compiler, "-O2", *ISA_FLAGS[isa], "-fopenmp", _SOURCE, "-o", binary],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return None
        run = subprocess.run([binary, str(threads), *(["cpu"] if cpu_time else [])], capture_output=True, text=True,
                             check=True)
    return float(run.stdout)


def graph_flops(graph: Graph, function: str = "forward") -> int:
    """2 x the multiply-adds of the function's matmuls, linears and convolutions (the bulk of these models)."""
    total = 0
    for op in graph.functions[function].ops:
        if op.kind in _CONTRACTIONS:
            out, (lhs, rhs) = op.results[0].type.shape, (o.type.shape for o in op.operands[:2])
            # per output element: K, or (Cin / groups) x kernel size
            per_output = lhs[-1] if op.kind in ("matmul", "linear") else math.prod(rhs[1:])
            total += 2 * math.prod(out) * per_output
    return total


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="this CPU's float32 FMA peak (bench/peak.c)")
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native", help="build peak.c for this ISA")
    isa = parser.parse_args().isa
    for n in sorted({1, os.cpu_count() or 1}):
        print(f"{n} thread(s), {isa}: {peak_gflops(n, isa)} GFLOP/s")


def cpu_model() -> str:
    """The CPU's name, its widest vector ISA and the mcpu (with the -mattr kiln adds from the CPU's flags) LLVM
    builds for."""
    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    extras = (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "VNNI"), ("amx_bf16", "AMX-BF16"),
              ("amx_int8", "AMX-INT8"))
    isa += "".join(f", {extra}" for flag, extra in extras if flag in flags)
    from kiln.runtime.tvm.target import cpu_target

    attrs = cpu_target().attrs
    mattr = ",".join(str(a) for a in attrs.get("mattr", []) or [])
    return f"{name} ({isa}), LLVM mcpu {attrs.get('mcpu', '?')}" + (f" -mattr={mattr}" if mattr else "")
