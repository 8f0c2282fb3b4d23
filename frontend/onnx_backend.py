"""The standard ONNX backend interface (`onnx.backend.base.Backend`) over kiln, so tools built on it run kiln.

`KilnBackend` imports the model (`kiln.runtime.onnx.importer`) and runs it through kiln's TVM build on "CPU";
`KilnReferenceBackend` runs the same graph on the reference interpreter (exact, no compile: what the ONNX node
tests use in CI). It lives in the frontend because it reaches both the importer and TVM, which `runtime/onnx`
may not import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, namedtupledict

from kiln.ir import Graph, KilnError
from kiln.runtime.backend import Backend as Runner
from kiln.runtime.backend import InterpreterBackend
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph


class KilnBackendRep(BackendRep):
    """An imported model ready to run: `run` takes inputs in graph-input order (or by name).

    A model that takes a shape, axes or a condition as an input (as ONNX's node tests do) cannot be imported
    before those values are known: it is imported at `run`, its integer, boolean and scalar inputs and those the
    importer said it needs at compile time (a Resize's scales) bound to the values given, once per distinct set."""

    def __init__(self, model: onnx.ModelProto, runner: Runner, input_shapes: Mapping[str, Any] | None):
        self.runner, self.input_shapes = runner, input_shapes
        self.model = model
        self.input_names = tuple(i.name for i in model.graph.input
                                 if i.name not in {t.name for t in model.graph.initializer})
        self.output_names = tuple(o.name for o in model.graph.output)
        self.graphs: dict[bytes, Graph] = {}
        self.needed: frozenset[str] = frozenset()
        try:
            self.graph: Graph | None = import_graph(model, input_shapes=input_shapes)
        except UnsupportedModel as error:
            self.needed = error.needed
            if not self.bindable_inputs():
                raise
            self.graph = None

    def bindable_inputs(self) -> list[str]:
        bindable = (onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL)
        return [i.name for i in self.model.graph.input if i.name in self.input_names and
                (i.type.tensor_type.elem_type in bindable or i.name in self.needed or
                 i.type.tensor_type.HasField("shape") and not i.type.tensor_type.shape.dim)]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, Mapping):
            missing = [n for n in self.input_names if n not in inputs]
            if missing:
                raise KilnError(f"inputs lack {missing}; the model takes {list(self.input_names)}")
            inputs = [inputs[n] for n in self.input_names]
        elif isinstance(inputs, np.ndarray):
            inputs = [inputs]
        arrays = dict(zip(self.input_names, (np.asarray(x) for x in inputs)))
        graph = self.graph
        if graph is None:
            bound = {n: arrays.pop(n) for n in self.bindable_inputs()}
            key = b"".join(a.tobytes() + str(a.shape).encode() for a in bound.values())
            if key not in self.graphs:
                self.graphs[key] = import_graph(self.model, input_shapes=self.input_shapes, bound_inputs=bound)
            graph = self.graphs[key]
        outs = self.runner.run(graph, list(arrays.values()))
        return namedtupledict("Outputs", self.output_names)(*outs)


class KilnBackend(Backend):
    """ONNX models on kiln, compiled by TVM for the CPU."""

    runs_on: ClassVar[str] = "tvm"

    @classmethod
    def runner(cls) -> Runner:
        from kiln.runtime.tvm.backend import TVMBackend  # TVM loads only when this backend runs a model

        return TVMBackend("llvm")

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> KilnBackendRep:
        if not cls.supports_device(device):
            raise KilnError(f"{cls.__name__} runs on CPU, not {device!r}")
        return KilnBackendRep(model, cls.runner(), kwargs.get("input_shapes"))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any
                  ) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


class KilnReferenceBackend(KilnBackend):
    """ONNX models on kiln's reference interpreter: numpy semantics, no compile."""

    runs_on = "interpreter"

    @classmethod
    def runner(cls) -> Runner:
        return InterpreterBackend()
