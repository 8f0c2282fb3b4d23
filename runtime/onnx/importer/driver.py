"""Walk an ONNX model's graph in node order, converting each node through its registered converter.

- Graph inputs become function arguments: a `dim_param` is a named dynamic dim (`?{batch}`: inputs sharing
  the name share the dim, through the IR and into one TVM symbolic var), an absent dim an anonymous `?`;
  `input_shapes` overrides an input's dims (None for a `?`, a string for a named one).
- Initializers are read through `runtime/onnx/tensors.py` (validated; external data memory-mapped). A float
  initializer becomes a parameter when a node uses it as a run-time operand; one read only as a compile-time value
  (a shape, axes) and every integer one stay compile-time values. A parameter's path is its initializer's name
  sanitized (`onnx::Conv_12` -> `onnx.Conv_12`, `/layer1/conv/w` -> `layer1.conv.w`); `OnnxImport.onnx_names`
  maps each path back to the original name, which is what an exporter writing the model back reads. ParamIds
  are the ones kiln's exporter stored, else derived from the tensor (`tensors.param_id_of`).
- Constant folding: a node whose inputs are all compile-time values (not parameters) is converted into a scratch
  function whose ops are evaluated at once (`kiln.ir.evaluate_op`); its outputs are compile-time values. A folded
  float value of more than one element that a run-time node reads becomes a parameter named by its ONNX value
  (weights built by `Constant`/`ConstantOfShape` nodes), anything else a constant.
- Shapes of tensors with `?` dims are tracked element by element (`symbolic.ShapeVector`) until a consumer
  (`Reshape`, `Expand`) turns them into kiln attributes.
- Every node kiln cannot import is collected into one `UnsupportedModel` error: nodes downstream of a refused one
  are listed only when they have no converter either.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, numpy_helper

from kiln.ir import (
    Builder,
    DType,
    FunctionBuilder,
    Graph,
    KilnError,
    ShapeError,
    SymRef,
    TensorType,
    Value,
    evaluate_op,
)
from kiln.ir.location import onnx_loc
from kiln.ir.naming import quant_codes, quant_scales
from kiln.ir.types import DIM_NAME
from kiln.runtime.records.record import RecordEntry

from ..tensors import check_text, kiln_dtype, load_model, model_initializers, param_id_of
from . import (  # noqa: F401  (registers their converters)
    convert_basic,
    convert_control,
    convert_elementwise,
    convert_index,
    convert_nn,
    convert_quant,
    convert_reduce,
    convert_resize,
    convert_rnn,
    convert_shape,
)
from .call import NodeCall, Output, decoded_attrs
from .quant_weights import kiln_scheme
from .registry import Unsupported, converter
from .symbolic import ShapeVector

MIN_OPSET = 7


@dataclass(frozen=True)
class Refusal:
    """Why one node could not be imported."""

    node: str
    op_type: str
    opset: int
    reason: str
    needs: str | None = None  # the value whose compile-time value the node lacks, where that is why

    def __str__(self) -> str:
        return f"{self.node or '<unnamed>'} ({self.op_type}, opset {self.opset}): {self.reason}"


class UnsupportedModel(KilnError):
    """Every node of a model kiln cannot import, with the reason for each."""

    def __init__(self, source: str, refusals: Sequence[Refusal]):
        self.refusals = tuple(refusals)
        lines = "\n".join(f"  {r}" for r in self.refusals)
        super().__init__(f"{source}: {len(self.refusals)} node(s) kiln cannot import:\n{lines}")

    @property
    def needed(self) -> frozenset[str]:
        """The ONNX values refused nodes need at compile time (a caller that knows them can bind them)."""
        return frozenset(r.needs for r in self.refusals if r.needs)


class _Listed(Unsupported):
    """A node that failed because nodes inside it did, each of which is listed."""


@dataclass(frozen=True)
class OnnxImport:
    """An imported model: the kiln graph, and each parameter path's original ONNX initializer or value name."""

    graph: Graph
    onnx_names: Mapping[str, str]


def opset_of(model: ModelProto, domain: str = "") -> int:
    for entry in model.opset_import:
        if entry.domain in (domain, "ai.onnx" if domain == "" else domain):
            return entry.version
    return 1


