"""Skip a scheduled contraction's products with zero padding: a conv's taps that fall on its padded border.

A conv reads its input through a materialized copy whose border stores zeros (`if_then_else(inside, x, 0)`), so a
3x3 conv over a 7x7 map sums 21 x 21 taps per channel where 19 x 19 read the map: 18% of its FMAs add zero (9% at
14², 35% for a 3x3 dilated by 2 at 7²). onnxruntime's NCHWc kernels skip them. Here the guard at the element each
product reads is split into conjuncts, and each is tested where that costs least:
- around the body of its innermost loop, where that is a serial loop of the products alone (an output row against
  the kernel rows: one test per input channel and kernel row);
- as the products' predicate, where its innermost loop is unrolled and every other loop it reads is unrolled too
  (a tile's columns against the kernel columns: TVM unrolls them, folds each predicate to a constant and drops the
  products that read padding) or holds more than the products (the tile's position in a wider map: a test per
  product that depends on the task alone).
A conjunct over a serial loop of the products inside an unrolled one (a tile spanning two output rows) stays
untested, and so does one that reads no reduction loop (padded rows of a register tile, whose sums are never
stored). A skipped product is `0 * w`, so the sums are unchanged, to the bit, for every finite weight.
"""

from __future__ import annotations

import functools

import tvm
from tvm import ir, s_tir, tirx
from tvm_ffi.structural import structural_map

_IF_THEN_ELSE = "prim.if_then_else"


