"""OnnxModule: an imported graph as a kiln Module. Its parameters are the graph's, at module paths (nested by their
dots into `OnnxBlock` submodules, so traversal, groups and records see them as in a hand-written module), and its
`forward` replays the graph's function op by op on Tensors, so tracing, eager runs and autodiff work as for any
module.

The importer names parameters by paths sanitized from their ONNX names; a path that names a Module attribute or
another's prefix moves aside here (`module_paths`). `onnx_names` maps each path that differs from its ONNX name
back to it, and `export_onnx` writes that name again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kiln.ir import Graph, ParamNode, ShapeError, SymRef, Value
from kiln.ir.naming import suffix_of, user_paths
from kiln.ir.types import check_named_dims

from .device import Device, as_device
from .module import Module
from .param import Param, Reparam
from .tensor import Tensor, apply, leaf, tensor
from .tracing import current_trace


class OnnxBlock(Module):
    """The parameters of an imported model sharing one path prefix."""


class OnnxModule(Module):
    """An imported model: parameters at module paths, `forward` replaying the imported graph (`graph`)."""

    def __init__(self, graph: Graph, onnx_names: Mapping[str, str], device: Device | str | None = None,
                 source: str = "<model>"):
        """`onnx_names` gives each graph parameter's ONNX name (where it differs)."""
        device = as_device(device)
        self.source = source  # the file it came from (`<model>` for a ModelProto): a setting print(model) shows
        self.inputs = ", ".join(f"{a.name}: {a.type}" for a in graph.functions["forward"].args)
        users = user_paths(graph)  # a quantized weight's codes are seen at the weight's path
        factors = {o for r in graph.reparams.values() for o in r.operands[1:]}  # its scales: a factor there
        stored = [n for n in graph.params if n not in factors]
        paths = module_paths(users.get(n, n) for n in stored)
        self._graph, self._paths = graph, paths
        self._onnx = {paths[users.get(n, n)]: onnx_names.get(n, n) for n in stored}
        for name in stored:
            path = users.get(name, name)
            param, r = _param(graph.params[name], device), graph.reparams.get(path)
            if r is not None:
                chain = tuple((suffix_of(path, o), _param(graph.params[o], device)) for o in r.operands[1:])
                param = param.replace(reparam=Reparam(r.kind, chain, dict(r.attrs)))
            _place(self, paths[path].split("."), param)

    @property
    def graph(self) -> Graph:
        """The imported graph as the importer built it (parameters at its paths, with their imported values: the
        module's own parameters are what state methods and training change)."""
        return self._graph

    @property
    def onnx_names(self) -> dict[str, str]:
        """{module path: ONNX initializer name} for each path that differs from its name."""
        return {path: name for path, name in self._onnx.items() if path != name}

    def forward(self, *inputs: Any) -> Any:
        """The imported function's ops applied to the inputs (Tensors or arrays of the model's input types) and
        the module's current parameters; one result bare, several as a tuple."""
        fn = self._graph.functions["forward"]
        if len(inputs) != len(fn.args):
            raise ShapeError(f"{self.source}: forward takes {len(fn.args)} inputs "
                             f"({', '.join(a.name or '?' for a in fn.args)}), got {len(inputs)}")
        args = [x if isinstance(x, Tensor) else tensor(x) for x in inputs]
        device = args[0].device if args else Device("cpu")
        values: dict[int, Tensor] = {}
        for arg, x in zip(fn.args, args):
            if x.dtype is not arg.type.dtype or x.type.rank != arg.type.rank or any(
                    want is not None and want != got for want, got in zip(arg.type.shape, x.shape)):
                raise ShapeError(f"{self.source}: input {arg.name} must be {arg.type}, got {x.type}")
            values[id(arg)] = x
        check_named_dims([a.type for a in fn.args], [x.shape for x in args], [f"{self.source}: input {a.name}"
                                                                              for a in fn.args])
        trace = current_trace()
        for op in fn.ops:
            if op.kind == "constant":
                out: Any = leaf(np.asarray(op.attrs["value"]), device)
            else:
                if trace is not None:  # a traced op is at the ONNX node it was imported from
                    trace.replayed = op.loc
                try:
                    out = apply(op.kind, *(self._operand(o, values) for o in op.operands), **op.attrs)
                finally:
                    if trace is not None:
                        trace.replayed = None
            for r, t in zip(op.results, out if isinstance(out, tuple) else (out,)):
                values[id(r)] = t
        results = tuple(self._operand(r, values) for r in fn.results)
        return results[0] if len(results) == 1 else results

    def _operand(self, o: SymRef | Value, values: dict[int, Tensor]) -> Tensor:
        if isinstance(o, SymRef):
            owner: Any = self
            for segment in self._paths[o.name].split("."):
                owner = vars(owner)[segment]
            return owner.val()
        return values[id(o)]


def _param(node: ParamNode, device: Device) -> Param:
    """A hand-written module's parameter of this value and id: trainable where the device has autodiff."""
    return Param.from_data(node.data, device, id=node.id) if node.data is not None else Param.from_node(node)


def _place(root: Module, segments: list[str], param: Param) -> None:
    owner = root
    for segment in segments[:-1]:
        child = vars(owner).get(segment)
        if child is None:
            child = OnnxBlock()
            setattr(owner, segment, child)
        owner = child
    setattr(owner, segments[-1], param)


def module_paths(names: Iterable[str]) -> dict[str, str]:
    """{graph name: module path}: a segment that names an attribute of the module (`forward`, `train`, `source`...)
    gains a trailing `_`; a path that repeats another or is the prefix of one (a parameter cannot also hold
    submodules) gains `_<n>`."""
    reserved = set(dir(OnnxModule)) | {"source", "inputs", "_graph", "_paths", "_onnx"}
    taken: set[str] = set()
    prefixes: set[str] = set()
    out: dict[str, str] = {}
    for name in names:
        segments = [s + "_" if s in reserved else s for s in name.split(".")]
        path, n = ".".join(segments), 0
        while _clashes(path, taken, prefixes):
            n += 1
            path = ".".join(segments[:-1] + [f"{segments[-1]}_{n}"])
        taken.add(path)
        parts = path.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
        out[name] = path
    return out


def _clashes(path: str, taken: set[str], prefixes: set[str]) -> bool:
    """Whether `path` is taken, is a prefix of a taken path, or has a taken path as a prefix."""
    parts = path.split(".")
    return path in taken or path in prefixes or any(".".join(parts[:i]) in taken for i in range(1, len(parts)))
