"""Export one function of a kiln graph (by default `forward`) as an ONNX model, op by op through `rules["onnx"]`.

* The graph is first put in valid state and simplified (`valid,materialize,canonicalize,dce`): flags turn false,
  so dropout disappears and batch norm becomes an affine op on its running statistics, and derived parameters
  such as LoRA fold into plain ones (a quantized weight stays codes and scales, dequantized inside the model).
* Every stored parameter becomes an initializer named by its module path (`fc1.weight`) and tagged with its
  ParamId (see `onnx_tensors`); flags fold into constants; kiln's literal constants become Constant nodes.
* Dynamic dims (`?`) of the inputs become named dim params: "batch" at axis 0, `<input>_<axis>` elsewhere.
* Models whose initializers pass `external_data_threshold` bytes (protobuf caps a model at 2 GiB) keep them in
  external data beside the model, `<model file name>.data`.
* Files are written to a temporary sibling directory, checked with `onnx.checker`, then installed one by one
  (external data first) by `kiln.runtime.atomic.install`, so a failed export leaves any existing model untouched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, ValueInfoProto, helper, numpy_helper

from kiln.ir import FlagNode, Function, Graph, KilnError, Operand, SymRef, TensorType, Value, registry
from kiln.ir.interpreter import param_value
from kiln.ir.symbols import SymbolResolver
from kiln.passes import PassManager
from kiln.passes.patterns import constant_of
from kiln.runtime.atomic import install
from kiln.runtime.records.record import ModuleRecord

from . import nn_ops, ops, quant_ops, shape_ops, spatial_ops  # noqa: F401  (register rules)
from .rule import NodeSink, OnnxCall, as_names
from .tensors import initializer, onnx_dtype

DEFAULT_OPSET = 21
OPSETS = range(20, 23)  # Gelu needs 20; IR version 10 covers up to 22
IR_VERSION = 10  # onnxruntime 1.31 rejects onnx 1.23's default IR version (14)
EXTERNAL_DATA_THRESHOLD = (1 << 31) - (64 << 20)  # 2 GiB, less headroom for the graph itself
PREPARE = "valid,materialize,canonicalize,dce"


class _Lowering:
    """Builds the ONNX graph of one kiln function: initializers, then nodes op by op."""

    def __init__(self, graph: Graph, initializer_names: Mapping[str, str]):
        self.graph = graph
        named = {p.name: initializer_names.get(p.name, p.name) for p in graph.params.values()}
        self.initializers = [initializer(named[p.name], param_value(p), p.type.dtype, p.id)
                             for p in graph.params.values()]
        self.sink = NodeSink(named.values())
        # a symbol's ONNX name and its value at export time: parameters are initializers; a flag becomes a
        # constant and a derived parameter is computed from its stored ones, each once
        self.symbol: SymbolResolver[tuple[str, np.ndarray | None]] = SymbolResolver(
            graph, lambda p: (named[p.name], None), self._flag,
            lambda node, operands, types: (self.call(node.kind, operands, types, node.attrs, [node.type])[0], None))
        self.values: dict[int, str] = {}  # id(Value) -> ONNX name

    def _flag(self, node: FlagNode) -> tuple[str, np.ndarray]:
        value = np.asarray(node.value)
        (name,) = self.sink.node("Constant", [], [self.sink.fresh(node.name)], value=numpy_helper.from_array(value))
        return name, value

    def name(self, o: Operand) -> str:
        return self.symbol(o.name)[0] if isinstance(o, SymRef) else self.values[id(o)]

    def known(self, o: Operand) -> np.ndarray | None:
        """An operand's value at export time: a flag's or a constant's."""
        return self.symbol(o.name)[1] if isinstance(o, SymRef) else constant_of(o)

    def lower(self, kind: str, operands: Sequence[Operand], attrs: dict, results: Sequence[TensorType]
              ) -> tuple[str, ...]:
        return self.call(kind, [(self.name(o), self.known(o)) for o in operands], [o.type for o in operands], attrs,
                         results)

    def call(self, kind: str, operands: Sequence[tuple[str, np.ndarray | None]], types: Sequence[TensorType],
             attrs: Mapping[str, Any], results: Sequence[TensorType]) -> tuple[str, ...]:
        """The op's ONNX rule on operands given as (ONNX name, value known at export time or None)."""
        rule = registry.lookup(kind).rules.get("onnx")
        if rule is None:
            raise KilnError(f"{kind}: no ONNX lowering is registered")
        call = OnnxCall(kind, self.sink, [n for n, _ in operands], list(types), [k for _, k in operands], attrs,
                        results)
        return as_names(rule(call))

    def function(self, fn: Function) -> GraphProto:
        """The function's ONNX graph."""
        inputs = self.inputs(fn.args)
        for op in fn.ops:
            names = self.lower(op.kind, op.operands, op.attrs, [r.type for r in op.results])
            self.values.update((id(r), n) for r, n in zip(op.results, names))
        outputs = self.outputs(fn.results)
        return helper.make_graph(self.sink.nodes, self.graph.name, inputs, outputs, self.initializers)

    def inputs(self, args: Sequence[Value]) -> list[ValueInfoProto]:
        """Each argument under its own name (made unique), dynamic dims named: a named dim by its name (the
        dim_param inputs share), an anonymous one `batch` on axis 0 unless a named dim is, else `<input>_<axis>`."""
        infos = []
        taken = {n for arg in args for n in arg.type.names if n is not None}
        batch = "batch" if "batch" not in taken else None
        for arg in args:
            self.values[id(arg)] = name = self.sink.fresh(arg.name)
            dims = [d if d is not None else (batch if axis == 0 and batch else f"{name}_{axis}")
                    for axis, d in enumerate(arg.type.axes)]
            infos.append(helper.make_tensor_value_info(name, onnx_dtype(arg.type.dtype), dims))
        return infos

    def outputs(self, results: Sequence[Operand]) -> list[ValueInfoProto]:
        """Each result through an Identity named `output` (`output_<i>` for several); dynamic dims unnamed unless
        their type names them."""
        infos = []
        for i, r in enumerate(results):
            name = self.sink.fresh("output" if len(results) == 1 else f"output_{i}")
            self.sink.node("Identity", [self.name(r)], [name])
            infos.append(helper.make_tensor_value_info(name, onnx_dtype(r.type.dtype), list(r.type.axes)))
        return infos


