"""`import_model`: a model file or ModelProto as an `OnnxImport` (the kiln graph, parameters at paths sanitized from
their initializer names, and each path's ONNX name), over the skeleton driver's `import_graph`.

The interface the onnx-core driver provides (`driver.import_model`, `OnnxImport`, `sanitized`); this module stands
in for it until that driver lands, and goes then (the frontend's one import of it changes to `driver`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from onnx import ModelProto, TensorProto

from kiln.ir import Graph, ParamId, RecordError, Rewriter, ShapeError, SymRef

from ..tensors import PARAM_ID_KEY, read_initializers
from ..tensors import _param_id as stored_param_id
from .driver import import_graph


@dataclass(frozen=True)
class OnnxImport:
    """An imported model: the kiln graph, and each parameter path's original ONNX initializer name."""

    graph: Graph
    onnx_names: Mapping[str, str]


def sanitized(name: str) -> str:
    """A parameter path from an ONNX name: runs of characters other than letters, digits and `_` become `.`."""
    return ".".join(part for part in re.split(r"[^A-Za-z0-9_]+", name) if part) or "param"


def import_model(model: ModelProto | str | os.PathLike[str], *,
                 input_shapes: Mapping[str, Sequence[int | None]] | None = None) -> OnnxImport:
    """The model as a kiln graph with one function, `forward`; ParamIds as kiln's exporter stored them, else derived
    from the tensor, so two imports of one file agree."""
    if isinstance(model, ModelProto):
        label, proto = "<model>", model
    else:
        import onnx

        label = str(model)
        read_initializers(model)  # a file that is no model is a RecordError naming it
        proto = onnx.load(str(Path(model)))
    if input_shapes:
        proto = _with_input_shapes(proto, input_shapes, label)
    graph = import_graph(proto, label)
    ids = {t.name: _param_id(t, label) for t in proto.graph.initializer}
    paths: dict[str, str] = {}
    for name in graph.params:
        path, n = sanitized(name), 0
        while path in paths.values():
            n += 1
            path = f"{sanitized(name)}_{n}"
        paths[name] = path
    params = {paths[n]: p.replace(name=paths[n], id=ids[n]) for n, p in graph.params.items()}
    renamed = Graph(graph.name, params, graph.flags, graph.reparams, {})
    fn = graph.functions["forward"]
    rw = Rewriter.in_place(renamed, fn)  # the one rebuild driver renames the symbols the function reads
    rw.symbols = lambda s: SymRef(paths.get(s.name, s.name), s.type)
    return OnnxImport(renamed.with_function(rw.run(fn)), {p: n for n, p in paths.items()})


def _param_id(tensor: TensorProto, label: str) -> ParamId:
    """The stored id (read, and refused when malformed, by `tensors`), else a digest of the serialized tensor."""
    if any(p.key == PARAM_ID_KEY for p in tensor.metadata_props):
        try:
            return stored_param_id(tensor)
        except RecordError as error:
            raise RecordError(f"{label}: initializer {tensor.name!r}: {error}") from None
    return ParamId(int.from_bytes(hashlib.blake2b(tensor.SerializeToString(deterministic=True), digest_size=8)
                                  .digest(), "little"))


def _with_input_shapes(model: ModelProto, shapes: Mapping[str, Sequence[int | None]], label: str) -> ModelProto:
    out = ModelProto()
    out.CopyFrom(model)
    inputs = {i.name: i for i in out.graph.input}
    for name, dims in shapes.items():
        if name not in inputs:
            raise ShapeError(f"{label}: input_shapes names {name!r}, which is no input of the model "
                             f"(inputs: {', '.join(inputs) or 'none'})")
        shape = inputs[name].type.tensor_type.shape
        shape.ClearField("dim")
        for axis, d in enumerate(dims):
            if d is None:
                shape.dim.add().dim_param = f"{name}_{axis}"
            else:
                shape.dim.add().dim_value = d
    return out
