"""kiln.runtime: how IR runs fast and persists (TVM lowering, build, compile cache; records).

The TVM entry points load on first use, so importing kiln does not import TVM.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"compile_graph": "compile", "Executable": "executable", "load_executable": "executable",
         "TVMBackend": "tvm_backend", "set_default_backend": "backend", "default_backend": "backend",
         "InterpreterBackend": "backend"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
