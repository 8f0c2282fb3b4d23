"""Lower kiln functions to Relax: one Relax function per kiln function, built op by op with a BlockBuilder.

* Dynamic dims (`?`) of the inputs become TVM symbolic vars, one per input position, so one compiled function
  serves every size. Positions that meet in a broadcast (say the batch dims of `x + y`) are unified into one
  var: the first attempt that makes Relax lose a shape names the pair, and lowering restarts with them merged.
* Stored parameters are Relax constants (`params="bound"`, for deployment: TVM folds and pre-computes with
  them) or trailing function inputs (`params="inputs"`, for training: one build serves every weight value).
* Derived parameters (reparam nodes such as `lora`) are computed inside the function from their stored bases.
* Flags lower to constants of their effective value: rules such as `dropout` and `batch_norm` specialize on them.
* f16 and bf16 arithmetic runs in `DType.compute` (f32) with results rounded to the declared dtype, as the
  interpreter does; ops with `Trait.EXACT` (data movement, `where`, `cast`, sources) run in their own dtype.
* A result with a static zero-length dim, and a zero-size parameter, is an empty allocation: no kernel is built
  for it (LLVM cannot vectorize a zero-extent loop) and no constant is embedded (a zero-size one does not load).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.target import Target

from kiln.ir import (
    FlagNode,
    Graph,
    KilnError,
    Operand,
    ParamNode,
    ReparamNode,
    SymRef,
    TensorType,
    Trait,
    Value,
    registry,
)
from kiln.ir.interpreter import param_value
from kiln.ir.location import located
from kiln.ir.symbols import SymbolResolver

from . import collective_ops, nn_ops, ops, quant_ops, random_ops, shape_ops, spatial_ops  # noqa: F401  (register rules)
from .dtypes import check_lowerable, to_storage, tvm_dtype
from .op_map import OpSources
from .rule import NeedsSeed, OpCall
from .signature import FunctionSignature

PARAM_MODES = ("bound", "inputs")

DimKey = tuple[int, int]  # (input index, axis)


@dataclass(frozen=True)
class Lowered:
    """A Relax module with one function per lowered kiln function, and their calling conventions."""

    module: tvm.IRModule
    signatures: dict[str, FunctionSignature]
    sources: dict[str, OpSources]  # per function: which kiln ops made what (for `op_map.build_map`)


class _Unify(Exception):
    """Two input dims met in a broadcast; lowering restarts with them as one symbolic var."""

    def __init__(self, a: DimKey, b: DimKey):
        super().__init__(a, b)
        self.pair = (a, b)
        self.op: int | None = None  # the index of the kiln op whose lowering met them


@dataclass
class _Plan:
    """What earlier attempts learned: which input dims are one var, and whether the function needs a seed; and the
    build's precision mode and target, which every rule sees on its `OpCall`."""

    parent: dict[DimKey, DimKey] = field(default_factory=dict)
    seeded: bool = False
    unifiers: dict[DimKey, list[int]] = field(default_factory=dict)  # a dim -> the ops that met it in a broadcast
    precision: str = "f32"
    target: Target | None = None

    @staticmethod
    def named(args: Sequence[TensorType]) -> _Plan:
        """The first plan: input dims of one name (ONNX's dim_param) are one var from the start."""
        plan, first = _Plan(), {}
        for index, t in enumerate(args):
            for axis, name in enumerate(t.names):
                if name is not None:
                    plan.merge(first.setdefault(name, (index, axis)), (index, axis))
        return plan

    def find(self, key: DimKey) -> DimKey:
        while self.parent.get(key, key) != key:
            key = self.parent[key]
        return key

    def merge(self, a: DimKey, b: DimKey) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
            self.unifiers.setdefault(min(a, b), []).extend(self.unifiers.pop(max(a, b), []))


