"""Blocked regions: a Relax rewrite before legalization that computes the convs the CPU model blocks in NCHW[x]c
(`conv_layout.py`) and keeps their activations in that layout through the elementwise ops after them (bias add,
relu/clip, batch norm's scale and shift, a residual add, max and average pooling, a depthwise conv) and into the
next blocked conv.

Every value of a region is also bound in NCHW (`from_blocked` of its blocked form), for the consumers that are not
blocked (flatten, a global mean, matmul, the outputs); dead code elimination drops the unread ones. A region's
first conv reads its NCHW input in place, so a chain converts once, on the way out. An NCHW operand of a blocked
elementwise op (the skip branch of a residual add) is converted once (`to_blocked`), and a per-channel one (a bias
`[C, 1, 1]`) is blocked as a `[1, C, 1, 1]` map, which FoldConstant packs at build time when it is a constant.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .conv_layout import (
    BLOCKED_NAME,
    DEPTHWISE_NAME,
    blocked_conv,
    blocked_depthwise,
    blocks_output_channels,
    from_blocked,
    pack_te,
    pack_weight,
    pixel_rows,
    to_blocked,
)
from .cpu import cpu_model
from .relax_rewrite import (
    CONV2D,
    Dims,
    batched_f32_shape,
    depthwise_conv,
    int_lists,
    nchw_conv,
    rewrite_functions,
    same_dims,
)
from .schedules.matmul import CPUMatmul

# pooling windows slide over H and W only, so on a blocked map (layout NCHW[b]c) they pool each lane's channel
_POOL2D = {tvm.ir.Op.get(f"relax.nn.{kind}_pool2d"): getattr(relax.op.nn, f"{kind}_pool2d") for kind in ("max", "avg")}
# ops computed lane by lane whatever the layout: on blocked operands they give the blocked result
_ELEMENTWISE = frozenset(tvm.ir.Op.get(f"relax.{name}") for name in (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "nn.relu", "clip", "sigmoid", "tanh", "nn.silu"))


def _per_channel(shape: Dims, out: Dims) -> bool:
    """Whether an operand of `shape` broadcasts against the NCHW `out` along every dim but the channels."""
    padded = [1] * (4 - len(shape)) + shape
    return (len(shape) <= 4 and all(isinstance(d, int) for d in padded)
            and padded[0] == padded[2] == padded[3] == 1 and padded[1] in (1, out[1]))


@mutator
class _Regions(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, rule: CPUMatmul) -> None:
        super().__init__(mod)
        self.rule = rule
        self.block = rule.lanes or 1
        self.blocked: dict[relax.Var, relax.Expr] = {}  # an NCHW value of this dataflow block -> its NCHW[x]c form

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.blocked = {}  # a dataflow block's values are not visible from the next
        return super().visit_dataflow_block_(block)

    def visit_binding_block_(self, block: relax.BindingBlock) -> relax.BindingBlock:
        self.blocked = {}
        return super().visit_binding_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        out = batched_f32_shape(binding.var.ty)
        blocked = None
        if isinstance(value, relax.Call) and out is not None and len(out) == 4:
            call = relax.Call(value.op, [self.visit_expr(a) for a in value.args], value.attrs, value.ty_args)
            if call.op == CONV2D:
                blocked = self._conv(call, out)
            elif call.op in _ELEMENTWISE:
                blocked = self._elementwise(call, out)
            elif call.op in _POOL2D:
                blocked = self._pool(call)
        if blocked is None:
            super().visit_var_binding_(binding)
            return
        yb = self.builder_.emit(blocked)
        nchw = self.builder_.call_te(from_blocked, yb, out[1], primfunc_name_hint="from_blocked")
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(nchw)))
        self.blocked[binding.var] = yb

    def _to_blocked(self, x: relax.Expr) -> relax.Expr:
        """The NCHW[x]c form of the NCHW `x`: the one already bound, or a conversion bound now."""
        if isinstance(x, relax.Var) and x in self.blocked:
            return self.blocked[x]
        xb = self.builder_.emit(self.builder_.call_te(to_blocked, x, self.block, primfunc_name_hint="to_blocked"))
        if isinstance(x, relax.Var):
            self.blocked[x] = xb
        return xb

    def _per_channel_blocked(self, v: relax.Expr, shape: list[int]) -> relax.Expr:
        """A per-channel operand as `[1, C / b, 1, 1, b]` (a kernel FoldConstant runs at build time on a constant)."""
        nchw = v if len(shape) == 4 else self.builder_.emit(relax.op.reshape(v, [1] * (4 - len(shape)) + shape))
        return self.builder_.emit(self.builder_.call_te(to_blocked, nchw, self.block,
                                                        primfunc_name_hint="pack_per_channel"))

    def _conv(self, call: relax.Call, out: Dims) -> relax.Expr | None:
        a, x, shapes = call.attrs, call.args[0], nchw_conv(call)
        if shapes is None:
            return None
        x_shape, w_shape = shapes
        # a depthwise conv stays blocked where its input is: it computes lane by lane, whatever the map's width
        depthwise = depthwise_conv(call) and out[1] > 1 and x in self.blocked
        if not (depthwise or int(a.groups) == 1 and blocks_output_channels(out[1], out[3], self.rule)):
            return None
        w = call.args[1]
        if isinstance(w, tvm.ir.Constant):
            wp: relax.Expr = relax.const(pack_weight(w.value.numpy(), self.block))
        else:
            wp = self.builder_.emit(self.builder_.call_te(pack_te, w, self.block,
                                                          primfunc_name_hint="pack_conv_weight"))
        ints = int_lists(a.strides, a.padding, a.dilation)
        if depthwise:
            return self.builder_.call_te(blocked_depthwise, self.blocked[x], wp, *ints,
                                         primfunc_name_hint=DEPTHWISE_NAME)
        x = self.blocked.get(x, x)
        if not pixel_rows(w_shape, *ints):
            return self.builder_.call_te(blocked_conv, x, wp, x_shape[1], *ints, primfunc_name_hint=BLOCKED_NAME)
        shape = batched_f32_shape(x.ty)
        rows = self.builder_.emit(relax.op.reshape(x, [*shape[:2], 1, shape[2] * shape[3], *shape[4:]]))
        y = self.builder_.emit(self.builder_.call_te(blocked_conv, rows, wp, x_shape[1], *ints,
                                                     primfunc_name_hint=BLOCKED_NAME))
        return relax.op.reshape(y, [out[0], int(y.ty.shape[1]), out[2], out[3], self.block])

    def _pool(self, call: relax.Call) -> relax.Expr | None:
        """Max or average pooling of a blocked map, in the blocked layout; None for an NCHW input (it stays so)."""
        x, a = call.args[0], call.attrs
        if not (isinstance(x, relax.Var) and x in self.blocked and a.layout == a.out_layout == "NCHW"):
            return None
        return _POOL2D[call.op](self.blocked[x], a.pool_size, a.strides, a.padding, a.dilation, a.ceil_mode,
                                a.count_include_pad, layout=f"NCHW{self.block}c")

    def _elementwise(self, call: relax.Call, out: Dims) -> relax.Expr | None:
        """The op on blocked operands when one of them is blocked and every other tensor is the full map or
        per channel; None otherwise (it stays NCHW, reading the NCHW forms)."""
        if not any(isinstance(arg, relax.Var) and arg in self.blocked for arg in call.args):
            return None
        args: list[relax.Expr] = []
        for arg in call.args:
            shape = batched_f32_shape(arg.ty) if isinstance(arg.ty, relax.TensorType) else None
            if not isinstance(arg.ty, relax.TensorType):
                args.append(arg)  # clip's bounds
            elif shape is not None and same_dims(shape, out):
                args.append(self._to_blocked(arg))
            elif shape is not None and _per_channel(shape, out):
                args.append(self._per_channel_blocked(arg, shape) if max(shape, default=1) > 1 else arg)
            else:
                return None
        return relax.Call(call.op, args, call.attrs, call.ty_args)


def block_conv_regions(target: Target) -> tvm.transform.Pass:
    """The module pass computing the convs `blocks_output_channels` picks for `target`'s CPU in NCHW[x]c, with their
    elementwise neighbours, converting only where a region meets NCHW code."""
    rule = CPUMatmul().for_cpu(cpu_model(target))

    @tvm.transform.module_pass(opt_level=0, name="KilnBlockConvRegions")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _Regions(mod, rule)))

    return _pass
