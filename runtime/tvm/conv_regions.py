"""Blocked regions: a Relax rewrite before legalization that computes the convs the CPU model blocks in NCHW[x]c
(`conv_layout.py`) and keeps their activations in that layout through the elementwise ops after them (bias add,
relu/clip, hard-swish, batch norm's scale and shift, a residual add, max and average pooling, a global average
pool, a depthwise conv, a squeeze-excite's per-image channel gate) and into the next blocked conv. Every shape but
the batch must be static: a dynamic batch (an ONNX export's `dynamic_axes`) is blocked like a static one.

A 1x1 conv computes its map as one row of pixels (`_rows_of`); the elementwise ops after it are computed on those
rows too, so TVM fuses them into the conv's kernel, and the map form (a reshape, no copy) is what window ops read.

Every value of a region is also bound in NCHW (`from_blocked` of its blocked form), for the consumers that are not
blocked (flatten, a global mean, matmul, the outputs); dead code elimination drops the unread ones. A region's
first conv reads its NCHW input in place, so a chain converts once, on the way out. An NCHW operand of a blocked
elementwise op (the skip branch of a residual add) is converted once (`to_blocked`), and a per-channel one (a bias
`[C, 1, 1]`) is blocked as a `[1, C, 1, 1]` map, which FoldConstant packs at build time when it is a constant.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .bf16_layout import N_TILE
from .blocked_exit import blocked_exit
from .conv_bf16 import (
    CONV_KERNEL_NAME,
    CONV_PARAMS,
    DEPTHWISE_KERNEL_NAME,
    bf16_convs,
    conv_kernel,
    depthwise_kernel,
    marked_cast,
    marked_skip,
    pack_conv_weight,
    pack_row_pair_weight,
    pairs_max_pool,
    row_pairs_input,
    takes_conv,
    takes_row_pairs,
)
from .conv_layout import (
    BLOCKED_NAME,
    DEPTHWISE_NAME,
    blocked_conv,
    blocked_depthwise,
    blocks_output_channels,
    pack_te,
    pack_weight,
    pixel_rows,
    to_blocked,
)
from .cpu import CPUModel, cpu_model
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
_MAX_POOL = tvm.ir.Op.get("relax.nn.max_pool2d")
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_MEAN = tvm.ir.Op.get("relax.mean")  # over H and W of a blocked map: each lane's channel, like the pools
# ops computed lane by lane whatever the layout: on blocked operands they give the blocked result
_ELEMENTWISE = frozenset(tvm.ir.Op.get(f"relax.{name}") for name in (
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "nn.relu", "clip", "sigmoid", "tanh", "nn.silu"))


def _per_channel(shape: Dims, out: Dims) -> bool:
    """Whether an operand of `shape` broadcasts against the NCHW `out` along every dim but the channels and the
    batch: a bias `[C, 1, 1]`, or one vector per image `[N, C, 1, 1]` (a squeeze-excite's channel weights)."""
    padded = [1] * (4 - len(shape)) + shape
    return (len(shape) <= 4 and padded[2:] == [1, 1] and padded[1] in (1, out[1])
            and (padded[0] == 1 or padded[1] == out[1] and same_dims(padded[:1], out[:1])))


def _cast_key(x: relax.Expr, channels: int, padding: list[int], columns: bool = False) -> tuple:
    """The key of `x`'s bf16 pairs (its channels, padded by `padding`; pairs of columns where `columns`) among the
    casts a dataflow block made."""
    return x, channels, tuple(padding), columns


@mutator
class _Regions(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, rule: CPUMatmul, model: CPUModel | None) -> None:
        super().__init__(mod)
        self.rule = rule
        self.block = rule.lanes or 1
        self.bf16_model = model  # the CPU of a bf16 build whose dense convs run `conv_bf16.py`'s kernel, else None
        self.blocked: dict[relax.Var, relax.Expr] = {}  # an NCHW value of this dataflow block -> its NCHW[x]c form
        self.rows: dict[relax.Var, relax.Expr] = {}  # -> its `[N, C / b, 1, H * W, b]` form, where it was made so
        self.casts: dict[tuple, relax.Expr] = {}  # (a value, channels, padding) -> its bf16 pairs, made once
        self.bf16_maps: set[relax.Var] = set()  # blocked values a bf16 conv's store computes (it can store pairs)

    def _forget(self) -> None:
        """A dataflow block's values are not visible from the next."""
        self.blocked, self.rows, self.casts, self.bf16_maps = {}, {}, {}, set()

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self._forget()
        return super().visit_dataflow_block_(block)

    def visit_binding_block_(self, block: relax.BindingBlock) -> relax.BindingBlock:
        self._forget()
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
                blocked = self._pool(call, binding.var, out)
            elif call.op == _MEAN:
                blocked = self._spatial_mean(call)
        if blocked is None:
            super().visit_var_binding_(binding)
            return
        yb = self.builder_.emit(blocked)
        if self._from_bf16_conv(blocked):
            self.bf16_maps.add(yb)
        nchw = blocked_exit(self.builder_, yb, out)
        if batched_f32_shape(yb.ty)[2:4] != out[2:4]:  # in rows (`_rows_of`), and the map is not one row
            self.rows[binding.var] = yb
            yb = self.builder_.emit(relax.op.reshape(yb, [out[0], int(yb.ty.shape[1]), out[2], out[3], self.block]))
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

    def _per_channel_blocked(self, v: relax.Expr, shape: Dims) -> relax.Expr:
        """A per-channel operand as `[1 or N, C / b, 1, 1, b]`: its blocked form where it has one (a squeeze-excite's
        gate, computed blocked), else a kernel (which FoldConstant runs at build time on a constant)."""
        if isinstance(v, relax.Var) and v in self.blocked:
            return self.blocked[v]
        nchw = v if len(shape) == 4 else self.builder_.emit(relax.op.reshape(v, [1] * (4 - len(shape)) + shape))
        return self.builder_.emit(self.builder_.call_te(to_blocked, nchw, self.block,
                                                        primfunc_name_hint="pack_per_channel"))

    def _conv(self, call: relax.Call, out: Dims) -> relax.Expr | None:
        a, x, shapes = call.attrs, call.args[0], nchw_conv(call)
        if shapes is None:
            return None
        x_shape, w_shape = shapes
        ints = int_lists(a.strides, a.padding, a.dilation)
        # a depthwise conv stays blocked where its input is: it computes lane by lane, whatever the map's width; so
        # does a 1x1 conv, a matmul over the map's pixels: NCHW, it would convert its input and its result (the
        # 120 -> 40 channel convs of MobileNetV3's 28² blocks: 0.10 ms NCHW and 0.07 of conversion, blocked 0.05)
        inside = x in self.blocked
        w = call.args[1]
        if self.bf16_model is not None and isinstance(w, tvm.ir.Constant) and (
                takes_conv(x_shape[1], int(a.groups))
                or takes_row_pairs(w_shape, int(a.groups), ints[2][1])):
            return self._bf16_conv(x, w, ints, out)
        depthwise = depthwise_conv(call) and out[1] > 1 and inside
        if depthwise and self.bf16_model is not None and isinstance(w, tvm.ir.Constant):
            return self._bf16_depthwise(x, w, ints, out)
        if not (depthwise or int(a.groups) == 1 and (blocks_output_channels(out[1], out[3], self.rule)
                                                     or inside and pixel_rows(w_shape, *ints))):
            return None
        if isinstance(w, tvm.ir.Constant):
            wp: relax.Expr = relax.const(pack_weight(w.value.numpy(), self.block))
        else:
            wp = self.builder_.emit(self.builder_.call_te(pack_te, w, self.block,
                                                          primfunc_name_hint="pack_conv_weight"))
        if depthwise:
            return self.builder_.call_te(blocked_depthwise, self.blocked[x], wp, *ints,
                                         primfunc_name_hint=DEPTHWISE_NAME)
        if not pixel_rows(w_shape, *ints):
            return self.builder_.call_te(blocked_conv, self.blocked.get(x, x), wp, x_shape[1], *ints,
                                         primfunc_name_hint=BLOCKED_NAME)
        # a matmul over the map's pixels, in rows: its epilogue, computed on the rows too, fuses into its store
        return self.builder_.call_te(blocked_conv, self._rows_of(x), wp, x_shape[1], *ints,
                                     primfunc_name_hint=BLOCKED_NAME)

    def _bf16_conv(self, x: relax.Expr, w: tvm.ir.Constant, ints: list[list[int]], out: Dims) -> relax.Expr:
        """The conv on `vdpbf16ps` (`conv_bf16.py`): the input cast to bf16 pairs of channels (NCHW at a region's
        start, else blocked), or of window columns where too few channels fill a block, the weight packed at build
        time, the result blocked f32."""
        strides, padding, dilation = ints
        weight = w.value.numpy()
        channels, kh, kw = weight.shape[1:]
        if takes_conv(channels, 1):
            a, packed, window = self._pairs(x, channels, padding), pack_conv_weight(weight), (kh, kw)
        else:  # pair m of a window row is columns 2m and 2m + 1: ceil(kw / 2) pairs, 2 columns apart
            a = self._pairs(x, channels, padding, columns=True)
            packed, window, dilation = pack_row_pair_weight(weight), (kh, -(-kw // 2)), [dilation[0], 2]
        hp, wp, depth = (int(d) for d in a.ty.shape.values[2:5])
        kernel = conv_kernel(packed.shape[1], (hp, wp), window, strides, dilation, out[2:], packed.shape[0],
                             self.bf16_model, depth=depth)
        return self._bf16_call(kernel, CONV_KERNEL_NAME, a, packed, out)

    def _bf16_depthwise(self, x: relax.Expr, w: tvm.ir.Constant, ints: list[list[int]], out: Dims) -> relax.Expr:
        """A depthwise conv of a blocked map in a bf16 build (`conv_bf16.depthwise_kernel`): f32 FMAs on its input
        read as bf16 pairs, which the conv producing that input stores instead of its f32 map."""
        strides, padding, dilation = ints
        a = self._pairs(x, out[1], padding)
        packed = pack_weight(w.value.numpy(), N_TILE)
        kernel = depthwise_kernel(packed.shape[0], [int(d) for d in a.ty.shape.values[2:4]], packed.shape[2:4],
                                  strides, dilation, out[2:], self.bf16_model)
        return self._bf16_call(kernel, DEPTHWISE_KERNEL_NAME, a, packed, out)

    def _bf16_call(self, kernel: tirx.PrimFunc, name: str, pairs: relax.Expr, packed: np.ndarray, out: Dims
                   ) -> relax.Call:
        """A call of a bf16 kernel on its input `pairs` and the weight `packed` at build time (output blocks first),
        storing the region's blocked f32 map of `out` (NCHW) dims."""
        return relax.call_tir(self.builder_.add_func(kernel, name), [pairs, relax.const(packed)],
                              relax.TensorType([out[0], packed.shape[0], *out[2:], N_TILE], "float32"))

    def _pairs(self, x: relax.Expr, channels: int, padding: list[int], columns: bool = False) -> relax.Expr:
        """`x` (NCHW at a region's start, else blocked) cast into a bf16 kernel's padded pairs of channels
        (`bf16_input`, the cast marked so `conv_fold.py` can compute it in the store of x's conv) or, with
        `columns`, of columns (`row_pairs_input`); made once for the convs reading the same pairs (a ResNet stage's
        first block: its first conv and its projection, both 1x1 and unpadded)."""
        key = _cast_key(x, channels, padding, columns)
        if key not in self.casts:
            source = self.blocked.get(x, x)
            cast = self.builder_.call_te(row_pairs_input, source, channels, padding,
                                         primfunc_name_hint="bf16_row_pairs") if columns else \
                marked_cast(self.builder_, source, channels, padding)
            self.casts[key] = self.builder_.emit(cast)
        return self.casts[key]

    def _rows_of(self, x: relax.Expr, blocked: bool = False) -> relax.Expr:
        """`x` (NCHW, or its blocked form where it has one, or, with `blocked`, always blocked) with its map as one
        row of `H * W` pixels: the form a 1x1 conv computes (`conv_layout.pixel_rows`), reshapes that copy nothing.
        Kept in that form through a pixel-row conv's elementwise successors, they fuse into its kernel (reshaped to
        the map between them, the view was a fusion boundary: bias and activation each cost a pass of their own)."""
        if isinstance(x, relax.Var) and x in self.rows:
            return self.rows[x]
        x = self._to_blocked(x) if blocked else self.blocked.get(x, x)
        shape = batched_f32_shape(x.ty)
        return self.builder_.emit(relax.op.reshape(x, [*shape[:2], 1, shape[2] * shape[3], *shape[4:]]))

    def _from_bf16_conv(self, value: relax.Expr) -> bool:
        """Whether a blocked value is a bf16 conv's result, or computed from one lane by lane (`conv_fold.py` then
        computes it in that conv's store, which can store it as bf16 pairs)."""
        if not isinstance(value, relax.Call):
            return False
        if value.op == _CALL_TIR:
            return CONV_PARAMS in (self.builder_.get()[value.args[0]].attrs or {})
        return value.op in _ELEMENTWISE and any(arg in self.bf16_maps for arg in value.args)

    def _pool(self, call: relax.Call, var: relax.Var, out: Dims) -> relax.Expr | None:
        """Max or average pooling of a blocked map, in the blocked layout; None for an NCHW input (it stays so).
        A max pool of a map a bf16 conv computes pools its bf16 pairs (`conv_bf16.pairs_max_pool`), so the conv
        stores pairs; convs read the pooled pairs (`var`'s cast), other ops their f32 values."""
        x, a = call.args[0], call.attrs
        if not (isinstance(x, relax.Var) and x in self.blocked and a.layout == a.out_layout == "NCHW"):
            return None
        pool_size, strides, padding, dilation = int_lists(a.pool_size, a.strides, a.padding, a.dilation)
        if (call.op == _MAX_POOL and self.blocked[x] in self.bf16_maps and dilation == [1, 1] and not a.ceil_mode
                and self.block == N_TILE):
            pooled = self.builder_.emit(self.builder_.call_te(
                pairs_max_pool, self._pairs(x, out[1], [0] * 4), pool_size, strides, padding, out[2:4],
                primfunc_name_hint="bf16_max_pool"))
            self.casts[_cast_key(var, out[1], [0] * 4)] = pooled
            return marked_skip(self.builder_, pooled)
        return _POOL2D[call.op](self.blocked[x], a.pool_size, a.strides, a.padding, a.dilation, a.ceil_mode,
                                a.count_include_pad, layout=f"NCHW{self.block}c")

    def _spatial_mean(self, call: relax.Call) -> relax.Expr | None:
        """A global average pool (`mean` over H and W, dims kept) of a blocked map, blocked: `[N, C / b, 1, 1, b]`,
        the input of a squeeze-excite's 1x1 convs, which a map narrower than one vector blocks; None otherwise."""
        x, axes = call.args[0], call.attrs.axis
        if not (isinstance(x, relax.Var) and x in self.blocked and call.attrs.keepdims and axes is not None
                and sorted(int(a) % 4 for a in axes) == [2, 3]):
            return None
        return relax.op.mean(self.blocked[x], axis=[2, 3], keepdims=True)

    def _elementwise(self, call: relax.Call, out: Dims) -> relax.Expr | None:
        """The op on blocked operands when one of them is blocked and every other tensor is the full map or
        per channel; None otherwise (it stays NCHW, reading the NCHW forms)."""
        blocked = [arg for arg in call.args if isinstance(arg, relax.Var) and arg in self.blocked]
        if not blocked:
            return None
        # on pixel rows where an operand is a 1x1 conv's rows: a residual add's other map is viewed as rows too
        rows = any(arg in self.rows for arg in blocked)
        args: list[relax.Expr] = []
        for arg in call.args:
            shape = batched_f32_shape(arg.ty) if isinstance(arg.ty, relax.TensorType) else None
            if not isinstance(arg.ty, relax.TensorType):
                args.append(arg)  # clip's bounds
            elif shape is not None and same_dims(shape, out):
                args.append(self._rows_of(arg, blocked=True) if rows else self._to_blocked(arg))
            elif shape is not None and _per_channel(shape, out):
                channels = ([1] * 3 + shape)[-3]
                args.append(self._per_channel_blocked(arg, shape) if channels > 1 else arg)
            else:
                return None
        return relax.Call(call.op, args, call.attrs, call.ty_args)


def block_conv_regions(target: Target, precision: str = "f32") -> tvm.transform.Pass:
    """The module pass computing the convs `blocks_output_channels` picks for `target`'s CPU in NCHW[x]c, with their
    elementwise neighbours, converting only where a region meets NCHW code; in a bf16 build for a CPU with
    `vdpbf16ps` (`conv_bf16.bf16_convs`) every dense conv it takes runs its bf16 kernel."""
    model = cpu_model(target)
    rule = CPUMatmul().for_cpu(model)
    # the kernel's results are the region's blocks only where those are its 16 lanes (so on every vdpbf16ps CPU)
    bf16_model = model if precision == "bf16" and bf16_convs(target) and rule.lanes == N_TILE else None

    @tvm.transform.module_pass(opt_level=0, name="KilnBlockConvRegions")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _Regions(mod, rule, bf16_model)))

    return _pass
