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

from .bf16_layout import N_TILE, rounding_ir

HALF = N_TILE // 2  # a word pairs channels c and c + HALF of one block
VECTOR = f"float32x{N_TILE}"  # one output pixel's block of channels, the unit the epilogue computes on
_PAIRS, _UNPAIRS = "kiln_bf16_pairs", "kiln_bf16_unpairs"
# linked into the conv kernel beside `dot_bf16.DOT_IR`: 16 f32 channels rounded and paired as `bf16_input` lays
# them out, word q = channel q | channel q + 8 << 16; and the inverse, 8 such words back as 16 f32 channels (a skip
# read from pairs)
PAIRS_IR = rounding_ir(_PAIRS, N_TILE, 1, [q // 2 + HALF * (q % 2) for q in range(N_TILE)]) + f"""
define linkonce_odr <16 x float> @{_UNPAIRS}(<8 x i32> %w) alwaysinline {{
  %b = bitcast <8 x i32> %w to <16 x bfloat>
  %c = shufflevector <16 x bfloat> %b, <16 x bfloat> poison,
         <16 x i32> <i32 0, i32 2, i32 4, i32 6, i32 8, i32 10, i32 12, i32 14,
                     i32 1, i32 3, i32 5, i32 7, i32 9, i32 11, i32 13, i32 15>
  %v = fpext <16 x bfloat> %c to <16 x float>
  ret <16 x float> %v
}}
"""

def unpairs(words: tirx.PrimExpr) -> tirx.PrimExpr:
    """8 pair words (uint32x8, as `bf16_input` lays them out) as their block's 16 f32 channels, in a kernel that
    imports `PAIRS_IR`."""
    return tirx.call_pure_extern(VECTOR, _UNPAIRS, words)


# an operand's kind: its dims besides the block's 16 lanes (a PAIRS map's 8 words hold them)
CHANNEL, IMAGE, MAP, PAIRS = "channel", "image", "map", "pairs"  # [1, OB, 1, 1], [N, OB, 1, 1], [N, OB, OH, OW] x2

# what each op an epilogue computes means, lane by lane on f32 vectors (clip takes its bounds as consts)
SCALAR_OPS: dict[str, Callable[..., tirx.PrimExpr]] = {
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b, "maximum": tirx.max, "minimum": tirx.min,
    "relu": lambda a: tirx.max(a, tirx.const(0, VECTOR)), "clip": lambda a, lo, hi: tirx.min(tirx.max(a, lo), hi)}

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
        dims = {CHANNEL: (1, out_blocks, 1, 1), IMAGE: (batch, out_blocks, 1, 1), MAP: (batch, out_blocks, oh, ow),
                PAIRS: (batch, out_blocks, oh, ow)}
        operands = [ib.arg(f"in{i}", tirx.decl_buffer((*dims[kind], HALF) if kind == PAIRS else (*dims[kind], N_TILE),
                                                      "uint32" if kind == PAIRS else "float32", name=f"in{i}"))
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
        """Emit the stores of output pixel (b, y, x), block `ob`, whose 16 sums start at `at` of `sums`: each value
        one 16-lane vector expression (LLVM shares what several outputs compute), each cast one `PAIRS_IR` call."""
        lanes = tirx.Ramp(0, 1, N_TILE)

        def value(node: int) -> tirx.PrimExpr:
            if node == 0:
                return sums[tirx.Ramp(at, 1, N_TILE)]
            op, *terms = self.nodes[node - 1]
            return SCALAR_OPS[op](*(term(t) for t in terms))

        def term(t: Term) -> tirx.PrimExpr:
            kind, what = t
            if kind == "node":
                return value(what)
            if kind == "const":
                return tirx.const(what, VECTOR)
            kind = self.operands[what]
            if kind == PAIRS:
                return unpairs(operands[what][b, ob, y, x, tirx.Ramp(0, 1, HALF)])
            where = {CHANNEL: (0, ob, 0, 0), IMAGE: (b, ob, 0, 0), MAP: (b, ob, y, x)}[kind]
            return operands[what][(*where, lanes)]

        for out, node in zip(outputs[:len(self.maps)], self.maps, strict=True):
            ib.buffer_store(out, value(node), [b, ob, y, x, lanes])
        for out, p in zip(outputs[len(self.maps):], self.pairs, strict=True):
            v = value(p.node)
            if p.channels % N_TILE:  # the last block's lanes past the real channels are zero
                v = tirx.Select(ob * N_TILE + lanes < p.channels, v, tirx.const(0, VECTOR))
            ib.buffer_store(out, tirx.call_pure_extern("uint32x8", _PAIRS, v),
                            [b, ob, y + p.padding[0], x + p.padding[1], tirx.Ramp(0, 1, HALF)])

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
