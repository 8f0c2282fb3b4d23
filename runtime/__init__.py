"""kiln.runtime: how IR runs fast and persists, one sub-package per concern.

`backend` is the one execution interface; `records` holds the file formats (burnpack, ModuleRecord, QFloat;
no TVM, no onnx); `onnx` the ONNX exchange; `tvm` lowering, schedules, tuning, builds and artifacts.

The TVM entry points load on first use, so importing kiln does not import TVM.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"compile_graph": "tvm.compile", "Executable": "tvm.executable", "load_executable": "tvm.executable",
         "TVMBackend": "tvm.backend", "set_default_backend": "backend", "default_backend": "backend",
         "using_backend": "backend", "InterpreterBackend": "backend"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
