"""Empty tensors through kiln's TVM build (issue 12's `tvm-zero-extent` node tests): a result with a static
zero-length dim is an empty allocation and a zero-size constant or parameter is never embedded, since TVM's LLVM
codegen cannot vectorize a zero-extent loop nor load a zero-size constant. Each is a one-op graph against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import Builder
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import Executable, load_executable

pytestmark = pytest.mark.usefixtures("module_cache")


def _reloaded(exe: Executable, tmp_path) -> Executable:
    """The executable written out and loaded back: a constant embedded in the library must load."""
    exe.export_library(str(tmp_path / "lib.so"))
    return load_executable(str(tmp_path / "lib.so"))


def test_a_slice_to_an_empty_last_dim_builds_and_is_empty() -> None:
    """numpy: `x[:, 2:2]` has shape (3, 0) (ONNX's split_zero_size_splits: 'Failed to vectorize loop with extent
    0'), and the non-empty result beside it is still computed."""
    b = Builder("EmptySlice")
    x = b.input("x", ((3, 4), "f32"))
    b.ret(b.slice(x, starts=[2], ends=[2], axes=[1]), b.add(x, x))
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    empty, doubled = compile_graph(b.build())(arr)
    assert empty.shape == arr[:, 2:2].shape == (3, 0) and empty.dtype == np.float32
    np.testing.assert_array_equal(doubled, arr + arr)


@pytest.mark.parametrize("params", ["bound", "inputs"])
def test_a_zero_size_parameter_is_an_empty_buffer(params: str, tmp_path) -> None:
    """numpy: concatenating a (3, 0) weight along axis 1 leaves x as it is, whether the parameter is baked in
    (ONNX's tril_zero: a zero-size constant in the library did not load, 'Invalid DLTensor file format') or passed
    at run time."""
    b = Builder("EmptyParam")
    x = b.input("x", ((3, 4), "f32"))
    w = b.param("w", (3, 0), data=np.zeros((3, 0), np.float32))
    b.ret(b.concat(x, w, axis=1))
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_reloaded(compile_graph(b.build(), params=params), tmp_path)(arr), arr)


def test_an_empty_result_with_a_dynamic_dim_takes_that_dim_from_the_input() -> None:
    """numpy: `x[:, :0]` of an (n, 4) array is (n, 0) for every n, so the empty allocation reads the run-time n."""
    b = Builder("EmptyDynamic")
    x = b.input("x", ((None, 4), "f32"))
    b.ret(b.slice(x, starts=[0], ends=[0], axes=[1]))
    run = compile_graph(b.build())
    for n in (1, 5):
        assert run(np.ones((n, 4), np.float32)).shape == (n, 0)
