"""TVM compilation targets for kiln and the one-time setup of TVM's CPU thread pool."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import tvm
from tvm.target import Target, codegen

from kiln.ir import KilnError

DEFAULT_CUDA_ARCH = "sm_80"  # used when no GPU is visible to detect the real one
CPU_ENV = "KILN_CPU"  # an LLVM CPU name ("haswell", "skylake-avx512") that "llvm" builds target instead of the host
SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"  # polls of an idle TVM worker before it blocks (TVM's default: 300,000)
SPIN_DEFAULT = "10000"  # 30x shorter than TVM's: as fast when quiet, bounded when loaded (bench/RESULTS.md)
CPUINFO = Path("/proc/cpuinfo")
# The features kiln's rules read, by Linux's flag name -> LLVM's feature name. LLVM names the host CPU from its model
# number, which a hypervisor may report for an older chip (this project's Emerald Rapids VMs say model 167, which
# LLVM calls rocketlake: no AMX, no AVX512-BF16), so the host target states these from the kernel's flags instead.
HOST_FEATURES = {"fma": "fma", "avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512vnni", "avx_vnni": "avxvnni",
                 "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile",
                 "amx_bf16": "amx-bf16", "amx_int8": "amx-int8"}

_threads: int | None = None
TargetLike = str | dict | Target


def resolve_target(target: TargetLike) -> Target:
    """"llvm"/"cpu" -> the LLVM target of `KILN_CPU` or this host, "llvm -mcpu=NAME [-mattr=+f,-g]" -> that CPU,
    "cuda" -> CUDA (GPU 0's arch, else sm_80); a dict -> its Target; a Target as is. An LLVM CPU name LLVM does
    not know is a KilnError naming it."""
    if isinstance(target, dict):
        target = Target(target)
    if isinstance(target, Target):
        if target.kind.name == "llvm" and "mcpu" in target.attrs:
            _check_cpu(str(target.attrs["mcpu"]))
        return target
    kind, *options = target.split()
    if kind in ("llvm", "cpu") and options:
        return Target({"kind": "llvm", **_cli_options(target, options)})
    if target in ("llvm", "cpu"):
        return cpu_target()
    if target == "cuda":
        return cuda_target()
    raise KilnError(f"unknown target {target!r}: use 'llvm', 'llvm -mcpu=NAME' or 'cuda' (or a tvm.target.Target)")


def _cli_options(text: str, options: list[str]) -> dict:
    """The `-mcpu=`, `-mattr=` and `-num-cores=` options of an LLVM target string as Target dict fields."""
    fields: dict = {}
    for option in options:
        key, _, value = option.lstrip("-").partition("=")
        if key not in ("mcpu", "mattr", "num-cores") or not value:
            raise KilnError(f"target {text!r}: option {option!r} is not one of -mcpu=NAME, -mattr=+F,-G, -num-cores=N")
        if key == "num-cores" and not value.isdigit():
            raise KilnError(f"target {text!r}: -num-cores={value!r} is not a whole number")
        fields[key] = value.split(",") if key == "mattr" else int(value) if key == "num-cores" else value
    if "mcpu" in fields:
        _check_cpu(fields["mcpu"])
    fields.setdefault("num-cores", cpu_count())
    return fields


def _check_cpu(name: str) -> None:
    """Refuse a CPU name LLVM does not know for this host's triple (LLVM itself would warn and build `generic`)."""
    if name != "generic" and not codegen.llvm_is_valid_cpu(name, codegen.llvm_get_system_triple()):
        raise KilnError(f"unknown LLVM CPU {name!r} (from a target or {CPU_ENV}): name one LLVM knows, such as "
                        f"haswell, skylake-avx512, znver4 or {codegen.llvm_get_system_cpu()} (this host)")



@functools.cache
def cuda_present(index: int = 0) -> bool:
    """Whether TVM sees CUDA GPU `index` on this machine (asked once per index)."""
    return bool(tvm.cuda(index).exist)


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, which containers narrow, else os.cpu_count())."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def mattr_for(flags: set[str], cpu_features: set[str]) -> tuple[str, ...]:
    """The `-mattr` entries that make a CPU with LLVM features `cpu_features` agree with the kernel's `flags` on
    `HOST_FEATURES`: "+f" for a flag LLVM's CPU lacks, "-f" for a feature the flags do not show."""
    changes = [("+" if flag in flags else "-") + feature for flag, feature in HOST_FEATURES.items()
               if (flag in flags) != (feature in cpu_features)]
    return tuple(sorted(changes))


@functools.cache
def host_mattr() -> tuple[str, ...]:
    """`mattr_for` this machine: its /proc/cpuinfo flags against LLVM's host CPU name; none where that file is
    absent or has no flags line (not Linux x86)."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return ()
    flags = next((set(line.partition(":")[2].split()) for line in lines if line.startswith("flags")), None)
    if flags is None:
        return ()
    cpu = Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
    return mattr_for(flags, {str(f) for f in codegen.llvm_get_cpu_features(cpu)})


def host_cpu() -> dict:
    """The LLVM target fields of this machine's CPU: LLVM's name for it and `host_mattr`."""
    mattr = host_mattr()
    return {"mcpu": codegen.llvm_get_system_cpu(), **({"mattr": list(mattr)} if mattr else {})}


def cpu_target() -> Target:
    """LLVM target for this host (`host_cpu`), or for the CPU `KILN_CPU` names (a cross-compile): dict form (0.27
    rejects CLI strings)."""
    name = os.environ.get(CPU_ENV, "").strip()
    if name:
        _check_cpu(name)
    cpu = {"mcpu": name} if name else host_cpu()
    return Target({"kind": "llvm", **cpu, "num-cores": cpu_count()})


def cuda_target(arch: str | None = None) -> Target:
    """CUDA target with an LLVM host; `arch` ("sm_90") defaults to GPU 0's, or sm_80 without a GPU."""
    if arch is None:
        device = tvm.cuda(0)
        arch = "sm_" + device.compute_version.replace(".", "") if device.exist else DEFAULT_CUDA_ARCH
    host = {"kind": "llvm", **host_cpu()}
    return Target({"kind": "cuda", "arch": arch, "host": host})


def configure_threads() -> int:
    """Make TVM's runtime use every core (idempotent); returns the thread count in effect.

    TVM defaults to hardware_concurrency/2 on x86, assuming hyper-threads, which is 1 thread on a 2-vCPU
    VM. The pool reads TVM_NUM_THREADS when it starts, so this must run before the first parallel TVM
    kernel; an explicit TVM_NUM_THREADS from the user is kept. `runtime.config_threadpool` adds nothing
    in 0.27: mode 1 ("big cores") keeps the halved default, and mode -3 with a CPU list, like the
    variable, only takes effect before the pool first runs. Idle workers spin `SPIN_DEFAULT` polls before
    blocking unless the user set `TVM_THREAD_POOL_SPIN_COUNT`; a worker reads it when it first runs.
    """
    global _threads
    if _threads is None:
        os.environ.setdefault("TVM_NUM_THREADS", str(cpu_count()))
        os.environ.setdefault(SPIN_ENV, SPIN_DEFAULT)
        _threads = tvm.runtime.num_threads()
    return _threads