def value_type(info: onnx.ValueInfoProto, dims: Sequence[int | str | None] | None = None, source: str = "model"
               ) -> TensorType:
    """The kiln type of a graph input; `dims` (None or a name for a `?`) replace the file's dims. A `dim_param`
    becomes a named dim (`?{batch}`), so inputs sharing it share one dim; one kiln cannot name stays `?`."""
    tensor = info.type.tensor_type
    if dims is None:
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor.shape.dim]
    return TensorType.of((d if isinstance(d, int) or d is None or DIM_NAME.fullmatch(d) else None for d in dims),
                         kiln_dtype(tensor.elem_type))


def sanitized(name: str) -> str:
    """A parameter path from an ONNX name: runs of characters other than letters, digits and `_` become `.`."""
    return ".".join(part for part in re.split(r"[^A-Za-z0-9_]+", name) if part) or "param"


def import_model(model: ModelProto | str | os.PathLike[str], source: str | None = None, *,
                 input_shapes: Mapping[str, Sequence[int | str | None]] | None = None,
                 bound_inputs: Mapping[str, np.ndarray] | None = None) -> OnnxImport:
    """A model (a file, or a parsed model whose external data lies beside the working folder) as a kiln graph
    with one function, `forward`. `bound_inputs` fixes graph inputs to compile-time values (they are no
    arguments then), for models that take a shape or axes as an input. `source` names the model in errors (and
    is the folder external data of a parsed model is read from); a file names itself."""
    if isinstance(model, ModelProto):
        where, proto = Path(source or "<model>"), model
        check_text(proto, where)
    else:
        where = Path(model)
        proto = load_model(where)
    opset = opset_of(proto)
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise UnsupportedModel(str(where), [Refusal(proto.graph.name, "model", opset,
                                                    f"kiln imports opsets {MIN_OPSET}..{newest}")])
    return _Importer(proto, where, opset).run(dict(input_shapes or {}), dict(bound_inputs or {}))


def import_graph(model: ModelProto | str | os.PathLike[str], source: str | None = None, *,
                 input_shapes: Mapping[str, Sequence[int | str | None]] | None = None,
                 bound_inputs: Mapping[str, np.ndarray] | None = None) -> Graph:
    """`import_model`'s graph."""
    return import_model(model, source, input_shapes=input_shapes, bound_inputs=bound_inputs).graph


@dataclass
class _Slot:
    """What the importer knows of one ONNX value: a kiln value, a compile-time array (or its loader), a shape
    vector; `param` marks a float initializer, whose value stays a parameter."""

    value: Value | None = None
    known: np.ndarray | None = None
    vector: ShapeVector | None = None
    loader: RecordEntry | None = None
    param: bool = False

    def array(self) -> np.ndarray | None:
        if self.known is None and self.loader is not None:
            self.known = self.loader.array()
        return self.known

    @property
    def constant(self) -> bool:
        return not self.param and (self.known is not None or self.loader is not None or
                                   (self.vector is not None and self.vector.static() is not None))