def _identifier(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _empty(bb: relax.BlockBuilder, shape: Sequence[int | tirx.PrimExpr], dtype: str) -> relax.Var:
    """An uninitialized tensor of `shape` (which holds a zero, so it has no elements): an allocation, no kernel."""
    return bb.emit(relax.op.builtin.alloc_tensor(relax.ShapeExpr(list(shape)), dtype, 0))


def _has_zero_dim(t: TensorType) -> bool:
    return 0 in t.shape


def used_params(graph: Graph, function: str) -> list[ParamNode]:
    """The stored parameters a function reads, directly or through derived parameters, in graph order."""
    fn = graph.functions[function]
    seen = graph.reads([o.name for op in fn.ops for o in op.operands if isinstance(o, SymRef)]
                       + [r.name for r in fn.results if isinstance(r, SymRef)])
    return [p for name, p in graph.params.items() if name in seen]


class _FunctionLowering:
    """One attempt at lowering one kiln function into a block builder."""

    def __init__(self, graph: Graph, name: str, params: str, plan: _Plan):
        self.graph, self.fn, self.params, self.plan = graph, graph.functions[name], params, plan
        self.dims: dict[tirx.Var, DimKey] = {}
        self.param_vars: dict[str, relax.Var] = {}
        self.run_seed: relax.Var | None = None
        self.made: dict[int, tuple[relax.Expr, OpCall]] = {}  # id(emitted expr) -> (it, the call that made it)
        self.opened = False  # whether the builder holds this function's (unfinished) scope
        self.sources = OpSources()

    def _input_var(self, index: int, name: str, t: TensorType) -> relax.Var:
        check_lowerable(f"input %{name} of @{self.fn.name}", t.dtype)
        shape = []
        for axis, d in enumerate(t.shape):
            if d is not None:
                shape.append(d)
                continue
            root = self.plan.find((index, axis))
            var = next((v for v, k in self.dims.items() if self.plan.find(k) == root), None)
            if var is None:
                named = self.fn.args[root[0]].type.names
                var = tirx.Var(_identifier(named[root[1]]) if named and named[root[1]] else
                               f"{_identifier(self.fn.args[root[0]].name or 'x')}_{root[1]}", "int64")
            self.dims.setdefault(var, root)
            shape.append(var)
        return relax.Var(_identifier(name), relax.TensorType(shape, tvm_dtype(t.dtype)))

    def emit(self, bb: relax.BlockBuilder) -> FunctionSignature:
        inputs = [self._input_var(i, a.name or f"x{i}", a.type) for i, a in enumerate(self.fn.args)]
        stored = used_params(self.graph, self.fn.name) if self.params == "inputs" else []
        for p in stored:
            self.param_vars[p.name] = relax.Var("p_" + _identifier(p.name),
                                                relax.TensorType(list(p.type.shape), tvm_dtype(p.type.dtype)))
        extra: list[relax.Var] = list(self.param_vars.values())
        if self.plan.seeded:
            self.run_seed = relax.Var("seed", relax.TensorType([], "int64"))
            extra.append(self.run_seed)
        env: dict[int, tuple[relax.Expr, np.ndarray | None]] = {id(a): (v, None) for a, v in zip(self.fn.args, inputs)}
        self.symbols = self._resolver(bb)
        with bb.function(self.fn.name, [*inputs, *extra]):
            self.opened = True
            with bb.dataflow():
                for index, op in enumerate(self.fn.ops):
                    operands = [self._operand(o, env) for o in op.operands]
                    try:
                        outs = self.apply(bb, op.kind, operands, [o.type for o in op.operands], op.attrs,
                                          [r.type for r in op.results])
                    except KilnError as e:  # names the user's line and layer
                        raise located(op.loc, e) from None
                    except _Unify as e:
                        e.op = index
                        raise
                    self.sources.made(index, [o.name for o in outs if isinstance(o, relax.Var)],
                                      [_identifier(a.name or f"x{i}") for i, a in enumerate(self.fn.args)
                                       if any(o is a for o in op.operands)])
                    known = op.attrs["value"] if op.kind == "constant" else None
                    env.update((id(r), (e, known)) for r, e in zip(op.results, outs))
                results = [self._operand(r, env)[0] for r in self.fn.results]
                output = bb.emit_output(relax.Tuple(results))
            bb.emit_func_output(output)
        self.opened = False
        for var, key in self.dims.items():
            self.sources.add(var.name, self.plan.unifiers.get(self.plan.find(key), ()))
        return FunctionSignature(self.fn.name, tuple((a.name or f"x{i}", a.type) for i, a in enumerate(self.fn.args)),
                                 tuple((p.name, p.type) for p in stored), self.fn.result_types, self.plan.seeded)

    def _operand(self, o: Operand, env: dict) -> tuple[relax.Expr, np.ndarray | None]:
        if isinstance(o, Value):
            return env[id(o)]
        return self.symbols(o.name)

    def _resolver(self, bb: relax.BlockBuilder) -> SymbolResolver[tuple[relax.Expr, np.ndarray | None]]:
        """Parameters as inputs or constants, flags as constants of their effective value, derived parameters
        computed in the function."""
        def param(node: ParamNode) -> tuple[relax.Expr, np.ndarray | None]:
            value = self.param_vars.get(node.name)
            if value is None and _has_zero_dim(node.type):
                value = _empty(bb, node.type.shape, tvm_dtype(node.type.dtype))
            elif value is None:
                value = relax.const(to_storage(param_value(node), node.type.dtype), tvm_dtype(node.type.dtype))
            return value, None

        def flag(node: FlagNode) -> tuple[relax.Expr, np.ndarray | None]:
            value = np.asarray(node.value)
            return relax.const(value, "bool"), value

        def derive(node: ReparamNode, operands: list, types: list[TensorType]) -> tuple[relax.Expr, None]:
            return self.apply(bb, node.kind, operands, types, dict(node.attrs), [node.type])[0], None

        return SymbolResolver(self.graph, param, flag, derive)

    def apply(self, bb: relax.BlockBuilder, kind: str, operands: Sequence[tuple[relax.Expr, np.ndarray | None]],
              types: Sequence[TensorType], attrs: dict, results: Sequence[TensorType]) -> list[relax.Expr]:
        """Run the op's Relax rule and emit its results, checked against (and cast to) the declared types; a result
        with a static zero dim is an empty allocation (the rule runs only to give the shape of its `?` dims)."""
        opdef = registry.lookup(kind)
        for role, ts in (("operand", types), ("result", results)):
            for i, t in enumerate(ts):
                check_lowerable(f"{kind}: {role} {i}", t.dtype)
        rule = opdef.rules.get("relax")
        if rule is None:
            raise KilnError(f"op {kind!r} has no Relax lowering")
        args = [e for e, _ in operands]
        if not opdef.has(Trait.EXACT):
            args = [a if t.dtype.compute is t.dtype else bb.emit(relax.op.astype(a, tvm_dtype(t.dtype.compute)))
                    for a, t in zip(args, types)]
            types = [t.with_dtype(t.dtype.compute) for t in types]
        producers = [self.made.get(id(e), (None, None))[1] for e, _ in operands]
        call = OpCall(kind, bb, args, types, [k for _, k in operands], attrs, self.run_seed, producers,
                      self.plan.precision, self.plan.target)
        if results and all(_has_zero_dim(t) and None not in t.shape for t in results):
            outs: tuple = (None,) * len(results)
        else:
            outs = rule(call)
            outs = outs if isinstance(outs, tuple) else (outs,)
        emitted = []
        for expr, want in zip(outs, results):
            if expr is not None and not isinstance(expr, relax.Var | tvm.ir.expr.Constant):
                expr = bb.emit(expr)
            if _has_zero_dim(want) and (expr is None or isinstance(expr.ty.shape, relax.ShapeExpr)):
                got = expr.ty.shape.values if expr is not None else want.shape
                expr = _empty(bb, [g if w is None else w for w, g in zip(want.shape, got)], tvm_dtype(want.dtype))
            if expr.ty.dtype != tvm_dtype(want.dtype):
                expr = bb.emit(relax.op.astype(expr, tvm_dtype(want.dtype)))
            self._check_shape(kind, expr, want, args)
            self.made[id(expr)] = (expr, call)
            emitted.append(expr)
        return emitted

    def _check_shape(self, kind: str, expr: relax.Expr, want: TensorType, args: Sequence[relax.Expr]) -> None:
        """Relax must know the result's shape and agree with kiln's static dims; an unknown shape from two input
        dims meeting in a broadcast asks for them to be unified."""
        shape = expr.ty.shape
        if isinstance(shape, relax.ShapeExpr):
            got = list(shape.values)
            if len(got) == want.rank and all(w is None or (isinstance(g, tirx.IntImm) and g.value == w)
                                             for g, w in zip(got, want.shape)):
                return
            raise KilnError(f"{kind}: lowered to shape {got} but its type is {want}")
        shapes = [a.ty.shape.values for a in args if isinstance(a.ty, relax.TensorType)
                  and isinstance(a.ty.shape, relax.ShapeExpr)]
        for offset in range(1, max((len(s) for s in shapes), default=0) + 1):
            keys = {self.dims[d] for s in shapes if len(s) >= offset for d in [s[-offset]] if d in self.dims}
            if len({self.plan.find(k) for k in keys}) > 1:
                a, b = sorted(keys)[:2]
                raise _Unify(a, b)
        raise KilnError(f"{kind}: Relax cannot infer the result shape (type {want}) from operand shapes {shapes}")


def _emit(graph: Graph, name: str, params: str, plan: _Plan, bb: relax.BlockBuilder
          ) -> tuple[FunctionSignature, OpSources]:
    """Lower one function into `bb`; on failure close the builder's open scope (it is not reused)."""
    lowering = _FunctionLowering(graph, name, params, plan)
    try:
        return lowering.emit(bb), lowering.sources
    except Exception:
        if lowering.opened:
            bb._end_block()
            bb.end_scope()
        raise


def _lower_function(graph: Graph, name: str, params: str, bb: relax.BlockBuilder, precision: str = "f32",
                    target: Target | None = None) -> tuple[FunctionSignature, OpSources]:
    """Find the dim unification and seed the function needs with trial lowerings, then emit it into `bb`."""
    fn = graph.functions[name]
    plan = _Plan.named([a.type for a in fn.args])
    plan.precision, plan.target = precision, target
    for _ in range(sum(a.type.shape.count(None) for a in fn.args) + 2):
        try:
            _emit(graph, name, params, plan, relax.BlockBuilder())
            break
        except _Unify as e:
            plan.merge(*e.pair)
            if e.op is not None:
                plan.unifiers.setdefault(plan.find(e.pair[0]), []).append(e.op)
        except NeedsSeed:
            plan.seeded = True
    return _emit(graph, name, params, plan, bb)


def lower(graph: Graph, params: str = "bound", functions: Sequence[str] | None = None,
          precision: str = "f32", target: Target | None = None) -> Lowered:
    """Lower `functions` (default: all) of `graph` into one Relax module; `precision` is a resolved mode
    (`lowp.resolve_precision`: f32, bf16 or int8) and `target` the CPU it is for, where a rule picks instructions
    by CPU (bf16 on AMX tiles); None lowers for no particular CPU."""
    if params not in PARAM_MODES:
        raise KilnError(f"params must be one of {', '.join(PARAM_MODES)}, not {params!r}")
    names = list(functions) if functions is not None else list(graph.functions)
    for name in names:
        if name not in graph.functions:
            raise KilnError(f"module @{graph.name} has no function @{name}")
    bb = relax.BlockBuilder()
    done = {name: _lower_function(graph, name, params, bb, precision, target) for name in names}
    return Lowered(bb.get(), {n: sig for n, (sig, _) in done.items()}, {n: src for n, (_, src) in done.items()})
