"""Loop-partition hints survive kiln's CPU TIR pipeline (`partition_hints.py`): a hinted loop over int64 indices, as
Relax's kernels have them, leaves its guard outside the partitioned interior, where TVM's own pipeline keeps it on
every element; kernels the int32 narrowing could break (int64 data, symbolic or huge shapes) are left alone; the
narrowed kernel computes the same (against numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.s_tir.pipeline import default_s_tir_pipeline
from tvm.script import tirx as T

from kiln.runtime.tvm.partition_hints import HINT, narrow_hinted_kernels
from kiln.runtime.tvm.target import cpu_target
from kiln.runtime.tvm.tir_pipeline import CPU_TIR_PIPELINE

N = 64


def _padded_copy(dtype: str = "float32", hint: bool = True) -> tvm.tirx.PrimFunc:
    """b = a with one zero before and after, its loop over int64 indices hinted for partitioning."""
    annotations = {HINT: 1} if hint else {}

    @T.prim_func(s_tir=True)
    def kernel(a: T.Buffer((T.int64(N),), dtype), b: T.Buffer((T.int64(N + 2),), dtype)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i in T.serial(T.int64(N + 2), annotations=annotations):
            with T.sblock("pad"):
                v = T.axis.spatial(T.int64(N + 2), i)
                b[v] = T.if_then_else(T.int64(1) <= v and v < T.int64(N + 1), a[v - T.int64(1)], T.Cast(dtype, 0))

    return kernel


def _lowered(func: tvm.tirx.PrimFunc, kiln_pass: bool) -> str:
    target = cpu_target()
    mod = tvm.tirx.transform.BindTarget(target.with_host(target))(tvm.IRModule({"main": func}))
    lower = default_s_tir_pipeline()[0]
    with target:
        return (lower(narrow_hinted_kernels(mod)) if kiln_pass else lower(mod))["main"].script()


def test_a_hinted_int64_loop_is_partitioned_only_through_kilns_pipeline() -> None:
    """Through kiln's pass the copy's interior is a loop of its own, the border elements stored apart, while TVM's
    pipeline alone keeps the guarded loop over all 66 elements."""
    kiln, tvm_only = _lowered(_padded_copy(), True), _lowered(_padded_copy(), False)
    assert f"range({N})" in kiln and f"range({N + 2})" not in kiln
    assert f"range({N + 2})" in tvm_only


@pytest.mark.parametrize(("dtype", "hint"), [("int64", True), ("float32", False)], ids=["int64-data", "no-hint"])
def test_kernels_the_narrowing_could_change_are_left_alone(dtype: str, hint: bool) -> None:
    """int64 data (the narrowing would make it int32) and a kernel with no hinted loop keep their int64 indices."""
    func = _padded_copy(dtype, hint)
    assert narrow_hinted_kernels(tvm.IRModule({"main": func}))["main"].same_as(func)


def test_a_symbolic_shape_is_left_alone() -> None:
    @T.prim_func(s_tir=True)
    def kernel(a_handle: T.handle, b_handle: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        n = T.int64()
        a = T.match_buffer(a_handle, (n,), "float32")
        b = T.match_buffer(b_handle, (n,), "float32")
        for i in T.serial(n, annotations={HINT: 1}):
            with T.sblock("copy"):
                v = T.axis.spatial(n, i)
                b[v] = a[v]

    assert narrow_hinted_kernels(tvm.IRModule({"main": kernel}))["main"].same_as(kernel)


def test_the_narrowed_kernel_computes_the_padded_copy() -> None:
    library = tvm.compile(tvm.IRModule({"main": _padded_copy()}), target=cpu_target(), tir_pipeline=CPU_TIR_PIPELINE)
    a = np.arange(1, N + 1, dtype=np.float32)
    b = tvm.runtime.tensor(np.full(N + 2, 7, np.float32))
    library["main"](tvm.runtime.tensor(a), b)
    np.testing.assert_array_equal(b.numpy(), np.concatenate([[0], a, [0]]))
