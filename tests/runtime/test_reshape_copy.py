"""A reshape with several run-time dims (issue 12: "Dynamic dims stay symbolic (a `batch`/`height`/`width` dim
becomes a `?` dim and a TVM symbolic shape)"): `reshape(x, like) {shape, copy}` takes each `copy` dim from an axis
of `like`, so [b, s, 768] -> [b, s, 12, 64] keeps both dims. Checked against numpy's reshape through the TVM build
at two (b, s), ONNX export (onnxruntime) and back through the importer, and the gradient pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln.ir import Builder, Interpreter, KilnError, ShapeError
from kiln.passes import PassManager
from kiln.runtime.onnx.export import export_graph
from kiln.runtime.onnx.importer.driver import import_graph
from kiln.runtime.tvm.compile import compile_graph

SIZES = ((2, 3), (1, 5))  # two (batch, seq) pairs run through one build


def split_heads():
    """[b, s, 6] -> [b, s, 2, 3] with b and s copied from x, then tanh (so the build has a kernel)."""
    b = Builder("M")
    x = b.input("x", ((None, None, 6), "f32"))
    b.ret(b.tanh(b.reshape(x, x, shape=(-1, -1, 2, 3), copy=(0, 1, -1, -1))))
    return b.build()


def _x(b: int, s: int) -> np.ndarray:
    return np.random.default_rng(b * 10 + s).standard_normal((b, s, 6)).astype(np.float32)


def test_two_symbolic_dims_build_once_and_run_at_two_sizes():
    graph = split_heads()
    assert str(graph.functions["forward"].results[0].type) == "tensor<?x?x2x3xf32>"
    exe = compile_graph(graph, cache=False)
    for b, s in SIZES:
        np.testing.assert_allclose(np.asarray(exe(_x(b, s))), np.tanh(_x(b, s).reshape(b, s, 2, 3)), rtol=1e-5)


def test_onnx_export_reads_the_copied_dims_at_run_time_and_imports_back(tmp_path: Path):
    path = export_graph(split_heads(), tmp_path / "m.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    back = import_graph(onnx.load(path))
    for b, s in SIZES:
        want = np.tanh(_x(b, s).reshape(b, s, 2, 3))
        (got,) = session.run(None, {"x": _x(b, s)})
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(Interpreter(back).run([_x(b, s)])[0], want, rtol=1e-6)


def test_gradient_through_a_reshape_with_two_dynamic_dims():
    """Reshape's gradient reshapes back, copying x's `?` dims from x (before: "has more than one dynamic dim")."""
    c = np.random.default_rng(1).standard_normal((2, 3))
    w0 = np.random.default_rng(2).standard_normal(6)
    b = Builder("M")
    x = b.input("x", ((None, None, 6), "f64"))
    w = b.param("w", (6,), "f64", data=w0, grad=True)
    y = b.reshape(b.mul(x, w), x, shape=(-1, -1, 2, 3), copy=(0, 1, -1, -1))
    b.ret(b.sum(b.mul(y, b.constant(c))))
    graph = PassManager.parse("autodiff", verify_each=True).run(b.build())
    xs = np.random.default_rng(3).standard_normal((2, 4, 6))
    loss, grad = Interpreter(graph).run([xs], "forward_backward")
    np.testing.assert_allclose(loss, (xs * w0 * c.reshape(6)).sum())
    np.testing.assert_allclose(grad, (xs * c.reshape(6)).sum((0, 1)))  # d/dw of sum(x * w * c)


@pytest.mark.parametrize("attrs, like, message", [
    ({"shape": (-1, -1, 2, 3), "copy": (0, 1, -1, -1)}, False, r"copy \[0, 1, -1, -1\] needs operand `like`"),
    ({"shape": (-1, 6)}, True, r"operand `like` is given but `copy` is empty"),
    ({"shape": (-1, 4, 2, 3), "copy": (0, 1, -1, -1)}, True, r"a copied dim must be -1 in shape \[-1, 4, 2, 3\]"),
    ({"shape": (-1, -1, 6), "copy": (0, 3, -1)}, True, r"copy axis 3 is out of range for `like` of rank 3"),
    ({"shape": (-1, -1, 2)}, False, r"may hold one -1"),
])
def test_malformed_copy_is_a_shape_error(attrs, like, message):
    b = Builder("M")
    x = b.input("x", ((None, None, 6), "f32"))
    with pytest.raises(ShapeError, match=message):
        b.reshape(x, *([x] if like else []), **attrs)


def test_tvm_never_misreads_a_zero_length_reshape_target():
    """kiln's 0 is a zero-length dim; Relax reads a 0 in a reshape target as "keep the input dim"
    (ONNX's test_reshape_allowzero_reordered). A static empty result is allocated at numpy's shape, (3, 4, 0)
    from (0, 3, 4); beside a `?` dim the build says so instead of making another reshape."""
    b = Builder("M")
    b.ret(b.reshape(b.input("x", ((0, 3, 4), "f32")), shape=(3, 4, 0)))
    out = compile_graph(b.build(), cache=False)(np.zeros((0, 3, 4), np.float32))
    assert out.shape == np.zeros((0, 3, 4)).reshape(3, 4, 0).shape
    b = Builder("D")
    b.ret(b.reshape(b.input("x", ((None, 0), "f32")), shape=(0, -1)))
    with pytest.raises(KilnError, match=r"reshape: target \[0, -1\] has a zero-length dim beside a dynamic one"):
        compile_graph(b.build(), cache=False)
