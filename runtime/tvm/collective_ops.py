"""Relax lowering of the collectives: a call, from inside the Relax VM, of a packed function kiln registers, which
runs the collective through the communicator installed for the run (`kiln.ir.ops.collective.communicating`), the
identity on one process. The VM's own buffers reach it by DLPack, without copies.

Why a packed call and not a step split into TVM segments at each collective: the executable stays one function (one
build, one cache entry, one VM call per step, the VM's memory planning across the whole step), and the callback is
the same code the interpreter backend runs, so the two backends cannot disagree on what a collective means.
"""

from __future__ import annotations

import numpy as np
import tvm_ffi
from tvm import relax

from kiln.ir.ops.collective import REDUCTIONS, current_communicator

from .rule import OpCall, RelaxResult, relax_rule


def _all_reduce(op: str, group: str):
    def run(*tensors) -> None:  # destination-passing: the operands, then the results
        n = len(tensors) // 2
        arrays = [np.from_dlpack(t) for t in tensors[:n]]
        communicator = current_communicator()
        reduced = arrays if communicator is None else communicator.all_reduce(arrays, op, group)
        for out, value in zip(tensors[n:], reduced):
            np.from_dlpack(out)[...] = value
    return run


def packed_name(op: str, group: str) -> str:
    """The packed function running `all_reduce {op, group}`, registered on first use."""
    name = f"kiln.all_reduce.{op}.{group}"
    if tvm_ffi.get_global_func(name, allow_missing=True) is None:
        tvm_ffi.register_global_func(name, _all_reduce(op, group))
    return name


for _op in REDUCTIONS:  # the world group's functions exist as soon as the rules do (a loaded artifact calls them)
    packed_name(_op, "world")


@relax_rule("all_reduce")
def _all_reduce_rule(call: OpCall) -> RelaxResult:
    outs = [relax.TensorType(call.shape(i), call.dtype(i)) for i in range(len(call.args))]
    name = packed_name(call.attrs["op"], call.attrs["group"])
    result = call.emit(relax.call_dps_packed(name, list(call.args), out_ty=outs[0] if len(outs) == 1 else outs))
    if len(outs) == 1:
        return result
    return tuple(relax.TupleGetItem(result, i) for i in range(len(outs)))
