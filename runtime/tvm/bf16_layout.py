"""What the bf16 product kernels (AMX tiles in `amx.py`, `vdpbf16ps` in `dot_bf16.py` and `conv_bf16.py`) share
with the code in front of and behind them: the f32 -> bf16 rounding, B's packed layout of (k, k+1) pairs, the
attribute recording a kernel's arguments, and the elementwise epilogue a kernel computes as it stores C."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import tirx
from tvm.script.ir_builder import tirx as ib

N_TILE = 16  # f32 columns of a packed B row (a 64-byte AMX tile row; a 512-bit vector)
PAIR = 2  # K values per packed element: both instructions multiply (k, k+1) pairs
TILE_PARAMS = "kiln.amx_tiles"  # a kernel's attribute: its builder's arguments (rows, kp, np_, shared_b, ...)


@dataclass(frozen=True)
class Epilogue:
    """An elementwise consumer of the product, computed by a product kernel as it stores C (`amx_epilogue.py`
    finds them): `inputs` (its other operands) and `output` are the kernel's parameters after A and B, and for the
    product's element (b, row, col) = c it stores `value(b, row, col, c)` at `at(b, row, col)` of `output`, for
    the rows `inside(b, row)` holds (all where it is None: an output with fewer rows than C, M without its padding,
    keeps only its own) and the columns before `columns` (all where it is None: an output of N columns keeps only
    those of C's whole panels). The product itself is never written."""

    inputs: tuple[tirx.Buffer, ...]
    output: tirx.Buffer
    value: Callable[[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr]
    at: Callable[[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr], list[tirx.PrimExpr]]
    inside: Callable[[tirx.PrimExpr, tirx.PrimExpr], tirx.PrimExpr] | None = None
    columns: int | None = None


def result_params(epilogue: Epilogue | None, batch: tirx.Var, mp: tirx.Var, np_: int) -> tirx.Buffer:
    """Add a kernel's parameters after A and B (C [batch, mp, np_] f32, or an epilogue's inputs and output) to
    the function being parsed; returns C, or the epilogue's output."""
    if epilogue is None:
        return ib.arg("c", tirx.decl_buffer((batch, mp, np_), "float32", name="c"))
    for i, buffer in enumerate(epilogue.inputs):
        ib.arg(f"in{i}", buffer)
    return ib.arg("out", epilogue.output)


def store_epilogue(epilogue: Epilogue, b: tirx.PrimExpr, row: tirx.PrimExpr, col: tirx.PrimExpr, lanes: int,
                   sums: tirx.Buffer, start: list[tirx.PrimExpr]) -> None:
    """Emit the epilogue's stores of the product's elements (b, row, col + j), j < `lanes`, held in `sums` from
    `start` along its last dim, as one vector, guarded by `inside` where it has one. Where the output has fewer
    `columns` than C, a vector that crosses its end is stored element by element up to it instead (a guard on the
    lane would scalarize every vector)."""
    def store(j: tirx.Var) -> None:
        c = sums[(*start[:-1], start[-1] + j)]
        ib.buffer_store(epilogue.output, epilogue.value(b, row, col + j, c), epilogue.at(b, row, col + j))

    def vector() -> None:
        with ib.vectorized(0, lanes) as j:
            store(j)

    def stores() -> None:
        if epilogue.columns is None:
            vector()
            return
        with ib.If(col + lanes <= epilogue.columns):
            with ib.Then():
                vector()
            with ib.Else(), ib.serial(0, lanes) as j, ib.If(col + j < epilogue.columns), ib.Then():
                store(j)

    if epilogue.inside is None:
        stores()
        return
    with ib.If(epilogue.inside(b, row)), ib.Then():
        stores()


def rounding_ir(name: str, lanes: int, inputs: int, order: list[int]) -> str:
    """LLVM IR of `name`: `inputs` f32 vectors of `lanes` rounded to nearest-even bf16 (`fptrunc`, as `bf16_bits`
    rounds; LLVM emits `vcvtne2ps2bf16` / `vcvtneps2bf16`) and returned as int32 words of pairs, bf16 slot i
    holding element order[i] of the inputs laid end to end (the low half of word w is slot 2w). For a
    hand-written kernel's `pragma_import_llvm`, beside `dot_bf16.DOT_IR`."""
    count = len(order)
    params = ", ".join(f"<{lanes} x float> %x{i}" for i in range(inputs))
    second = f"<{lanes} x float> %x1" if inputs == 2 else f"<{lanes} x float> poison"
    mask = ", ".join(f"i32 {i}" for i in order)
    return f"""
define linkonce_odr <{count // 2} x i32> @{name}({params}) alwaysinline {{
  %v = shufflevector <{lanes} x float> %x0, {second}, <{count} x i32> <{mask}>
  %b = fptrunc <{count} x float> %v to <{count} x bfloat>
  %w = bitcast <{count} x bfloat> %b to <{count // 2} x i32>
  ret <{count // 2} x i32> %w
}}
"""


def bf16_bits(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """The bits of f32 `value` rounded to nearest-even bf16, in the low half of a uint32 (a NaN stays a quiet NaN).
    In integer arithmetic: TVM computes bf16 values in f32 and cannot bit cast one, and its f32 -> bf16 -> f32
    round trip truncates instead of rounding."""
    bits = tirx.reinterpret("uint32", value)
    sixteen = tirx.const(16, "uint32")
    rounded = (bits + tirx.const(0x7FFF, "uint32") + ((bits >> sixteen) & tirx.const(1, "uint32"))) >> sixteen
    return tirx.Select(value != value, (bits >> sixteen) | tirx.const(0x40, "uint32"), rounded)


def even_chunks(mblocks: tirx.PrimExpr | int, chunk: int, cores: int, others: tirx.PrimExpr) -> tirx.PrimExpr:
    """How many chunks a kernel cuts its `mblocks` row tiles into: enough that none holds more than `chunk`,
    rounded up so that chunks x `others` (the tasks per chunk: batches x panels, int64) is a multiple of `cores`, so
    TVM's static split of a parallel loop gives every thread as many tasks (3 tasks on 2 cores ran at two thirds of
    the rate); at most `mblocks`, at least 1 (a batch or M of 0 makes no task, and divides by nothing)."""
    mblocks = tirx.const(mblocks, "int64") if isinstance(mblocks, int) else mblocks
    needed = tirx.floordiv(mblocks + chunk - 1, chunk)
    step: tirx.PrimExpr = tirx.const(cores, "int64")
    for d in sorted((d for d in range(1, cores) if cores % d == 0), reverse=True):  # the least d that balances
        step = tirx.Select(tirx.floormod(others * d, cores) == 0, tirx.const(d, "int64"), step)
    return tirx.max(1, tirx.min(mblocks, tirx.floordiv(needed + step - 1, step) * step))


def task_place(task: tirx.PrimExpr, panels: int, batch: tirx.PrimExpr, mblocks: tirx.PrimExpr | int,
               chunks: tirx.PrimExpr) -> tuple[tirx.PrimExpr, ...]:
    """Parallel task `task`'s (panel, batch index, first row tile, end row tile) among chunks x batch x panels
    tasks, chunks outermost so a thread's consecutive tasks share a chunk of A in L2; the chunks are even (their
    sizes differ by one at most)."""
    index = tirx.floordiv(task, panels * batch)
    return (tirx.floormod(task, panels), tirx.floormod(tirx.floordiv(task, panels), batch),
            tirx.floordiv(index * mblocks, chunks), tirx.floordiv((index + 1) * mblocks, chunks))
