"""Outputs the VM allocated for the call alone come back without a copy; any output that could alias an input, a
constant or another output is still copied (`runtime/tvm/fresh_outputs.py`)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kiln
from kiln.ir import Builder
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import load_executable
from kiln.runtime.tvm.fresh_outputs import fresh_outputs

_ALLOC = """\
  call  vm.builtin.alloc_storage in: %vm, c[2], i0, c[3], c[4] dst: %1
  call  vm.builtin.alloc_tensor in: %1, i0, c[5], c[0] dst: %2
  call  vm.builtin.null_value in:              dst: %1
  call  relu             in: %0, %2       dst: %void
"""


def _listing(body: str) -> str:
    return f"@forward:\n{body}\n@relu packed_func;\n"


@pytest.mark.parametrize(("body", "count", "want"), [
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2           dst: %3\n  ret   %3", 1, (True,)),
    # the input itself, a constant, the tensor twice, the tensor beside a reshape view of it
    ("  call  vm.builtin.make_tuple in: %0           dst: %1\n  ret   %1", 1, (False,)),
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2, c[6]       dst: %3\n  ret   %3", 2, (True, False)),
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2, %2       dst: %3\n  ret   %3", 2, (False, False)),
    (_ALLOC + "  call  vm.builtin.reshape in: %2, c[6]     dst: %3\n"
     "  call  vm.builtin.make_tuple in: %2, %3       dst: %4\n  ret   %4", 2, (False, False)),
    # a packed function's result may alias what it was given
    (_ALLOC + "  call  my_packed in: %2     dst: %3\n  call  vm.builtin.make_tuple in: %3  dst: %4\n  ret   %4",
     1, (False,)),
    # one storage backing two tensors (planned memory)
    (_ALLOC + "  call  vm.builtin.alloc_storage in: %vm, c[2], i0, c[3], c[4] dst: %1\n"
     "  call  vm.builtin.alloc_tensor in: %1, i0, c[5], c[0] dst: %2\n"
     "  call  vm.builtin.alloc_tensor in: %1, i0, c[5], c[0] dst: %3\n"
     "  call  vm.builtin.make_tuple in: %2           dst: %4\n  ret   %4", 1, (False,)),
    # a dynamic shape's check of the returned element is harmless; the element sent elsewhere is not
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2           dst: %3\n"
     "  call  vm.builtin.tuple_getitem in: %3, i0       dst: %4\n"
     "  call  vm.builtin.match_shape in: %4, %1, i2, i3, i0, i0, i16, c[4] dst: %void\n  ret   %3", 1, (True,)),
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2           dst: %3\n"
     "  call  vm.builtin.tuple_getitem in: %3, i0       dst: %4\n"
     "  call  vm.builtin.reshape in: %4, c[6]     dst: %5\n  ret   %3", 1, (False,)),
    # control flow, a tuple of another size, a wrong function
    (_ALLOC + "  goto  2\n  call  vm.builtin.make_tuple in: %2           dst: %3\n  ret   %3", 1, (False,)),
    (_ALLOC + "  call  vm.builtin.make_tuple in: %2           dst: %3\n  ret   %3", 2, (False, False)),
])
def test_the_bytecode_rule(body: str, count: int, want: tuple[bool, ...]) -> None:
    assert fresh_outputs(_listing(body), "forward", count) == want
    assert fresh_outputs(_listing(body), "backward", count) == (False,) * count


def _compiled(make, shape: tuple[int | None, ...] = (4, 16)):  # noqa: ANN001, ANN202
    b = Builder("Outputs")
    x = b.input("x", (shape, "f32"))
    b.ret(*make(b, x))
    return compile_graph(b.build(), cache=False)


@pytest.mark.parametrize("shape", [(4, 16), (None, 16)])
def test_a_fresh_output_comes_back_uncopied_and_stays_the_callers(shape: tuple[int | None, ...]) -> None:
    """relu(x): the VM's own buffer, writeable, valid after the executable is gone, not reused by a later call."""
    exe = _compiled(lambda b, x: [b.relu(x)], shape)
    x = kiln.aligned(np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    first = exe(x)
    assert not first.flags.owndata and first.flags.writeable and first.ctypes.data % 64 == 0
    second = exe(x)
    assert not np.shares_memory(first, second)
    second[...] = 5.0
    np.testing.assert_array_equal(exe(x), np.maximum(x, 0))
    del exe
    gc.collect()
    np.testing.assert_array_equal(first, np.maximum(x, 0))


@pytest.mark.parametrize(("name", "make"), [
    ("identity", lambda b, x: [x]),
    ("reshape of the input", lambda b, x: [b.reshape(x, shape=[64])]),
    ("output and its view", lambda b, x: (lambda y: [y, b.reshape(y, shape=[64])])(b.relu(x))),
    ("output and the input", lambda b, x: [b.relu(x), x]),
])
def test_an_output_that_could_alias_is_copied(name: str, make) -> None:  # noqa: ANN001
    exe = _compiled(make)
    x = kiln.aligned(np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32))
    outs = exe.run(x)
    want = [np.asarray(o) for o in make(_NumpyOps(), x)]
    for i, (got, expected) in enumerate(zip(outs, want, strict=True)):
        np.testing.assert_array_equal(got, expected, err_msg=name)
        assert not np.shares_memory(got, x), name
        assert not any(np.shares_memory(got, other) for other in outs[i + 1:]), name
    uncopied = [not o.flags.owndata for o in outs]  # a copy owns its data; the VM's buffer is a DLPack view
    assert uncopied == [name == "output and the input" and i == 0 for i in range(len(outs))], name


class _NumpyOps:
    """The oracle for the graphs above: the same Builder calls on numpy arrays."""

    @staticmethod
    def relu(x: np.ndarray) -> np.ndarray:
        return np.maximum(x, 0)

    @staticmethod
    def reshape(x: np.ndarray, shape: list[int]) -> np.ndarray:
        return x.reshape(shape)


def test_a_loaded_library_hands_back_its_fresh_outputs_too(tmp_path) -> None:  # noqa: ANN001
    """`load_executable`'s library is a plain module: its bytecode is read the same way."""
    path = str(tmp_path / "relu.so")
    _compiled(lambda b, x: [b.relu(x)]).export_library(path)
    x = kiln.aligned(np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32))
    got = load_executable(path)(x)
    assert not got.flags.owndata
    np.testing.assert_array_equal(got, np.maximum(x, 0))
