"""export_onnx: a module's inference graph as an ONNX model file, with its parameters named by module path."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .module import Module
from .trace import InputSpec, trace


def export_onnx(module: Module, *input_specs: InputSpec, path: str | os.PathLike[str], names: Sequence[str] = (),
                **options: int) -> Path:
    """Trace `module.valid()` on inputs of these types (`None` dims stay dynamic) and write its forward to `path`.

    `options` go to `kiln.runtime.onnx.export.export_graph` (`opset`, `external_data_threshold`).
    """
    from kiln.runtime.onnx.export import export_graph  # onnx loads only when a model is exported

    return export_graph(trace(module.valid(), *input_specs, names=names), path, **options)
