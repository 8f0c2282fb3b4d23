"""What a bf16 conv kernel (`conv_bf16.py`) computes as it stores its sums: the elementwise ops after the conv
(a bias, batch norm's scale and shift, a residual add, relu, clip, hard-swish's terms), each value other code
reads stored as an f32 NCHW16c map, and the next convs' inputs stored as their bf16 pairs (`conv_bf16.bf16_input`:
zero-padded, zero past the real channels). `conv_fold.py` finds them in a Relax module.

Without it the conv's f32 result went back through memory twice: once to a kernel computing the bias and relu, once
more (where that result also feeds a residual) to the cast into the next conv's pairs, about a fifth of ResNet-50's
time once its convs ran in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script.ir_builder import tirx as ib

from .bf16_layout import N_TILE, bf16_bits

HALF = N_TILE // 2  # a word pairs channels c and c + HALF of one block

# an operand's kind: its dims besides the block's 16 lanes
CHANNEL, IMAGE, MAP = "channel", "image", "map"  # [1, OB, 1, 1], [N, OB, 1, 1], [N, OB, OH, OW]

# the scalar meaning of each op an epilogue computes, on f32 values (relu and clip take their bounds as consts)
SCALAR_OPS: dict[str, Callable[..., tirx.PrimExpr]] = {
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b, "maximum": tirx.max, "minimum": tirx.min,
    "relu": lambda a: tirx.max(a, tirx.const(0, "float32")), "clip": lambda a, lo, hi: tirx.min(tirx.max(a, lo), hi)}

Term = tuple  # ("node", k) a node's value (node 0 is the conv's sum), ("operand", i) or ("const", value)


@dataclass(frozen=True)
class PairsOutput:
    """A next conv's input the kernel stores: node `node`'s value as bf16 pairs of `channels` real channels, the
    map zero-padded by (top, left, bottom, right) `padding`."""

    node: int
    channels: int
    padding: tuple[int, int, int, int]


@dataclass(frozen=True)
class ConvEpilogue:
    """The values a conv kernel computes from its sums: `nodes[k - 1]` = (op, *terms) is node k, node 0 the sum;
    `operands` are the kinds of the kernel's inputs after A and B; `maps` the nodes stored as f32 NCHW16c maps,
    then `pairs` as next convs' inputs, in the kernel's parameter order."""

    nodes: tuple[tuple, ...] = ()
    operands: tuple[str, ...] = ()
    maps: tuple[int, ...] = (0,)
    pairs: tuple[PairsOutput, ...] = ()

    def params(self, batch: tirx.Var, out_blocks: int, out_shape: tuple[int, int]
               ) -> tuple[list[tirx.Buffer], list[tirx.Buffer]]:
        """Add the kernel's parameters after A and B to the function being parsed: (its operands, its outputs)."""
        oh, ow = out_shape
        dims = {CHANNEL: (1, out_blocks, 1, 1), IMAGE: (batch, out_blocks, 1, 1), MAP: (batch, out_blocks, oh, ow)}
        operands = [ib.arg(f"in{i}", tirx.decl_buffer((*dims[kind], N_TILE), "float32", name=f"in{i}"))
                    for i, kind in enumerate(self.operands)]
        outputs = [ib.arg(f"out{i}", tirx.decl_buffer((batch, out_blocks, oh, ow, N_TILE), "float32", name=f"out{i}"))
                   for i in range(len(self.maps))]
        for i, p in enumerate(self.pairs, start=len(outputs)):
            top, left, bottom, right = p.padding
            shape = (batch, out_blocks, oh + top + bottom, ow + left + right, HALF)
            outputs.append(ib.arg(f"out{i}", tirx.decl_buffer(shape, "uint32", name=f"out{i}")))
        return operands, outputs

    def store(self, operands: list[tirx.Buffer], outputs: list[tirx.Buffer], sums: tirx.Buffer, at: tirx.PrimExpr,
              b: tirx.PrimExpr, ob: tirx.PrimExpr, y: tirx.PrimExpr, x: tirx.PrimExpr) -> None:
        """Emit the stores of output pixel (b, y, x), block `ob`, whose 16 sums start at `at` of `sums`."""
        def value(node: int, lane: tirx.PrimExpr) -> tirx.PrimExpr:
            if node == 0:
                return sums[at + lane]
            op, *terms = self.nodes[node - 1]
            return SCALAR_OPS[op](*(term(t, lane) for t in terms))

        def term(t: Term, lane: tirx.PrimExpr) -> tirx.PrimExpr:
            kind, what = t
            if kind == "node":
                return value(what, lane)
            if kind == "const":
                return tirx.const(what, "float32")
            where = {CHANNEL: (0, ob, 0, 0), IMAGE: (b, ob, 0, 0), MAP: (b, ob, y, x)}[self.operands[what]]
            return operands[what][(*where, lane)]

        for out, node in zip(outputs[:len(self.maps)], self.maps, strict=True):
            with ib.vectorized(0, N_TILE) as j:
                ib.buffer_store(out, value(node, j), [b, ob, y, x, j])
        for out, p in zip(outputs[len(self.maps):], self.pairs, strict=True):
            def bits(lane: tirx.PrimExpr, p: PairsOutput = p) -> tirx.PrimExpr:
                v = value(p.node, lane)
                if p.channels % N_TILE:  # the last block's lanes past the real channels are zero
                    v = tirx.Select(ob * N_TILE + lane < p.channels, v, tirx.const(0, "float32"))
                return bf16_bits(v)
            with ib.vectorized(0, HALF) as q:
                ib.buffer_store(out, bits(q) | (bits(q + HALF) << tirx.const(16, "uint32")),
                                [b, ob, y + p.padding[0], x + p.padding[1], q])

    def zero_borders(self, outputs: list[tirx.Buffer], batch: tirx.PrimExpr, out_blocks: int,
                     out_shape: tuple[int, int]) -> None:
        """Emit the loops zeroing the padding around each pairs output's map (the tiles store only the map)."""
        oh, ow = out_shape
        zero = tirx.const(0, "uint32")
        for out, p in zip(outputs[len(self.maps):], self.pairs, strict=True):
            top, left, bottom, right = p.padding
            if not any(p.padding):
                continue
            rows, cols = oh + top + bottom, ow + left + right
            with ib.parallel(0, batch * out_blocks * rows) as t:
                b, ob, i = t // (out_blocks * rows), t // rows % out_blocks, t % rows
                with ib.If(tirx.Or(i < top, i >= top + oh)):
                    with ib.Then(), ib.serial(0, cols) as j, ib.vectorized(0, HALF) as q:
                        ib.buffer_store(out, zero, [b, ob, i, j, q])
                    with ib.Else():
                        for first, count in ((0, left), (left + ow, right)):
                            if count:
                                with ib.serial(0, count) as j, ib.vectorized(0, HALF) as q:
                                    ib.buffer_store(out, zero, [b, ob, i, first + j, q])


PLAIN = ConvEpilogue()  # the sums stored as the conv's f32 result