@dataclass
class _Importer:
    model: ModelProto
    source: Path
    opset: int
    slots: dict[str, _Slot] = field(default_factory=dict)
    refusals: list[Refusal] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)
    onnx_names: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.b = Builder(self.model.graph.name or "onnx")

    def run(self, input_shapes: dict[str, Sequence[int | str | None]], bound: dict[str, np.ndarray]
            ) -> OnnxImport:
        graph = self.model.graph
        self.entries = model_initializers(self.model, self.source)
        for name, entry in self.entries.items():
            self.slots[name] = _Slot(loader=entry, param=entry.dtype.is_float)
            self.order.append(name)
        for info in graph.input:
            if info.name in bound:
                self.slots[info.name] = _Slot(known=np.asarray(bound.pop(info.name)))
            elif info.name not in self.entries:
                t = value_type(info, input_shapes.pop(info.name, None), str(self.source))
                self.slots[info.name] = _Slot(self.b.input(info.name, t))
        for option, left in (("input_shapes", input_shapes), ("bound_inputs", bound)):
            if left:
                raise ShapeError(f"{self.source}: {option} names {sorted(left)}, which are no graph inputs")
        self.convert(graph.node)
        results = []
        for out in graph.output:
            if out.name in self.refused:
                continue
            try:
                results.append(self.operand(out.name))
            except Unsupported as why:
                self.refusals.append(Refusal(out.name, "graph output", self.opset, str(why)))
        if self.refusals:
            raise UnsupportedModel(str(self.source), self.refusals)
        self.b.ret(*results)
        built = self.b.build()
        ranks = {name: i for i, name in enumerate(self.order)}
        params = dict(sorted(built.params.items(), key=lambda kv: ranks[self.onnx_names[kv[0]]]))
        return OnnxImport(built.replace(params=params), self.onnx_names)

    def convert(self, nodes: Sequence[NodeProto]) -> None:
        for node in nodes:
            names = list(node.input)
            if any(n in self.refused for n in names if n):  # downstream of a refusal: list only a missing converter
                try:
                    converter(node.op_type, self.opset, node.domain)
                except Unsupported as why:
                    self.refusals.append(Refusal(node.name, node.op_type, self.opset, str(why)))
                self.refused.update(node.output)
                continue
            try:
                outs = self.node(node, names)
            except _Listed:  # its root causes are listed already
                self.refused.update(node.output)
                continue
            except Unsupported as why:
                self.refuse(node, str(why), why.needs)
                continue
            except (KilnError, ValueError, TypeError, IndexError) as error:  # a converter meeting a case it
                self.refuse(node, f"{type(error).__name__}: {error}")     # does not check: one line, listed
                continue
            for name, out in zip(node.output, outs):
                if name and out is not None:
                    self.slots[name] = self.slot(out)

    def refuse(self, node: NodeProto, reason: str, needs: str | None = None) -> None:
        self.refusals.append(Refusal(node.name, node.op_type, self.opset, reason, needs))
        self.refused.update(node.output)

    def node(self, node: NodeProto, names: list[str]) -> Sequence[Output]:
        conv = converter(node.op_type, self.opset, node.domain)
        fn = conv.fn
        for n in names:
            if n and n not in self.slots:
                raise Unsupported(f"input {n!r} is not computed by any node before it")
        attrs = decoded_attrs(node)
        slots = [self.slots[n] if n else None for n in names]
        foldable = all(s is None or s.constant or (i in conv.type_only and (s.value is not None or s.param))
                       for i, s in enumerate(slots)) and not any(isinstance(v, GraphProto) for v in attrs.values())
        known = [s.array() if s is not None else None for s in slots]  # a parameter's too (e.g. a Range bound)
        vectors = [s.vector if s is not None else None for s in slots]
        if node.op_type == "DequantizeLinear" and names[0] in self.entries and all(
                k is not None for n, k in zip(names, known) if n):  # a QDQ model's weight: kept quantized
            weight = self.quantized_param(names, known, attrs)
            if weight is not None:
                return (weight,)
        if foldable:  # a type-only input held at run time lends the scratch function its value (for the type)
            typed = [s.value if s is not None and k is None else None for s, k in zip(slots, known)]
            return self.fold(node, fn, known, vectors, attrs, typed)
        call = NodeCall(node, self.opset, _Operands(self, names), known, attrs, self.b.fn, vectors, self.inline)
        fb = self.b.fn
        outer, fb.loc = fb.loc, onnx_loc(node.name, node.op_type)  # every op the converter emits names the node
        try:
            out = fn(call)
        finally:
            fb.loc = outer
        return (out,) if not isinstance(out, tuple | list) else out

    def fold(self, node: NodeProto, fn, known, vectors, attrs, typed) -> list[np.ndarray | ShapeVector | None]:
        """The node evaluated at import: converted into a scratch function whose ops run at once (`typed`: the
        run-time values of inputs the converter reads only the type of)."""
        scratch = FunctionBuilder("fold", lambda name: None)
        inputs = [scratch.constant(k) if k is not None else t for k, t in zip(known, typed)]
        out = fn(NodeCall(node, self.opset, inputs, known, attrs, scratch, vectors, None))
        outs = (out,) if not isinstance(out, tuple | list) else out
        arrays: dict[int, np.ndarray] = {}
        for op in scratch.ops:
            got = evaluate_op(op.kind, [arrays[id(o)] for o in op.operands], op.attrs,
                              [r.type for r in op.results])
            arrays.update((id(r), a) for r, a in zip(op.results, got))
        return [arrays[id(o)] if isinstance(o, Value) else o for o in outs]

    @staticmethod
    def slot(out: Output) -> _Slot:
        if isinstance(out, ShapeVector):
            static = out.static()
            return _Slot(known=static) if static is not None else _Slot(vector=out)
        if isinstance(out, np.ndarray):
            return _Slot(known=out)
        owner = getattr(out, "owner", None)  # a parameter passed through (Identity) is a symbol, with no owner
        if owner is not None and owner.kind == "constant":
            return _Slot(out, known=np.asarray(out.owner.attrs["value"]))
        return _Slot(out)

    def operand(self, name: str) -> Value:
        """The kiln value of ONNX value `name`, bringing a compile-time value into the graph on first use."""
        slot = self.slots.get(name)
        if slot is None:  # a graph output no node computes
            raise Unsupported(f"{name!r} is computed by no node and is no graph input or initializer")
        if slot.value is not None:
            return slot.value
        array = slot.array()
        if array is None:
            raise Unsupported(f"{name!r} is a shape computed at run time from dynamic dims; kiln keeps such a "
                              "shape only as the target of Reshape or Expand")
        if name in self.entries and slot.param:
            entry = self.entries[name]
            slot.value = self.param(name, array, entry.param_id)
        elif DType.from_numpy(array.dtype).is_float and array.size > 1:
            slot.value = self.param(name, array, param_id_of(numpy_helper.from_array(np.asarray(array), name)))
        else:
            slot.value = self.b.constant(np.asarray(array))
        return slot.value

    def quantized_param(self, names: list[str], known: list, attrs: dict) -> SymRef | None:
        """A DequantizeLinear of an int8 initializer as a kiln quantized parameter (`quant_weights`): codes under
        the initializer's ParamId, scales beside them, a `dequantize` derivation at the initializer's path."""
        given = attrs.get("output_dtype", 0)
        dtype = kiln_dtype(given) if given else DType.from_numpy(known[1].dtype)
        q = kiln_scheme(known[0], known[1], known[2] if len(known) > 2 else None, attrs.get("axis", 1),
                        attrs.get("block_size", 0), dtype)
        if q is None:
            return None
        path, n = sanitized(names[0]), 1
        while any(p in self.onnx_names for p in (path, quant_codes(path), quant_scales(path))):
            path, n = f"{sanitized(names[0])}_{n}", n + 1
        for stored, name, array, param_id in (
                (quant_codes(path), names[0], q.codes, self.entries[names[0]].param_id),
                (quant_scales(path), names[1], q.scales, param_id_of(numpy_helper.from_array(q.scales, names[1])))):
            self.onnx_names[stored] = name
            if name not in self.order:
                self.order.append(name)
            self.b.param(stored, array.shape, DType.from_numpy(array.dtype), id=param_id, data=array,
                         grad=stored != quant_codes(path))
        return self.b.reparam(path, "dequantize", quant_codes(path), quant_scales(path), **q.attrs)

    def param(self, name: str, array: np.ndarray, param_id: int) -> Value:
        path, n = sanitized(name), 1
        while path in self.onnx_names:
            path, n = f"{sanitized(name)}_{n}", n + 1
        self.onnx_names[path] = name
        if name not in self.order:
            self.order.append(name)
        self.b.param(path, array.shape, DType.from_numpy(array.dtype), id=param_id, data=array)
        return self.b.sym(path)  # type: ignore[return-value]

    def inline(self, branch: GraphProto, bindings: Sequence[Output] = ()) -> list[Output]:
        """A subgraph (an `If` branch, a `Loop` body) converted in place, its inputs bound to `bindings`; its
        outputs as the node's."""
        for info, out in zip(branch.input, bindings):
            self.slots[info.name] = self.slot(out)
        for tensor in branch.initializer:
            self.slots[tensor.name] = _Slot(known=numpy_helper.to_array(tensor))
        before = len(self.refusals)
        self.convert(branch.node)
        if len(self.refusals) > before or any(o.name in self.refused for o in branch.output):
            raise _Listed(f"branch {branch.name!r} has nodes kiln cannot import")
        return [self.output(o.name) for o in branch.output]

    def output(self, name: str) -> Output:
        """ONNX value `name` as a converter would give it: a kiln value, or what is known of it at import."""
        slot = self.slots[name]
        if slot.value is not None or not slot.constant:
            return slot.vector if slot.vector is not None else self.operand(name)
        return slot.array()


class _Operands(Sequence):
    """A node's inputs as kiln values, each brought into the graph only when a converter reads it."""

    def __init__(self, importer: _Importer, names: list[str]):
        self.importer, self.names = importer, names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):  # type: ignore[override]
        name = self.names[i]
        return self.importer.operand(name) if name else None
