"""The other engines the benchmarks compare kiln with, each run on the same ONNX file: onnxruntime (CPU EP,
`ORT_ENABLE_ALL`) and OpenVINO (CPU plugin, in f32 or with its own precision choice), on a fixed thread count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

Runner = Callable[[], object]


def onnxruntime_runner(path: Path, feeds: dict[str, np.ndarray], threads: int) -> Runner:
    """onnxruntime's CPU execution provider on `path`, all graph optimizations on."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def openvino_version() -> str | None:
    """OpenVINO's version where `import openvino` works, else None."""
    try:
        import openvino as ov
    except ImportError:
        return None
    return ov.__version__.split("-")[0]


def openvino_runner(path: Path, feeds: dict[str, np.ndarray], threads: int, f32: bool = True) -> Runner | None:
    """OpenVINO's CPU plugin on `path`: in f32 (`INFERENCE_PRECISION_HINT=f32`), or with `f32=False` in the
    precision it picks itself (bf16 on CPUs with AMX/AVX512-BF16); None where OpenVINO is not installed."""
    if openvino_version() is None:
        return None
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": threads, **({"INFERENCE_PRECISION_HINT": "f32"} if f32 else {})}
    request = ov.Core().compile_model(str(path), "CPU", config).create_infer_request()
    return lambda: request.infer(feeds)