def skip_padding_taps(sch: s_tir.Schedule, update: s_tir.schedule.SBlockRV,
                      padding: s_tir.schedule.SBlockRV) -> tirx.PrimFunc:
    """The scheduled function of `sch` with `update`'s products with the zeros `padding` stores skipped where its
    loops allow (module docstring); unchanged where `padding` is no zero guard or `update` is no sum of products
    reading its buffer once."""
    func = sch.mod["main"]
    block = sch.get(update)
    found = _inside_at_load(sch, block, padding)
    if found is None:
        return func
    inside, summed = found
    loop_rvs = sch.get_loops(update)
    loops = [sch.get(rv) for rv in loop_rvs]
    of_products = [_holds_only(sch, rv, block) for rv in loop_rvs]
    analyzer = tvm.sym.Analyzer()
    for loop in loops:
        analyzer.bind(loop.loop_var, ir.Range.from_min_extent(loop.min, loop.extent))
    hoisted: dict[int, list[tirx.PrimExpr]] = {}
    predicated: list[tirx.PrimExpr] = []
    for conjunct in _conjuncts(analyzer.simplify(inside)):
        used = [i for i, loop in enumerate(loops) if _reads(conjunct, loop.loop_var)]
        if not any(_reads(conjunct, var) for var in summed):
            continue  # padding along an output axis (a tile's padded rows): those sums are never stored
        deepest = used[-1]
        if loops[deepest].kind == tirx.ForKind.UNROLLED and all(
                loops[i].kind == tirx.ForKind.UNROLLED or not of_products[i] for i in used):
            predicated.append(conjunct)
        elif loops[deepest].kind == tirx.ForKind.SERIAL and of_products[deepest]:
            hoisted.setdefault(deepest, []).append(conjunct)
    if not hoisted and not predicated:
        return func
    guards = [(loops[i].loop_var, functools.reduce(tirx.And, conds)) for i, conds in hoisted.items()]

    def realize(node: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        if not node.block.same_as(block) or not predicated:
            return node
        kept = [] if _is_true(node.predicate) else [node.predicate]
        return s_tir.SBlockRealize(node.iter_values, functools.reduce(tirx.And, [*kept, *predicated]), node.block)

    def loop(node: tirx.For) -> tirx.For:
        guard = next((g for var, g in guards if var.same_as(node.loop_var)), None)
        if guard is None:
            return node
        return tirx.For(node.loop_var, node.min, node.extent, node.kind, tirx.IfThenElse(guard, node.body, None),
                        node.thread_binding, node.annotations)

    return func.with_body(structural_map(func.body, [(s_tir.SBlockRealize, realize), (tirx.For, loop)]))


def map_share(sch: s_tir.Schedule, update: s_tir.schedule.SBlockRV, padding: s_tir.schedule.SBlockRV,
              loop: s_tir.schedule.LoopRV) -> float:
    """The share of `update`'s products over `loop` (a window conv's output rows) and the one reduction loop its
    guard pairs with it (the kernel rows) that read the map rather than `padding`'s zeros, from the guard's
    conjuncts over those two loops (1 where there are none): the products a register tile within one output row
    computes once `skip_padding_taps` has skipped the rest (82 / 84 at 28² for a 3x3 conv padded by 1). Run on the
    unscheduled loops, whose extents are static."""
    block = sch.get(update)
    found = _inside_at_load(sch, block, padding)
    if found is None:
        return 1.0
    inside, summed = found
    var = sch.get(loop).loop_var
    conjuncts = [c for c in _conjuncts(inside) if _reads(c, var)]
    loops = [sch.get(rv) for rv in sch.get_loops(update)]
    pair = sorted((lp for lp in loops if any(_reads(c, lp.loop_var) for c in conjuncts)),
                  key=lambda lp: not lp.loop_var.same_as(var))  # the rows first
    pair_vars = [lp.loop_var for lp in pair]
    if len(pair) != 2 or not any(v.same_as(s) for v in pair_vars for s in summed) \
            or not all(any(v.same_as(p) for p in pair_vars) for c in conjuncts for v in _vars(c)):
        return 1.0  # not the output rows against one reduction loop alone
    (rows, taps), other = (lp.extent for lp in pair), pair_vars[1]
    if not isinstance(rows, tirx.IntImm) or not isinstance(taps, tirx.IntImm):
        return 1.0
    analyzer = tvm.sym.Analyzer()
    guard = functools.reduce(tirx.And, conjuncts)
    read = sum(bool(analyzer.simplify(_substitute(guard, {var: tirx.IntImm(str(var.ty), i),
                                                          other: tirx.IntImm(str(other.ty), r)})))
               for i in range(int(rows)) for r in range(int(taps)))
    return read / (int(rows) * int(taps))


def _inside_at_load(sch: s_tir.Schedule, block: s_tir.SBlock, padding: s_tir.schedule.SBlockRV
                    ) -> tuple[tirx.PrimExpr, list[tirx.Var]] | None:
    """`padding`'s guard at the element `block` reads, over the loops around `block`, and the loop vars its
    reduction iter vars are bound to; None where `padding` is no `if_then_else(guard, x, 0)` of its iter vars or
    `block` is no `C = C + A * B` reading its buffer once."""
    store, value = sch.get(padding).body, block.body
    if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, ir.Call)
            and getattr(store.value.op, "name", "") == _IF_THEN_ELSE and _is_zero(store.value.args[2])):
        return None
    if not isinstance(value, tirx.BufferStore) or not isinstance(value.value, tirx.Add) \
            or not isinstance(value.value.b, tirx.Mul):
        return None
    loads = [load for load in _collect(value.value, ir.TensorLoad) if load.source.same_as(store.buffer)]
    if len(loads) != 1:
        return None
    at_load = {index: read for index, read in zip(store.indices, loads[0].indices) if isinstance(index, tirx.Var)}
    if len(at_load) != len(sch.get(padding).iter_vars):
        return None
    realize = next(r for r in _collect(sch.mod["main"].body, s_tir.SBlockRealize) if r.block.same_as(block))
    bindings = dict(zip((iv.var for iv in block.iter_vars), realize.iter_values))
    summed = [var for iv, bound in zip(block.iter_vars, realize.iter_values)
              if iv.iter_type == tirx.IterVar.CommReduce for var in _vars(bound)]
    return _substitute(_substitute(store.value.args[0], at_load), bindings), summed


def _holds_only(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, block: s_tir.SBlock) -> bool:
    """Whether `block` is the only block under `loop`."""
    return all(sch.get(child).same_as(block) for child in sch.get_child_blocks(loop))


def _is_zero(value: tirx.PrimExpr) -> bool:
    return isinstance(value, tirx.FloatImm | tirx.IntImm) and value.value == 0


def _is_true(value: tirx.PrimExpr | bool) -> bool:
    return value is True or isinstance(value, tirx.IntImm) and value.value == 1


def _collect(node: object, kind: type) -> list:
    found: list = []
    structural_map(node, [(kind, lambda item: found.append(item) or item)])
    return found


def _vars(expr: tirx.PrimExpr) -> list[tirx.Var]:
    return _collect(expr, tirx.Var)


def _reads(expr: tirx.PrimExpr, var: tirx.Var) -> bool:
    return any(v.same_as(var) for v in _vars(expr))


def _substitute(expr: tirx.PrimExpr, values: dict[tirx.Var, tirx.PrimExpr]) -> tirx.PrimExpr:
    return structural_map(expr, [(tirx.Var, lambda var: next((v for k, v in values.items() if k.same_as(var)), var))])


def _conjuncts(expr: tirx.PrimExpr) -> list[tirx.PrimExpr]:
    return [*_conjuncts(expr.a), *_conjuncts(expr.b)] if isinstance(expr, tirx.And) else [expr]
