"""Mark the elementwise and injective kernels of symbolic shapes that TVM's `AnnotateTIROpPattern` calls opaque as
injective, so that FuseOps fuses across them.

TVM calls a block injective only where every var in its loads' indices is one of the store's: a reshape over a
symbolic batch reads `x[(i * 128 + j) % (batch * 128), k]`, whose `batch` is a shape var, not an iteration var, so
every reshape (and every slice or pad whose bounds name `batch`) of a dynamic-batch program was opaque and cut
fusion where it stood: a dynamic-batch BERT layer ran its bias add, its reshape to heads, the heads' transpose, the
q/k/v slices and their casts as nine kernels, each writing its result to memory. A block whose iterations are all
spatial and whose one store writes exactly its iteration vars computes each output element once from its inputs,
whatever else its indices name: that is injective.
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
from tvm import s_tir, tirx

from .relax_rewrite import marked_kernels

INJECTIVE, OPAQUE = 2, 8  # TVM's OpPatternKind: kElemWise 0, kBroadcast 1, kInjective 2, ..., kOpaque 8


def leaf_blocks(stmt: tirx.Stmt) -> list[s_tir.SBlock] | None:
    """The blocks under `stmt` that hold a store (every block but the root), or None where anything but loops,
    sequences and blocks stands around them."""
    if isinstance(stmt, s_tir.SBlockRealize):
        return leaf_blocks(stmt.block)
    if isinstance(stmt, s_tir.SBlock) and isinstance(stmt.body, tirx.BufferStore):
        return [stmt]
    if isinstance(stmt, (s_tir.SBlock, tirx.For)):
        return leaf_blocks(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        found = [leaf_blocks(s) for s in stmt.seq]
        return None if None in found else [b for blocks in found for b in blocks]
    return None


def _stores_each_element_once(block: s_tir.SBlock) -> bool:
    """Whether the block is spatial, without an init, stores at exactly its iteration vars and reads nothing of
    what it writes (a scan, `y[i] = y[i - 1] + x[i]`, is spatial too)."""
    iters = [iv.var for iv in block.iter_vars]
    store = block.body
    indices = list(store.indices)
    return block.init is None and all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars) \
        and len(indices) == len(iters) and all(any(i.same_as(v) for i in indices) for v in iters) \
        and not any(r.source.same_as(store.buffer) for r in block.reads)


@tvm.transform.module_pass(opt_level=0, name="KilnSymbolicInjective")
def symbolic_injective(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """`mod` with each unscheduled kernel TVM marked opaque but that stores each element once marked injective."""
    def stores_once(func: tirx.PrimFunc, attrs: Mapping[str, object]) -> bool:
        if int(attrs.get("op_pattern", -1)) != OPAQUE or "tirx.is_scheduled" in attrs:
            return False
        blocks = leaf_blocks(func.body)
        return bool(blocks) and all(_stores_each_element_once(b) for b in blocks)
    return marked_kernels(mod, stores_once, "op_pattern", INJECTIVE)
