"""Register tiles on the stack (`stack_buffers.py`): a kernel's local buffers built through kiln's CPU TIR pipeline
are allocas, not a `TVMBackendAllocWorkspace` call per parallel task as TVM's own pipeline makes them; a buffer over
`STACK_LIMIT` stays a workspace; the kernel computes the same either way (against numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from kiln.runtime.tvm.stack_buffers import STACK_LIMIT
from kiln.runtime.tvm.target import cpu_target
from kiln.runtime.tvm.tir_pipeline import CPU_TIR_PIPELINE

TASKS, ROWS, LANES = 6, 8, 16
ALLOC = "TVMBackendAllocWorkspace"


def _tiled(words: int) -> tvm.tirx.PrimFunc:
    """c = 2 a + 1, each parallel task through a local buffer of `words` f32 (all written: none is compacted away)."""

    @T.prim_func
    def kernel(a: T.Buffer((TASKS * ROWS, LANES), "float32"), c: T.Buffer((TASKS * ROWS, LANES), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for task in T.parallel(TASKS):
            sums = T.decl_buffer((words,), "float32", scope="local")
            for w in range(words):
                sums[w] = a[task * ROWS + w // LANES % ROWS, w % LANES] * T.float32(2)
            for r in T.unroll(ROWS):
                c[task * ROWS + r, T.ramp(0, 1, LANES)] = sums[T.ramp(r * LANES, 1, LANES)] + T.float32(1)

    return kernel


def _built(words: int, pipeline: str) -> tuple[object, str]:
    library = tvm.compile(tvm.IRModule({"main": _tiled(words)}), target=cpu_target(), tir_pipeline=pipeline)
    return library, library.mod.inspect_source("ll")


@pytest.mark.parametrize("pipeline", [CPU_TIR_PIPELINE, "default"])
def test_tile_computes_the_same_on_either_pipeline(pipeline: str) -> None:
    library, _ = _built(ROWS * LANES, pipeline)
    a = np.random.default_rng(0).standard_normal((TASKS * ROWS, LANES)).astype(np.float32)
    c = tvm.runtime.tensor(np.full_like(a, np.nan))
    library["main"](tvm.runtime.tensor(a), c)
    np.testing.assert_array_equal(c.numpy(), 2 * a + 1)


def test_register_tile_is_on_the_stack() -> None:
    """16 vectors of sums (1 KiB, the AVX-512 tile): TVM's pipeline allocates them in a workspace, kiln's not."""
    _, default = _built(ROWS * LANES, "default")
    _, kiln = _built(ROWS * LANES, CPU_TIR_PIPELINE)
    assert ALLOC in default  # what the pass exists for: if TVM stops doing this, the pass can go
    assert ALLOC not in kiln
    assert "alloca" in kiln


def test_buffer_over_the_limit_stays_a_workspace() -> None:
    _, kiln = _built(STACK_LIMIT // 4 + LANES, CPU_TIR_PIPELINE)
    assert ALLOC in kiln