def prepare(graph: Graph) -> Graph:
    """The graph as it exports: valid state, reparameterizations folded, dead training behaviour removed."""
    return PassManager.parse(PREPARE).run(graph)


def to_onnx(graph: Graph, function: str = "forward", opset: int = DEFAULT_OPSET,
            initializer_names: Mapping[str, str] | None = None) -> ModelProto:
    """`function` of the prepared graph as an in-memory ONNX model; `initializer_names` renames the initializers of
    the parameters it lists (an imported model's paths back to the ONNX names they were sanitized from)."""
    if opset not in OPSETS:
        raise KilnError(f"ONNX opset {opset} is not supported (supported: {OPSETS.start} to {OPSETS.stop - 1})")
    graph = prepare(graph)
    fn = graph.functions.get(function)
    if fn is None:
        raise KilnError(f"module @{graph.name} has no function @{function}")
    return helper.make_model(_Lowering(graph, initializer_names or {}).function(fn),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION,
                             producer_name="kiln")


def export_graph(graph: Graph, path: str | os.PathLike[str], *, function: str = "forward",
                 opset: int = DEFAULT_OPSET, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                 initializer_names: Mapping[str, str] | None = None) -> Path:
    """Write `function` of a (valid-mode) graph as a checked ONNX model at `path`, atomically; returns the path."""
    model = to_onnx(graph, function, opset, initializer_names)
    return _save(model, path, external_data_threshold)


def export_record(record: ModuleRecord, path: str | os.PathLike[str],
                  external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """Write a record's tensors as the initializers (with their ParamIds) of an otherwise empty ONNX model, the form
    `read_record` takes back; atomically, in external data past the threshold as `export_graph` does."""
    for name, entry in record.items():
        if entry.scheme is not None or entry.opaque is not None:
            raise KilnError(f"tensor {name!r} is quantized; ONNX initializers have no quantized form")
    inits = [initializer(name, entry.array(), entry.dtype, entry.param_id) for name, entry in record.items()]
    model = helper.make_model(helper.make_graph([], "record", [], [], initializer=inits), ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], producer_name="kiln")
    return _save(model, path, external_data_threshold)


def _save(model: ModelProto, path: str | os.PathLike[str], external_data_threshold: int) -> Path:
    """Save atomically, the initializers in a `.data` file beside the model past the threshold."""
    destination = Path(path)
    external = sum(len(t.raw_data) for t in model.graph.initializer) > external_data_threshold
    save_atomically(model, destination, f"{destination.name}.data" if external else None)
    return destination


def save_atomically(model: ModelProto, destination: Path, data_name: str | None) -> None:
    """Save (initializers in `data_name` beside the model, when given), check, then rename into place."""
    with tempfile.TemporaryDirectory(prefix=".kiln-", dir=destination.parent) as staging:
        staged = Path(staging) / destination.name
        onnx.save_model(model, staged, save_as_external_data=data_name is not None, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=0)
        onnx.checker.check_model(str(staged))
        files = [Path(staging) / data_name] if data_name else []
        for f in [*files, staged]:
            install(f, destination.parent / f.name)
