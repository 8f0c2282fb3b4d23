"""Elementwise consumers of a bf16 product computed in its kernel's store (after FuseTIR): AMX tiles' or
`vdpbf16ps`'s (`amx.product_kernel` rebuilds whichever the target gets).

The tile kernel is opaque to FuseOps, so the bias, gelu and bf16 cast after the FFN's first product (and the bias
and residual add after the others) were a kernel of their own that read the product's f32 result back from memory:
at 1024 x 3072 that is 12 MiB written and read again. This pass finds each tile kernel call whose result has one
user, an elementwise kernel that reads it element for element (same flat position, same last dim: a bias, a
residual, an activation, a cast, reshapes between them), and rebuilds the tile kernel with that kernel's
computation as its `bf16_layout.Epilogue`: on tiles each 32 x 32 block of C goes to a local block and from there
through the epilogue to the consumer's output; the dot kernel computes it from its register sums. Anything else (a
transpose, a reduction, padding, symbolic shapes the consumer's indices cannot be proven to follow) is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .amx import _flattened, _unflattened, bf16_products, product_kernel
from .bf16_layout import TILE_PARAMS, Epilogue
from .relax_rewrite import element_count, use_counts
from .schedules.injective import cpu_blocks

_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max,
           tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or)


class _Unsupported(Exception):
    """An expression node `_rebuilt` does not know: the consumer stays a kernel of its own."""


def _rebuilt(expr: tirx.PrimExpr, var: Callable[[tirx.Var], tirx.PrimExpr],
             load: Callable[[TensorLoad, list[tirx.PrimExpr]], tirx.PrimExpr]) -> tirx.PrimExpr:
    """`expr` rebuilt bottom-up with each var replaced by `var(v)` and each load by `load(node, new indices)` (TVM
    0.27 exposes no TIR substitution to Python); raises `_Unsupported` on a node kind it does not know."""
    def visit(e: tirx.PrimExpr) -> tirx.PrimExpr:
        if isinstance(e, tirx.Var):
            return var(e)
        if isinstance(e, TensorLoad):
            return load(e, [visit(i) for i in e.indices])
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e
        if isinstance(e, _BINARY):
            return type(e)(visit(e.a), visit(e.b))
        if isinstance(e, tirx.Cast):
            return tirx.Cast(e.ty.dtype, visit(e.value))
        if isinstance(e, tirx.Not):
            return tirx.Not(visit(e.a))
        if isinstance(e, tirx.Select):
            return tirx.Select(visit(e.condition), visit(e.true_value), visit(e.false_value))
        if isinstance(e, Call) and isinstance(e.op, tvm.ir.Op):
            return Call(e.op, [visit(a) for a in e.args], e.attrs, e.ty_args, ret_ty=e.ty)
        raise _Unsupported(type(e).__name__)
    return visit(expr)


def _loads_of(expr: tirx.PrimExpr, buffer: tirx.Buffer) -> list[TensorLoad]:
    """Every load of `buffer` in `expr` (`_Unsupported` if `expr` has a node `_rebuilt` does not know)."""
    found: list[TensorLoad] = []

    def load(e: TensorLoad, _indices: list[tirx.PrimExpr]) -> tirx.PrimExpr:
        if e.source.same_as(buffer):
            found.append(e)
        return e
    _rebuilt(expr, lambda v: v, load)
    return found


def _is_one(d: tirx.PrimExpr) -> bool:
    return isinstance(d, tirx.IntImm) and int(d) == 1


def consumer_epilogue(func: tirx.PrimFunc, c_at: int, target: Target) -> Epilogue | None:
    """`func` (an elementwise kernel whose parameter `c_at` is a tile product C [batch, Mp, Np] and whose last is
    its output) as an `Epilogue` of the product, or None: it must inline to one block storing each output element
    from C's element at the same row (flat position of the leading dims) and column, with a static last dim. An
    output of fewer rows (M without the padding of C's `Mp`) keeps its own: the rows past it, wrapped by the flat
    index, had overwritten its first rows with the padding's products (a 37-row bf16 linear lost 27 rows to its
    bias). One of fewer columns (N without the padding of C's panels: a linear to 77 or 1000 features) keeps only
    its own columns (`Epilogue.columns`); refused, such a consumer stayed a kernel that read C back, and a
    7 x 37-77-1000-10 MLP ran slower in bf16 than in f32."""
    params = list(func.params)
    c, out = params[c_at], params[-1]  # a TIR parameter is its buffer
    sch, infos = cpu_blocks(func, target)
    if infos is None or not all(info.is_injective() for info in infos) \
            or not all(isinstance(d, tirx.IntImm) for d in (c.shape[-1], out.shape[-1])):
        return None
    rest = dl.try_inline(sch, infos)
    block = sch.get(rest[0].block_rv) if len(rest) == 1 else None
    store = block.body if block is not None else None
    if not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(out):
        return None
    index = list(store.indices)  # each an iteration var, or 0 on a dim of 1 (dlight drops unit loops)
    iter_vars = [iv.var for iv in block.iter_vars]
    if not all(any(i.same_as(v) for i in index) for v in iter_vars) or not all(
            isinstance(i, tirx.Var) or (isinstance(i, tirx.IntImm) and int(i) == 0 and _is_one(d))
            for i, d in zip(index, out.shape, strict=True)):
        return None
    analyzer = tvm.sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    lead, c_lead = list(out.shape[:-1]), list(c.shape[:-1])
    try:
        loads = _loads_of(store.value, c)
    except _Unsupported:
        return None
    flat = _flattened(tuple(index[:-1]), lead)
    if int(out.shape[-1]) > int(c.shape[-1]) or not isinstance(index[-1], tirx.Var) or not all(
            analyzer.can_prove_equal(ld.indices[-1], index[-1])
            and analyzer.can_prove_equal(_flattened(tuple(ld.indices[:-1]), c_lead), flat) for ld in loads):
        return None
    rows, stored = c.shape[1], analyzer.simplify(element_count(lead))  # C's rows a batch; the output's rows in all

    def at(b: tirx.PrimExpr, row: tirx.PrimExpr, col: tirx.PrimExpr) -> list[tirx.PrimExpr]:
        return [*_unflattened(b * rows + row, lead), col]

    def inside(b: tirx.PrimExpr, row: tirx.PrimExpr) -> tirx.PrimExpr:
        return b * rows + row < stored

    def value(b: tirx.PrimExpr, row: tirx.PrimExpr, col: tirx.PrimExpr, c_value: tirx.PrimExpr) -> tirx.PrimExpr:
        where = at(b, row, col)

        def var(v: tirx.Var) -> tirx.PrimExpr:
            return next((w for i, w in zip(index, where, strict=True) if i.same_as(v)), v)

        def load(e: TensorLoad, indices: list[tirx.PrimExpr]) -> tirx.PrimExpr:
            return c_value if e.source.same_as(c) else tirx.BufferLoad(e.source, indices)
        return _rebuilt(store.value, var, load)
    inputs = tuple(p for i, p in enumerate(params[:-1]) if i != c_at)
    every_row = analyzer.can_prove_equal(stored, element_count(c_lead))
    columns = int(out.shape[-1])
    return Epilogue(inputs, out, value, at, None if every_row else inside,
                    None if columns == int(c.shape[-1]) else columns)


def _tiled(mod: tvm.IRModule, call: relax.Expr) -> list[int] | None:
    """The tile kernel geometry (`TILE_PARAMS`) of a `call_tir` of a tile kernel, else None."""
    func = _callee(mod, call)
    attrs = func.attrs if isinstance(func, tirx.PrimFunc) and func.attrs is not None else {}
    return [int(v) for v in attrs[TILE_PARAMS]] if TILE_PARAMS in attrs else None


def _callee(mod: tvm.IRModule, call: relax.Expr) -> tvm.ir.BaseFunc | None:
    """The PrimFunc a `call_tir` (without symbolic-var arguments) calls, else None."""
    if not (isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get("relax.call_tir")) and len(call.args) == 2):
        return None
    return mod[call.args[0]]


def _fused_block(mod: tvm.IRModule, builder: relax.BlockBuilder, block: relax.DataflowBlock,
                 uses: dict[relax.Var, int], target: Target) -> relax.DataflowBlock:
    """`block` with each tile product whose one user is an elementwise kernel it can take in computed by one
    tile kernel with that epilogue."""
    bindings = list(block.bindings)
    user = {var: b for b in bindings for var in relax.analysis.free_vars(b.value)}
    dropped: set[int] = set()
    replaced: dict[int, relax.VarBinding] = {}
    for i, b in enumerate(bindings):
        geometry = _tiled(mod, b.value)
        consumer = user.get(b.var) if geometry is not None and uses.get(b.var) == 1 else None
        func = _callee(mod, consumer.value) if consumer is not None else None
        if not isinstance(func, tirx.PrimFunc) or bindings.index(consumer) in replaced:  # one product per consumer
            continue
        fields = list(consumer.value.args[1].fields)
        at = [j for j, f in enumerate(fields) if f.same_as(b.var)]
        epilogue = consumer_epilogue(func, at[0], target) if len(at) == 1 else None
        if epilogue is None:
            continue
        kernel, name = product_kernel(target, *geometry[:3], bool(geometry[3]), epilogue)
        kernel = builder.add_func(kernel, f"{name}_epilogue")
        args = [*b.value.args[1].fields, *(f for j, f in enumerate(fields) if j != at[0])]
        dropped.add(i)
        replaced[bindings.index(consumer)] = relax.VarBinding(
            consumer.var, relax.call_tir(kernel, args, consumer.var.ty))
    if not dropped:
        return block
    kept = [replaced.get(i, b) for i, b in enumerate(bindings) if i not in dropped]
    return relax.DataflowBlock(kept, block.span)


def amx_epilogues(target: Target) -> tvm.transform.Pass:
    """The module pass (after FuseTIR) computing each tile product's elementwise consumer in the tile kernel's
    store where it can (`consumer_epilogue`); nothing for a target without tiles."""

    @tvm.transform.module_pass(opt_level=0, name="KilnAmxEpilogues")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not bf16_products(target):
            return mod
        builder = relax.BlockBuilder(mod)
        changed = False
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            uses = use_counts(func)
            blocks = [_fused_block(mod, builder, block, uses, target) if isinstance(block, relax.DataflowBlock)
                      else block for block in func.body.blocks]
            if any(new is not old for new, old in zip(blocks, func.body.blocks, strict=True)):
                changed = True
                builder.update_func(gvar, relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                                         func.ret_ty, func.is_pure, func.attrs, func.span))
        return relax.transform.DeadCodeElimination()(builder.get()) if changed else mod  # drop what it took in

    return _pass
