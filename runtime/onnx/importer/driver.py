"""Walk an ONNX model's main graph in node order, converting each node through its registered converter.

This is the minimal driver the converters are written against: graph inputs become function arguments (a
`dim_param` or absent dim a dynamic `?` dim), float initializers become parameters named by initializer, other
initializers and every `constant` a converter emits are compile-time values, and every unsupported node is
collected into one `UnsupportedModel` error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

from kiln.ir import Builder, DType, Graph, KilnError, TensorType, Value

from ..tensors import kiln_dtype
from . import convert_basic, convert_nn, convert_resize, convert_rnn  # noqa: F401  (registers its converters)
from .call import NodeCall, decoded_attrs, known_values
from .registry import Unsupported, converter


@dataclass(frozen=True)
class Refusal:
    """Why one node could not be imported."""

    node: str
    op_type: str
    opset: int
    reason: str

    def __str__(self) -> str:
        return f"{self.node or '<unnamed>'} ({self.op_type}, opset {self.opset}): {self.reason}"


class UnsupportedModel(KilnError):
    """Every node of a model kiln cannot import, with the reason for each."""

    def __init__(self, source: str, refusals: Sequence[Refusal]):
        self.refusals = tuple(refusals)
        lines = "\n".join(f"  {r}" for r in self.refusals)
        super().__init__(f"{source}: {len(self.refusals)} node(s) kiln cannot import:\n{lines}")


def opset_of(model: ModelProto, domain: str = "") -> int:
    for entry in model.opset_import:
        if entry.domain in (domain, "ai.onnx" if domain == "" else domain):
            return entry.version
    return 1


def value_type(info: onnx.ValueInfoProto) -> TensorType:
    tensor = info.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return TensorType(dims, kiln_dtype(tensor.elem_type))


def import_graph(model: ModelProto, source: str = "<model>") -> Graph:
    """The model's main graph as a kiln graph with one function, `forward`."""
    opset = opset_of(model)
    b = Builder(model.graph.name or "onnx")
    values: dict[str, Value] = {}
    known: dict[str, np.ndarray] = {}
    initializers = {t.name for t in model.graph.initializer}
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        known[tensor.name] = array
        if DType.from_numpy(array.dtype).is_float:
            b.param(tensor.name, array.shape, DType.from_numpy(array.dtype), data=array)
            values[tensor.name] = b.sym(tensor.name)  # type: ignore[assignment]
    for info in model.graph.input:
        if info.name not in initializers:
            values[info.name] = b.input(info.name, value_type(info))
    refusals: list[Refusal] = []
    for node in model.graph.node:
        names = list(node.input)
        inputs = [values.get(n) if n else None for n in names]
        try:
            missing = [n for n, v in zip(names, inputs) if n and v is None and n not in known]
            if missing:
                raise Unsupported(f"input {missing[0]!r} is not computed by any node kiln imported")
            call = NodeCall(node, opset, [v if v is not None or not n else _known(b, known[n])
                                          for n, v in zip(names, inputs)],
                            known_values(known, names), decoded_attrs(node), b.fn)
            out = converter(node.op_type, opset, node.domain).fn(call)
        except Unsupported as why:
            refusals.append(Refusal(node.name, node.op_type, opset, str(why)))
            continue
        except KilnError as error:
            refusals.append(Refusal(node.name, node.op_type, opset, f"{type(error).__name__}: {error}"))
            continue
        outs = (out,) if isinstance(out, Value) else tuple(out)
        for name, v in zip(node.output, outs):
            if name and v is not None:
                values[name] = v
                if v.owner is not None and v.owner.kind == "constant":  # folded: later converters may read it
                    known[name] = np.asarray(v.owner.attrs["value"])
    if refusals:
        raise UnsupportedModel(source, refusals)
    b.ret(*(values[o.name] for o in model.graph.output))
    return b.build()


def _known(b: Builder, array: np.ndarray) -> Value:
    return b.constant(array)
