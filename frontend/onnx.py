"""export_onnx and import_onnx: a module's inference graph as an ONNX model file, parameters named by module path,
and an ONNX model as a kiln module (an `OnnxModule`), initializers as its parameters."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .device import Device
from .module import Module
from .onnx_module import OnnxModule
from .trace import InputSpec, trace

if TYPE_CHECKING:
    from onnx import ModelProto


def export_onnx(module: Module, *input_specs: InputSpec, path: str | os.PathLike[str], names: Sequence[str] = (),
                **options: int) -> Path:
    """Trace `module.valid()` on inputs of these types (`None` dims stay dynamic) and write its forward to `path`.

    `options` go to `kiln.runtime.onnx.export.export_graph` (`opset`, `external_data_threshold`). An imported
    module's sanitized paths are written under the ONNX names they came from, and its inputs keep their names.
    """
    from kiln.runtime.onnx.export import export_graph  # onnx loads only when a model is exported

    renamed = module.onnx_names if isinstance(module, OnnxModule) else {}
    if isinstance(module, OnnxModule) and not names:
        names = [a.name for a in module.graph.functions["forward"].args]
    return export_graph(trace(module.valid(), *input_specs, names=names), path, initializer_names=renamed,
                        **options)


def import_onnx(model: str | os.PathLike[str] | ModelProto, *,
                input_shapes: Mapping[str, Sequence[int | None]] | None = None,
                device: Device | str | None = None) -> OnnxModule:
    """An ONNX model (a file or a ModelProto) as a module whose parameters are its float initializers, at paths
    from their names, with the ParamIds kiln's exporter stored (else ids derived from name and content).

    `input_shapes` fixes or names input dims ({input: dims}, None for a dynamic dim); parameters live on `device`
    (trainable where it has autodiff), as a hand-written module's do.
    """
    from kiln.runtime.onnx.importer.driver import import_model  # onnx loads only when a model is imported

    imported = import_model(model, input_shapes=input_shapes)
    source = str(model) if isinstance(model, str | os.PathLike) else "<model>"
    return OnnxModule(imported.graph, imported.onnx_names, device, source=source)
