"""Benchmark of records: saving and loading a ~1 GiB record as a kiln burnpack against numpy's `.npy` files
(and safetensors when it is installed), plus opening a 100k-tensor record and reading one tensor, loading
a ~2 GiB record into a module of lazy Params (peak RSS against the record's size), and loading a ~1 GiB
safetensors and `torch.save` file with kiln's readers against the safetensors package and `torch.load(mmap=True)`.

Every case runs in a fresh subprocess (kiln and numpy already imported), so its peak RSS
(`resource.getrusage`, which starts from the small driver's) is its own; "+RSS" is how far the peak rose
during the timed operation. Saves fsync
their files (burnpack writes are atomic and durable; numpy's files are fsynced too, to compare like with
like). Loads open the files and read every byte once: "cold" after evicting the files from the page cache
with posix_fadvise, "warm" straight after. A burnpack record maps its whole file, so its pages stay resident
while the record lives; each `.npy` is mapped and dropped in turn. Temporary files live under /tmp and are
removed.

    .venv/bin/python bench/records.py              # 1 GiB as 64 tensors of 16 MiB, markdown on stdout
    .venv/bin/python bench/records.py --gib 0.125  # a quick run
    .venv/bin/python bench/records.py --lazy-gib 0  # skip the lazy-module row
    .venv/bin/python bench/records.py --checkpoints-only  # safetensors and torch.save files: kiln, safetensors,
                                                          # torch.load(mmap=True)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kiln.ir import DType
from kiln.runtime.records.burnpack import PackTensor
from kiln.runtime.records.burnpack_io import BurnpackFile, write_burnpack
from kiln.runtime.records.record import ModuleRecord, RecordEntry

TENSOR_BYTES = 16 * 2**20
MANY_TENSORS = 100_000
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


def _block() -> np.ndarray:
    """The 16 MiB f32 tensor every saved entry holds (one array, so generating data costs nothing)."""
    return np.arange(TENSOR_BYTES // 4, dtype=np.float32)


def _names(count: int) -> list[str]:
    return [f"layers.{i}.weight" for i in range(count)]


def _read_all(array: np.ndarray) -> int:
    """Read every byte of an array once (an integer sum, cheap next to the I/O)."""
    return int(array.reshape(-1).view(np.uint64).sum())


def _evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (they are clean after the fsync), so the next read is cold."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


# the cases, each run alone in a child process -------------------------------------------------------------------
def save_kiln(directory: Path, count: int) -> None:
    block = _block()
    ModuleRecord({n: RecordEntry(i, DType.f32, block.shape, block) for i, n in enumerate(_names(count))}).save(
        directory / "model.bpk")


def load_kiln(directory: Path, count: int) -> None:
    record = ModuleRecord.load(directory / "model.bpk")
    assert len(record) == count
    for entry in record.values():
        _read_all(entry.array())


def save_numpy(directory: Path, count: int) -> None:
    block = _block()
    for name in _names(count):
        with open(directory / f"{name}.npy", "wb") as out:
            np.save(out, block)
            out.flush()
            os.fsync(out.fileno())


def load_numpy(directory: Path, count: int) -> None:
    for name in _names(count):
        _read_all(np.load(directory / f"{name}.npy", mmap_mode="r"))


def save_safetensors(directory: Path, count: int) -> None:
    from safetensors.numpy import save_file

    save_file(dict.fromkeys(_names(count), _block()), directory / "model.safetensors")


def load_safetensors(directory: Path, count: int) -> None:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="np") as pack:
        for name in pack.keys():
            _read_all(pack.get_tensor(name))


def write_many(directory: Path, count: int) -> None:
    """Setup for the open cases (run in a child too, so the driver's RSS, which children inherit, stays small)."""
    one = np.ones(64, np.float32)
    write_burnpack(directory / "many.bpk", (PackTensor(f"t.{i}", "F32", (64,), i, one) for i in range(count)))


def open_many_kiln(directory: Path, count: int) -> None:
    record = ModuleRecord.load(directory / "many.bpk")
    _read_all(record[f"t.{count // 2}"].array())


def open_many_pack(directory: Path, count: int) -> None:
    with BurnpackFile.open(directory / "many.bpk") as pack:
        _read_all(pack.array(f"t.{count // 2}"))


def load_lazy_module(directory: Path, count: int) -> None:
    """Load the record into a module of lazy Params with the record's shapes, then read every parameter once."""
    from kiln import Module, Param
    from kiln.ir import Init

    class Layer(Module):
        def __init__(self) -> None:
            self.weight = Param.lazy((TENSOR_BYTES // 4,), Init("zeros"), require_grad=False)

    class Stack(Module):
        def __init__(self) -> None:
            self.layers = [Layer() for _ in range(count)]

    module = Stack().load_record(ModuleRecord.load(directory / "model.bpk"))
    for layer in module.layers:
        _read_all(layer.weight.base().numpy())


def write_checkpoints(directory: Path, count: int) -> None:
    """Setup for the checkpoint cases: the same tensors as a safetensors file (kiln's writer) and a `torch.save`
    state dict (distinct tensors, as torch saves a shared storage once)."""
    import torch

    block = _block()
    ModuleRecord({n: RecordEntry(i, DType.f32, block.shape, block) for i, n in enumerate(_names(count))}) \
        .to_safetensors(directory / "model.safetensors")
    torch.save({name: torch.from_numpy(block.copy()) for name in _names(count)}, directory / "model.pt")


def load_kiln_safetensors(directory: Path, count: int) -> None:
    for entry in ModuleRecord.from_safetensors(directory / "model.safetensors").values():
        _read_all(entry.array())


def load_kiln_pytorch(directory: Path, count: int) -> None:
    for entry in ModuleRecord.from_pytorch(directory / "model.pt").values():
        _read_all(entry.array())


def load_torch_mmap(directory: Path, count: int) -> None:
    import torch

    for tensor in torch.load(directory / "model.pt", mmap=True, weights_only=True).values():
        _read_all(tensor.numpy())


CASES: dict[str, Callable[[Path, int], None]] = {
    "save-kiln": save_kiln, "load-kiln": load_kiln, "save-numpy": save_numpy, "load-numpy": load_numpy,
    "save-safetensors": save_safetensors, "load-safetensors": load_safetensors, "open-many-kiln": open_many_kiln,
    "open-many-pack": open_many_pack, "write-many": write_many, "load-lazy-module": load_lazy_module,
    "write-checkpoints": write_checkpoints, "load-kiln-safetensors": load_kiln_safetensors,
    "load-kiln-pytorch": load_kiln_pytorch, "load-torch-mmap": load_torch_mmap,
}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


PRELOAD = {"load-torch-mmap": "torch"}  # imported before the clock starts: the import is not the load


def child(case: str, directory: Path, count: int) -> None:
    """Run one case and print its wall time and peak RSS as JSON."""
    if case in PRELOAD:
        importlib.import_module(PRELOAD[case])
    before = _peak_rss_mib()
    start = time.perf_counter()
    CASES[case](directory, count)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mib": _peak_rss_mib(), "rise_mib": _peak_rss_mib() - before}))


# the driver -----------------------------------------------------------------------------------------------------
def run(case: str, directory: Path, count: int) -> dict:
    """Run a case in a fresh interpreter and return what it measured."""
    argv = [sys.executable, __file__, "--child", case, "--dir", str(directory), "--count", str(count)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


def _row(label: str, fmt: str, result: dict, nbytes: int | None) -> str:
    rate = f"{nbytes / result['seconds'] / 1e9:.2f}" if nbytes else "-"
    return (f"| {label} | {fmt} | {result['seconds']:.3f} | {rate} | {result['peak_mib']:.0f} | "
            f"{result['rise_mib']:.0f} |")


def _median(results: list[dict]) -> dict:
    """The run with the median time (the machine's disk is noisy)."""
    return sorted(results, key=lambda r: r["seconds"])[len(results) // 2]


def throughput_rows(root: Path, count: int, repeat: int) -> list[str]:
    """Save (into an empty directory), cold load and warm load of `count` 16 MiB tensors in each format."""
    nbytes = count * TENSOR_BYTES
    rows = []
    for fmt in ["kiln", "numpy"] + (["safetensors"] if HAS_SAFETENSORS else []):
        directory = root / fmt
        runs: dict[str, list[dict]] = {"save": [], "load, cold": [], "load, warm": []}
        for _ in range(repeat):
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            runs["save"].append(run(f"save-{fmt}", directory, count))
            _evict(_files(directory))
            runs["load, cold"].append(run(f"load-{fmt}", directory, count))
            runs["load, warm"].append(run(f"load-{fmt}", directory, count))
        shutil.rmtree(directory)
        rows += [_row(label, fmt, _median(results), nbytes) for label, results in runs.items()]
    return rows


def many_tensors_rows(root: Path) -> list[str]:
    """Open a record of 100k small tensors and read one (warm cache), and the same through BurnpackFile alone."""
    directory = root / "many"
    directory.mkdir()
    run("write-many", directory, MANY_TENSORS)
    label = f"open {MANY_TENSORS:,} tensors + read 1"
    rows = [_row(label, "kiln ModuleRecord", run("open-many-kiln", directory, MANY_TENSORS), None),
            _row(label, "kiln BurnpackFile", run("open-many-pack", directory, MANY_TENSORS), None)]
    shutil.rmtree(directory)
    return rows


def lazy_module_rows(root: Path, gib: float, repeat: int) -> list[str]:
    """Load a `gib` record into a lazy module and read every tensor (warm cache): peak RSS / record size."""
    count = max(1, round(gib * 2**30 / TENSOR_BYTES))
    directory = root / "lazy"
    directory.mkdir()
    run("save-kiln", directory, count)
    nbytes = count * TENSOR_BYTES
    result = _median([run("load-lazy-module", directory, count) for _ in range(repeat)])
    shutil.rmtree(directory)
    ratio = result["peak_mib"] * 2**20 / nbytes
    label = f"load {nbytes / 2**30:.2f} GiB into lazy module + read all (peak RSS / record = {ratio:.2f}x)"
    return [_row(label, "kiln", result, nbytes)]


def checkpoint_rows(root: Path, count: int, repeat: int) -> list[str]:
    """Cold and warm loads (every byte read once) of a safetensors file and a `torch.save` file of `count` 16 MiB
    tensors: kiln's readers against the safetensors package and `torch.load(mmap=True)`."""
    directory = root / "checkpoints"
    directory.mkdir()
    run("write-checkpoints", directory, count)
    cases = [("kiln-safetensors", "model.safetensors", "kiln from_safetensors"),
             ("kiln-pytorch", "model.pt", "kiln from_pytorch"), ("torch-mmap", "model.pt", "torch.load(mmap=True)")]
    if HAS_SAFETENSORS:
        cases.insert(1, ("safetensors", "model.safetensors", "safetensors safe_open"))
    rows = []
    for case, file, label in cases:
        runs: dict[str, list[dict]] = {"load, cold": [], "load, warm": []}
        for _ in range(repeat):
            _evict([directory / file])
            runs["load, cold"].append(run(f"load-{case}", directory, count))
            runs["load, warm"].append(run(f"load-{case}", directory, count))
        rows += [_row(f"{which} {file}", label, _median(results), count * TENSOR_BYTES)
                 for which, results in runs.items()]
    shutil.rmtree(directory)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="record size in GiB (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case; the median is shown (default 3)")
    parser.add_argument("--lazy-gib", type=float, default=2.0,
                        help="record size for the lazy-module row in GiB (default 2; 0 skips it)")
    parser.add_argument("--checkpoints-only", action="store_true",
                        help="only the safetensors / torch.save rows (kiln against safetensors and torch.load)")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.count)
        return
    count = max(1, round(args.gib * 2**30 / TENSOR_BYTES))
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-records-", dir="/tmp") as tmp:
        rows = [] if args.checkpoints_only else throughput_rows(Path(tmp), count, args.repeat) + many_tensors_rows(
            Path(tmp))
        if args.lazy_gib > 0 and not args.checkpoints_only:
            rows += lazy_module_rows(Path(tmp), args.lazy_gib, args.repeat)
        rows += checkpoint_rows(Path(tmp), count, args.repeat)
    command = " ".join(["bench/records.py", *sys.argv[1:]])
    machine = (f"{platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}, "
               f"{os.cpu_count()} CPUs at load average {load:.1f}, {platform.machine()}")
    skipped = "" if HAS_SAFETENSORS else " safetensors is not installed, so it is not compared."
    print("## Records (bench/records.py)\n")
    print(f"`.venv/bin/python {command}` on {datetime.date.today()}, {machine}: {count} f32 tensors of 16 MiB "
          f"({count * TENSOR_BYTES / 2**30:.2f} GiB) in /tmp, median of {args.repeat} runs.{skipped}\n")
    print("| operation | format | seconds | GB/s | peak RSS MiB | +RSS MiB |")
    print("|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
