"""kiln as an `onnx.backend.base.Backend`: issue 12, "Implement the standard ONNX backend interface
(`onnx.backend.base.Backend`: `prepare`, `run_model`, `supports_device`) over kiln, so any tool built on it can
use kiln"."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.backend.base import Backend
from onnx.reference import ReferenceEvaluator
from onnx_cases import model

from kiln.frontend.onnx_backend import KilnBackend, KilnReferenceBackend
from kiln.ir import KilnError

F32, I64 = np.float32, np.int64


def _mlp():
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w", "b"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["y"])]
    rng = np.random.default_rng(0)
    return model(nodes, {"x": (F32, ["batch", 2, 3])}, ["y"],
                 initializers={"w": rng.standard_normal((4, 6)).astype(F32), "b": rng.standard_normal(4).astype(F32)})


def test_backends_are_onnx_backends_on_cpu_only():
    assert issubclass(KilnBackend, Backend) and issubclass(KilnReferenceBackend, Backend)
    assert KilnBackend.supports_device("CPU") and not KilnBackend.supports_device("CUDA")
    with pytest.raises(KilnError, match="runs on CPU, not 'CUDA'"):
        KilnReferenceBackend.prepare(_mlp(), "CUDA")


@pytest.mark.parametrize("backend", [KilnReferenceBackend, KilnBackend], ids=["interpreter", "tvm"])
def test_run_model_agrees_with_the_onnx_reference_at_two_batches(backend):
    """`prepare` once, `run` at batch 1 and 3 (a dynamic batch), by position and by name; `run_model` too."""
    onnx_model = _mlp()
    rep = backend.prepare(onnx_model)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 2, 3)).astype(F32)
        want = ReferenceEvaluator(onnx_model).run(None, {"x": x})[0]
        np.testing.assert_allclose(rep.run([x])[0], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rep.run({"x": x}).y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.run_model(onnx_model, [x])[0], want, rtol=1e-5, atol=1e-6)


def test_a_shape_given_as_an_input_is_bound_at_run():
    """ONNX's node tests feed shapes and axes as inputs: the model is imported when their values are given."""
    onnx_model = model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       {"x": (F32, [2, 3]), "shape": (I64, [2])}, ["y"])
    rep = KilnReferenceBackend.prepare(onnx_model)
    x = np.arange(6, dtype=F32).reshape(2, 3)
    assert rep.run([x, np.array([3, 2], I64)])[0].shape == (3, 2)
    assert rep.run([x, np.array([6, 1], I64)])[0].shape == (6, 1)


def test_a_float_input_the_importer_needs_at_compile_time_is_bound_at_run():
    """A Resize's scales given as a float input (as ONNX's node tests give them): the importer names the value it
    needs, and the backend imports at `run` with it bound; the data input stays a run-time input."""
    onnx_model = model([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")],
                       {"x": (F32, [1, 1, 2, 2]), "scales": (F32, [4])}, ["y"])
    rep = KilnReferenceBackend.prepare(onnx_model)
    assert rep.needed == {"scales"}
    x = np.arange(4, dtype=F32).reshape(1, 1, 2, 2)
    for scales in ([1, 1, 2, 2], [1, 1, 1, 3]):
        scales = np.array(scales, F32)
        (want,) = ReferenceEvaluator(onnx_model).run(None, {"x": x, "scales": scales})
        np.testing.assert_array_equal(rep.run([x, scales])[0], want)
