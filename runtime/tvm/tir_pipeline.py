"""kiln's TIR pipeline for CPU builds (`CPU_TIR_PIPELINE`): TVM's s_tir pipeline with kiln's passes where they must
run, the name every CPU build (`pipeline.cpu_compile`) and tuning run passes to `tvm.compile(tir_pipeline=)`."""

from __future__ import annotations

import tvm
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.tirx.compilation_pipeline import PIPELINE_MAP

from .partition_hints import narrow_hinted_kernels
from .stack_buffers import stack_local_buffers

CPU_TIR_PIPELINE = "kiln_cpu"


def _cpu_tir_pipeline() -> tuple:
    """TVM's s_tir pipeline after `narrow_hinted_kernels`, with `stack_local_buffers` first among the host module's
    final passes."""
    lower, finalize_host, finalize_device = default_s_tir_pipeline()
    return (tvm.transform.Sequential([narrow_hinted_kernels, lower]),
            lambda: tvm.transform.Sequential([stack_local_buffers, finalize_host()]), finalize_device)


PIPELINE_MAP[CPU_TIR_PIPELINE] = _cpu_tir_pipeline
