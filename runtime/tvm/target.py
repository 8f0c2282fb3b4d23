"""TVM compilation targets for kiln and the one-time setup of TVM's CPU thread pool."""

from __future__ import annotations

import functools
import os

import tvm
from tvm.target import Target, codegen

from kiln.ir import KilnError

DEFAULT_CUDA_ARCH = "sm_80"  # used when no GPU is visible to detect the real one

_threads: int | None = None
TargetLike = str | Target


def resolve_target(target: TargetLike) -> Target:
    """"llvm"/"cpu" -> this host's LLVM target, "cuda" -> CUDA (GPU 0's arch, else sm_80); a Target as is."""
    if isinstance(target, Target):
        return target
    if target in ("llvm", "cpu"):
        return cpu_target()
    if target == "cuda":
        return cuda_target()
    raise KilnError(f"unknown target {target!r}: use 'llvm' or 'cuda' (or a tvm.target.Target)")



@functools.cache
def cuda_present(index: int = 0) -> bool:
    """Whether TVM sees CUDA GPU `index` on this machine (asked once per index)."""
    return bool(tvm.cuda(index).exist)


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, which containers narrow, else os.cpu_count())."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_target() -> Target:
    """LLVM target for this host: dict form (0.27 rejects CLI strings), mcpu from LLVM's host detection."""
    return Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cpu_count()})


def cuda_target(arch: str | None = None) -> Target:
    """CUDA target with an LLVM host; `arch` ("sm_90") defaults to GPU 0's, or sm_80 without a GPU."""
    if arch is None:
        device = tvm.cuda(0)
        arch = "sm_" + device.compute_version.replace(".", "") if device.exist else DEFAULT_CUDA_ARCH
    host = {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}
    return Target({"kind": "cuda", "arch": arch, "host": host})


def configure_threads() -> int:
    """Make TVM's runtime use every core (idempotent); returns the thread count in effect.

    TVM defaults to hardware_concurrency/2 on x86, assuming hyper-threads, which is 1 thread on a 2-vCPU
    VM. The pool reads TVM_NUM_THREADS when it starts, so this must run before the first parallel TVM
    kernel; an explicit TVM_NUM_THREADS from the user is kept. `runtime.config_threadpool` adds nothing
    in 0.27: mode 1 ("big cores") keeps the halved default, and mode -3 with a CPU list, like the
    variable, only takes effect before the pool first runs.
    """
    global _threads
    if _threads is None:
        os.environ.setdefault("TVM_NUM_THREADS", str(cpu_count()))
        _threads = tvm.runtime.num_threads()
    return _threads
