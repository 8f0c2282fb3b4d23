"""Small ONNX models built in tests, the reference evaluator as oracle, and FileCheck on printed graphs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import Graph, interpret

_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
          np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def model(nodes: Sequence[NodeProto], inputs: dict[str, tuple], outputs: Sequence[str], *, opset: int = 17,
          initializers: dict[str, np.ndarray] | None = None) -> ModelProto:
    """A one-graph model: `inputs` maps a name to (numpy dtype, dims), dims naming a dynamic one by a string."""
    graph = helper.make_graph(
        list(nodes), "g",
        [helper.make_tensor_value_info(n, _TYPES[np.dtype(t)], dims) for n, (t, dims) in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (initializers or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)  # onnxruntime's


def assert_matches_reference(graph: Graph, onnx_model: ModelProto, feeds: dict[str, np.ndarray],
                             rtol: float = 1e-5, oracle: str = "reference") -> None:
    """kiln's interpreter on the imported graph agrees with onnx's reference evaluator (or onnxruntime, for the
    old-opset forms the reference evaluator computes with new semantics), in value and dtype."""
    if oracle == "onnxruntime":
        import onnxruntime

        session = onnxruntime.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = session.run(None, feeds)
    else:
        want = ReferenceEvaluator(onnx_model).run(None, feeds)
    got = interpret(graph, [feeds[a.name] for a in graph.functions["forward"].args])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)


def filecheck(text: str, checks: str, tmp_path: Path) -> None:
    """FileCheck `checks` (CHECK-LABEL/CHECK-NEXT lines) against `text`."""
    check_file = tmp_path / "checks.txt"
    check_file.write_text(checks)
    done = subprocess.run([sys.executable, "-m", "filecheck", str(check_file)], input=text, text=True,
                          capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr + "\n" + text
