"""Fold the kernels a bound build runs on constants in one LLVM build, before Relax's FoldConstant.

Relax's FoldConstant builds every kernel it folds with its own `tvm.tirx.build` and re-walks the module after each
fold, so a ResNet-50 with its batch-norm constants (eps added, rsqrt, scale, reshapes, blocked per-channel packs:
~11 kernels per norm) spent 98 of its 109 s of building in 584 LLVM builds. This pass finds every `call_tir` whose
operands are constants or results of such calls, in binding order, builds their distinct kernels together once,
runs them in that order and binds each result as a constant; FoldConstant, which still runs after it, then only
inlines them. The kernels are the ones FoldConstant would run, for the same plain `llvm` target, so the constants
(and the build) are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .relax_rewrite import rewrite_functions, static_shape

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_EVAL_TARGET = "llvm"  # the target FoldConstant evaluates with


@dataclass(frozen=True)
class _Fold:
    """One call to evaluate: its bound var, kernel, operands (constants or earlier folds) and result type."""

    var: relax.Var
    kernel: tvm.ir.GlobalVar
    operands: tuple[relax.Expr, ...]
    result: relax.TensorType


def _static_numel(ty: relax.TensorType) -> int | None:
    """Elements of a tensor type whose shape is known and static, else None."""
    shape = static_shape(ty) if isinstance(ty, relax.TensorType) else None
    return None if shape is None else math.prod(shape)


def _plan(func: relax.Function) -> list[_Fold]:
    """The foldable calls of `func`'s top-level blocks in binding order: a `call_tir` with no shape operands, one
    static tensor result (larger than its operands too, as FoldConstant folds a broadcast or a pad to whole
    lanes), every operand a constant, a var bound to one, or a var folded earlier."""
    folds: list[_Fold] = []
    known: dict[relax.Var, int] = {}  # folded var -> its elements
    bound: dict[relax.Var, relax.Expr] = {}  # var bound to a constant -> the constant
    body = func.body
    for block in body.blocks if isinstance(body, relax.SeqExpr) else ():
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.VarBinding) and isinstance(value, tvm.ir.Constant):
                bound[binding.var] = value
            if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
                    and value.op.same_as(_CALL_TIR) and len(value.args) == 2):
                continue
            operands = tuple(bound.get(o, o) for o in value.args[1].fields)
            sizes = [_static_numel(o.ty) if isinstance(o, tvm.ir.Constant) else known.get(o) for o in operands]
            numel = _static_numel(value.ty)
            if operands and numel is not None and None not in sizes:
                folds.append(_Fold(binding.var, value.args[0], operands, value.ty))
                known[binding.var] = numel
    return folds


def _evaluate(mod: tvm.IRModule, folds: list[_Fold]) -> dict[relax.Var, relax.Expr]:
    """Run `folds` in order from one build of their distinct kernels; each var's value as a Relax constant."""
    kernels = {fold.kernel.name_hint: fold.kernel for fold in folds}
    sub = tvm.IRModule({gv: mod[gv].with_attr("global_symbol", name) for name, gv in kernels.items()})
    lib = tvm.tirx.build(sub, target=_EVAL_TARGET)
    values: dict[relax.Var, tvm.runtime.Tensor] = {}
    for fold in folds:
        args = [o.value if isinstance(o, tvm.ir.Constant) else values[o] for o in fold.operands]
        out = tvm.runtime.empty(static_shape(fold.result), fold.result.dtype, tvm.cpu())
        lib[fold.kernel.name_hint](*args, out)
        values[fold.var] = out
    return {var: relax.const(value) for var, value in values.items()}


@mutator
class _Bind(PyExprMutator):
    """Rebinds each folded var to its constant."""

    def __init__(self, mod: tvm.IRModule, constants: dict[relax.Var, relax.Expr]) -> None:
        super().__init__(mod)
        self.constants = constants

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        constant = self.constants.get(binding.var)
        if constant is None:
            super().visit_var_binding_(binding)
        else:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, constant))


def fold_constant_kernels() -> tvm.transform.Pass:
    """The module pass folding every constant kernel chain of a module with one build."""

    @tvm.transform.module_pass(opt_level=0, name="KilnFoldConstantKernels")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        plans = {gv: _plan(f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
        folds = [fold for plan in plans.values() for fold in plan]
        if not folds:
            return mod
        try:
            constants = _evaluate(mod, folds)
        except (RuntimeError, TypeError, ValueError):  # a kernel TVM cannot build or run here: FoldConstant's to try
            return mod
        return rewrite_functions(mod, _Bind(mod, constants))

    return _pass
