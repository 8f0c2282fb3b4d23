"""Keep kiln's loop-partition hints alive through TVM's index narrowing: a kernel whose loops ask to be partitioned
gets int32 indices before TVM lowers it.

A schedule rule marks a loop whose guard should leave its interior (`pragma_loop_partition_hint`: conv padding, a
plane's border columns, a row's ragged last vector). Relax gives kernels int64 shapes; TVM's `LowerOpaqueBlock` turns
the hint into an attribute of the int64 loop var, then `NarrowDataType(32)` rebuilds the loop on a new int32 var
and leaves the attribute on the old one, so `LoopPartition` finds no hinted loop and the guard stays on every
element: the lone 3x3/2 depthwise conv of 144x56² ran 272 us instead of 102. Narrowed first (TVM's
`ForceNarrowIndexToInt32`), the loop keeps its var. That pass also narrows int64 buffers, so it runs only on kernels
whose buffers are all static, none int64, each under 2^31 elements.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm_ffi.structural import structural_map

HINT = "pragma_loop_partition_hint"
_LIMIT = 2**31


def _narrowable(func: tirx.PrimFunc) -> bool:
    """Whether `func` has a hinted loop and only static, non-int64 buffers of under 2^31 elements."""
    hinted, buffers = [], [p for p in func.params if isinstance(p.ty, tirx.BufferType)]

    def loop(node: tirx.For) -> tirx.For:
        if node.annotations is not None and HINT in node.annotations:
            hinted.append(node)
        return node

    def allocation(node: tirx.AllocBuffer) -> tirx.AllocBuffer:
        buffers.append(node.buffer)
        return node

    def block(node: s_tir.SBlock) -> s_tir.SBlock:
        buffers.extend([*node.alloc_buffers, *(m.buffer for m in node.match_buffers)])
        return node

    structural_map(func.body, [(tirx.For, loop), (tirx.AllocBuffer, allocation), (s_tir.SBlock, block)])
    return bool(hinted) and all(
        all(isinstance(d, tirx.IntImm) for d in b.shape) and b.dtype != "int64"
        and math.prod(int(d) for d in b.shape) < _LIMIT for b in buffers)


@tvm.transform.module_pass(opt_level=0, name="KilnNarrowHintedKernels")
def narrow_hinted_kernels(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with every `_narrowable` kernel's indices narrowed to int32 (run before TVM's s_tir lowering)."""
    narrow = tirx.transform.ForceNarrowIndexToInt32()
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and _narrowable(func):
            mod[gvar] = narrow(tvm.IRModule({"main": func}))["main"]
    return mod
