"""Every op kind's reference semantics (the interpreter) checked against torch on CPU, the independent oracle.

Each case builds a one-op graph with the builder, interprets it on fixed random inputs and compares the result
(values, shape and dtype) with the equivalent torch computation. Documented kiln choices are spelled out in the
oracles: binary ops take equal dtypes, integer `div` truncates toward zero (x/0 gives 0), `sum`/`max`/`min` keep
the input dtype, `linear` stores its weight [in, out] as Burn does.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln.ir as kir
from kiln.ir import Builder, DType, ShapeError, TensorType, interpret

BF16 = np.dtype(ml_dtypes.bfloat16)
INF, NAN = float("inf"), float("nan")
RNG = np.random.default_rng(20240601)

# (rtol, atol) per float dtype: f16/bf16 ops compute in f32 and round once, so one ulp of the result dtype.
TOL = {np.dtype(np.float64): (1e-9, 1e-12), np.dtype(np.float32): (1e-5, 1e-5),
       np.dtype(np.float16): (1e-3, 1e-3), BF16: (1e-2, 1e-2)}
EXACT = (0.0, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def _own_rng(request: pytest.FixtureRequest) -> None:
    """Inputs drawn while a test runs depend on that test alone, not on which tests ran before it."""
    global RNG
    RNG = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rand(shape: Sequence[int], dtype: str = "f32", lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    dt = DType(dtype)
    if dt is DType.bool:
        return RNG.random(shape) < 0.5
    if dt.is_int:
        return RNG.integers(int(lo), int(hi), shape, endpoint=False).astype(dt.numpy)
    return RNG.uniform(lo, hi, shape).astype(np.float64).astype(dt.numpy)


def arr(values: Any, dtype: str = "f32") -> np.ndarray:
    return np.array(values, dtype=np.float64 if DType(dtype).is_float else None).astype(DType(dtype).numpy)


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.array(a, order="C", copy=True)  # (ascontiguousarray would make a 0-d array 1-d)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def kiln_type(a: np.ndarray) -> TensorType:
    return TensorType(tuple(a.shape), DType.from_numpy(a.dtype))


def build_op(kind: str, types: Sequence[TensorType | tuple], attrs: dict[str, Any]) -> kir.Graph:
    b = Builder("M")
    xs = [b.input(f"x{i}", t) for i, t in enumerate(types)]
    out = b.op(kind, *xs, **attrs)
    b.ret(*(out if isinstance(out, tuple) else (out,)))
    return b.build()


def run_all(kind: str, inputs: Sequence[np.ndarray], attrs: dict[str, Any] | None = None,
            types: Sequence[TensorType | tuple] | None = None, seed: int = 0) -> tuple[np.ndarray, ...]:
    graph = build_op(kind, types if types is not None else [kiln_type(a) for a in inputs], attrs or {})
    return interpret(graph, list(inputs), seed=seed)


def run_op(kind: str, inputs: Sequence[np.ndarray], attrs: dict[str, Any] | None = None,
           types: Sequence[TensorType | tuple] | None = None, seed: int = 0) -> np.ndarray:
    (out,) = run_all(kind, inputs, attrs, types, seed)
    return out


def assert_all_match(got: Sequence[np.ndarray], want: torch.Tensor | Sequence[torch.Tensor],
                     tol: tuple[float, float] | None = None) -> None:
    """Each result matches its torch counterpart; a single tensor stands for a one-result op."""
    want = (want,) if isinstance(want, torch.Tensor) else tuple(want)
    assert len(got) == len(want), f"{len(got)} results, torch gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        try:
            assert_matches(g, w, tol)
        except AssertionError as e:
            raise AssertionError(f"result {i}: {e}") from None


def assert_matches(got: np.ndarray, want: torch.Tensor, tol: tuple[float, float] | None = None) -> None:
    """Same dtype, shape and values (floats within `tol`, nan where torch has nan, infs equal)."""
    want_np = to_numpy(want)
    assert got.dtype == want_np.dtype, f"dtype {got.dtype}, torch gives {want_np.dtype}"
    assert got.shape == want_np.shape, f"shape {got.shape}, torch gives {want_np.shape}"
    if got.dtype.kind == "f" or got.dtype == BF16:
        rtol, atol = tol if tol is not None else TOL[got.dtype]
        torch.testing.assert_close(to_torch(got), want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want_np)


# ---------------------------------------------------------------------------------------------------------------
# the table of torch cases: one or more per op kind


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    inputs: tuple[np.ndarray, ...]
    oracle: Callable[..., torch.Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)
    tol: tuple[float, float] | None = None

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.name}"


CASES: list[Case] = []


def case(kind: str, name: str, inputs: Sequence[np.ndarray], oracle: Callable[..., torch.Tensor], *,
         tol: tuple[float, float] | None = None, **attrs: Any) -> None:
    CASES.append(Case(kind, name, tuple(inputs), oracle, attrs, tol))


FLOATS = ("f64", "f32", "f16", "bf16")
EDGE = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1e-30, 88.0, 89.0, -104.0, -110.0, INF, -INF, NAN]

# -- elementwise unary -------------------------------------------------------------------------------------------

UNARY_FLOAT: dict[str, tuple[Callable[..., torch.Tensor], float, float]] = {
    # kind: (torch oracle, low, high) for the random inputs
    "exp": (torch.exp, -5.0, 5.0),
    "log": (torch.log, 0.05, 10.0),
    "sqrt": (torch.sqrt, 0.0, 10.0),
    "rsqrt": (torch.rsqrt, 0.05, 10.0),
    "tanh": (torch.tanh, -5.0, 5.0),
    "sigmoid": (torch.sigmoid, -8.0, 8.0),
    "silu": (F.silu, -8.0, 8.0),
}
for kind, (fn, lo, hi) in UNARY_FLOAT.items():
    for dt in FLOATS:
        case(kind, dt, [rand((3, 4), dt, lo, hi)], fn)
    case(kind, "edge", [arr(EDGE)], fn)
    case(kind, "edge-f64", [arr(EDGE, "f64")], fn)
    case(kind, "scalar", [arr(0.75)], fn)

# the negative tails keep their relative accuracy (atol 0): 1 / (1 + exp(-x)), not 0.5 * (1 + tanh(x / 2))
TAIL = [-5.0, -10.0, -20.0, -30.0, -50.0, -87.0, -100.0, -104.0]
case("sigmoid", "negative-tail", [arr(TAIL)], torch.sigmoid, tol=(1e-5, 0.0))
case("silu", "negative-tail", [arr(TAIL)], F.silu, tol=(1e-5, 0.0))
case("sigmoid", "negative-tail-f64", [arr([-10.0, -50.0, -300.0, -700.0], "f64")], torch.sigmoid, tol=(1e-12, 0.0))

for dt in FLOATS:
    case("gelu", dt, [rand((3, 4), dt)], lambda x: F.gelu(x, approximate="none"))
    case("gelu", f"tanh-{dt}", [rand((3, 4), dt)], lambda x: F.gelu(x, approximate="tanh"), approximate="tanh")
# torch's vectorized erf gelu gives nan at +inf (x * Phi(x) -> inf); kiln gives inf, so +inf is left out here
GELU_EDGE = [0.0, -0.0, 1.0, -1.0, 6.0, -6.0, 40.0, -40.0, -INF, NAN]
case("gelu", "edge", [arr(GELU_EDGE)], lambda x: F.gelu(x))
case("gelu", "tanh-edge", [arr([*GELU_EDGE, INF])], lambda x: F.gelu(x, approximate="tanh"), approximate="tanh")
case("gelu", "scalar", [arr(0.5)], lambda x: F.gelu(x))
case("gelu", "tanh-scalar", [arr(-0.5)], lambda x: F.gelu(x, approximate="tanh"), approximate="tanh")

for dt in FLOATS:
    case("leaky_relu", dt, [rand((3, 4), dt)], lambda x: F.leaky_relu(x, 0.01))
case("leaky_relu", "alpha", [rand((3, 4))], lambda x: F.leaky_relu(x, 0.2), alpha=0.2)
case("leaky_relu", "alpha-bf16", [rand((3, 4), "bf16")], lambda x: F.leaky_relu(x, 0.3), alpha=0.3)
case("leaky_relu", "edge", [arr([0.0, -0.0, -INF, INF, NAN, -1e30])], lambda x: F.leaky_relu(x, 0.5), alpha=0.5)

INT_EDGE = {"i32": [-2**31, -5, -1, 0, 1, 2**31 - 1], "i64": [-2**63, -7, 0, 3, 2**63 - 1],
            "u8": [0, 1, 127, 128, 255]}
for kind, fn in {"neg": torch.neg, "abs": torch.abs, "relu": torch.relu}.items():
    for dt in FLOATS:
        case(kind, dt, [rand((3, 4), dt)], fn)
    case(kind, "edge", [arr([0.0, -0.0, -INF, INF, NAN, -3.5])], fn)
    for dt, values in INT_EDGE.items():  # neg wraps: -(-2**31) is -2**31, -(1 as u8) is 255
        case(kind, dt, [np.array(values, DType(dt).numpy)], fn)
    case(kind, "i32-rand", [rand((2, 3), "i32", -100, 100)], fn)

# floor, ceil, round (ONNX Round: "rounds halves to the nearest even integer", torch.round's mode), sign
ROUNDING = [-2.5, -1.5, -0.5, -0.0, 0.0, 0.5, 1.5, 2.5, 2.4999, -2.6, 1e30, INF, -INF, NAN]
for kind, fn in {"floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "sign": torch.sign}.items():
    for dt in FLOATS:
        case(kind, dt, [rand((3, 4), dt, -5.0, 5.0)], fn, tol=EXACT)
    case(kind, "edge", [arr(ROUNDING)], fn, tol=EXACT)
    case(kind, "scalar", [arr(-3.5)], fn, tol=EXACT)
for dt in ("i32", "i64", "u8"):
    case("sign", dt, [np.array(INT_EDGE[dt], DType(dt).numpy)], torch.sign)
case("logical_not", "bool", [rand((3, 4), "bool")], torch.logical_not)
case("logical_not", "scalar", [arr(True, "bool")], torch.logical_not)
for kind, fn in {"logical_and": torch.logical_and, "logical_or": torch.logical_or,
                 "logical_xor": torch.logical_xor}.items():
    case(kind, "truth-table", [arr([True, True, False, False], "bool"), arr([True, False, True, False], "bool")], fn)
    case(kind, "bcast", [rand((2, 1, 3), "bool"), rand((4, 1), "bool")], fn)

# -- elementwise binary ------------------------------------------------------------------------------------------

TRUNC = lambda x, y: torch.div(x, y, rounding_mode="trunc")  # noqa: E731  (kiln's integer div)
BINARY: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "equal": torch.eq, "less": torch.lt, "greater": torch.gt,
}
BROADCAST = {
    "same": ((2, 3), (2, 3)),
    "scalar-lhs": ((), (2, 3)),
    "scalar-rhs": ((2, 3), ()),
    "scalars": ((), ()),
    "lead": ((3,), (2, 3)),
    "lead-rhs": ((2, 4, 3), (4, 3)),
    "ones-both": ((2, 1, 4), (3, 1)),
    "ones-cross": ((1, 3), (2, 1)),
    "size1-vs-1d": ((4, 1, 1), (1, 3, 1)),
}
for kind, fn in BINARY.items():
    lo = 0.1 if kind == "pow" else -3.0  # pow's own edge cases cover negative bases
    for name, (sa, sb) in BROADCAST.items():
        case(kind, f"bcast-{name}", [rand(sa, "f32", lo), rand(sb, "f32", lo)], fn)
    for dt in ("f64", "f16", "bf16"):
        case(kind, dt, [rand((2, 3), dt, lo), rand((3,), dt, lo)], fn)
    if kind != "pow":  # pow is float-only
        for dt in ("i32", "i64", "u8"):
            lo_i, hi_i = (1, 20) if dt == "u8" else (-20, 20)
            rhs = rand((2, 3), dt, lo_i, hi_i)
            rhs[rhs == 0] = 3  # integer x/0 is kiln's own choice (0); torch raises, so it is checked separately
            case(kind, dt, [rand((2, 3), dt, lo_i, hi_i), rhs], TRUNC if kind == "div" else fn)

# integer wraparound and truncating division, torch's trunc rounding mode
case("add", "i32-wrap", [arr([2**31 - 1, -2**31, 5], "i32"), arr([1, -1, -7], "i32")], torch.add)
case("add", "u8-wrap", [arr([250, 255, 0], "u8"), arr([10, 1, 0], "u8")], torch.add)
case("sub", "u8-wrap", [arr([0, 3, 255], "u8"), arr([1, 7, 255], "u8")], torch.sub)
case("sub", "i64-wrap", [arr([-2**63, 0], "i64"), arr([1, -2**63], "i64")], torch.sub)
case("mul", "i64-wrap", [arr([2**62, -3, 2**40], "i64"), arr([4, 5, 2**40], "i64")], torch.mul)
case("mul", "i32-wrap", [arr([65536, 46341, -7], "i32"), arr([65536, 46341, 3], "i32")], torch.mul)
case("mul", "u8-wrap", [arr([16, 200, 3], "u8"), arr([16, 2, 5], "u8")], torch.mul)
DIV_A = [-7, 7, -7, 7, -1, 1, 0, -6, 6, -2**31, -2**31 + 1, 2**31 - 1, 5, -5]
DIV_B = [2, -2, -2, 2, 3, -3, -3, 3, -3, 2, 2**31 - 1, -2**31, -2**31, 2**31 - 1]
case("div", "i32-trunc", [arr(DIV_A, "i32"), arr(DIV_B, "i32")], TRUNC)
case("div", "i64-trunc", [arr([-7, 7, -2**63, 2**63 - 1, -9], "i64"), arr([2, -2, 3, -2**63, 4], "i64")], TRUNC)
case("div", "u8-trunc", [arr([255, 7, 0, 128], "u8"), arr([2, 3, 5, 255], "u8")], TRUNC)
case("div", "i32-bcast", [rand((2, 1, 3), "i32", -50, 50), arr([-4, 3], "i32").reshape(2, 1)], TRUNC)
case("div", "f32-edge", [arr([1.0, -1.0, 0.0, INF, -INF, NAN, 1.0]), arr([0.0, 0.0, 0.0, INF, 2.0, 1.0, -0.0])],
     torch.div)
case("pow", "edge", [arr([-2.0, -2.0, 0.0, 0.0, 0.0, INF, NAN, 1.0, -INF, 2.0]),
                     arr([0.5, 3.0, 0.0, -1.0, 2.0, 0.0, 0.0, NAN, 3.0, -INF])], torch.pow)
case("maximum", "nan", [arr([NAN, 1.0, -INF, 0.0]), arr([1.0, NAN, 2.0, -0.5])], torch.maximum)
case("minimum", "nan", [arr([NAN, 1.0, INF, 0.0]), arr([1.0, NAN, 2.0, -0.5])], torch.minimum)
for kind in ("equal", "less", "greater"):  # comparisons give bool; nan compares unequal and unordered
    case(kind, "edge", [arr([NAN, NAN, 1.0, -INF, INF, 0.0, 2.0]), arr([NAN, 1.0, 1.0, -INF, 3.0, -0.0, 1.0])],
         BINARY[kind])
    case(kind, "bool", [arr([True, True, False, False], "bool"), arr([True, False, True, False], "bool")],
         BINARY[kind])
    case(kind, "i64-extremes", [arr([-2**63, 2**63 - 1, 5], "i64"), arr([2**63 - 1, -2**63, 5], "i64")],
         BINARY[kind])

# -- where and cast ----------------------------------------------------------------------------------------------

for name, (sc, sa, sb) in {"same": ((2, 3), (2, 3), (2, 3)), "bcast": ((2, 1), (3,), ()),
                           "cond-scalar": ((), (2, 3), (1, 3)), "all-bcast": ((4, 1, 1), (1, 2, 1), (3,))}.items():
    case("where", name, [rand(sc, "bool"), rand(sa), rand(sb)], torch.where)
for dt in ("f64", "f16", "bf16", "i64", "i32", "u8", "bool"):
    case("where", dt, [rand((2, 3), "bool"), rand((2, 3), dt, 0, 9), rand((3,), dt, 0, 9)], torch.where)
case("where", "nan-inf", [arr([True, False, True], "bool"), arr([NAN, 1.0, -INF]), arr([0.0, NAN, 1.0])],
     torch.where)

TORCH_DTYPE = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
               "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
               "bool": torch.bool}


def cast_case(name: str, x: np.ndarray, dtype: str, tol: tuple[float, float] | None = EXACT) -> None:
    case("cast", name, [x], lambda t: t.to(TORCH_DTYPE[dtype]), tol=tol, dtype=dtype)


FRACTIONS = [-2.7, -2.5, -1.0, -0.9, -0.5, -0.0, 0.0, 0.4, 0.5, 0.99, 1.5, 2.5, 100.9, -100.9]
cast_case("f32-i32-trunc", arr(FRACTIONS), "i32")
cast_case("f32-i64-trunc", arr([*FRACTIONS, 2.0**40 + 0.5, -2.0**40]), "i64")
cast_case("f64-i32-trunc", arr(FRACTIONS, "f64"), "i32")
cast_case("f16-i32-trunc", arr(FRACTIONS, "f16"), "i32")
cast_case("bf16-i64-trunc", arr(FRACTIONS, "bf16"), "i64")
cast_case("f32-u8-trunc", arr([0.0, 0.9, 1.5, 127.99, 254.9, 255.0]), "u8")
cast_case("f32-i8-trunc", arr([-128.0, -127.5, 0.7, 126.9]), "i8")
cast_case("f32-bool", arr([0.0, -0.0, 0.1, -3.0, 1e-45, INF, -INF, NAN]), "bool")
cast_case("f16-bool", arr([0.0, -0.0, 6e-8, 1.0], "f16"), "bool")
cast_case("i32-bool", arr([0, 1, -1, 2**31 - 1], "i32"), "bool")
cast_case("u8-bool", arr([0, 255, 2], "u8"), "bool")
cast_case("bool-f32", arr([True, False], "bool"), "f32")
cast_case("bool-i64", arr([True, False], "bool"), "i64")
cast_case("bool-bf16", arr([True, False], "bool"), "bf16")
cast_case("i32-f32", arr([-2**31, 16777217, -3, 0], "i32"), "f32")
cast_case("i64-f64", arr([2**53 + 1, -2**63, 5], "i64"), "f64")
cast_case("i64-i32-wrap", arr([2**40 + 5, -2**33 - 1, 2**31, -1], "i64"), "i32")
cast_case("i32-u8-wrap", arr([-1, 256, 300, -129, 77], "i32"), "u8")
cast_case("u8-i32", arr([0, 200, 255], "u8"), "i32")
cast_case("u8-i8-wrap", arr([0, 127, 128, 255], "u8"), "i8")
cast_case("i32-f16", arr([2049, 65504, 70000, -5], "i32"), "f16")
cast_case("f32-bf16", rand((4, 5), "f32", -1e3, 1e3), "bf16")
cast_case("f32-bf16-edge", arr([0.0, -0.0, INF, -INF, NAN, 3.4e38, 1e-40, 1.00390625, 1.01171875]), "bf16")
cast_case("f32-f16", rand((4, 5), "f32", -100, 100), "f16")
cast_case("f32-f16-edge", arr([65504.0, 65520.0, 70000.0, -70000.0, 1e-8, 3e-5, NAN, 1.00048828125]), "f16")
cast_case("f64-f32", arr([1 / 3, 1e300, -1e-300, 2.0**-149 * 0.75, 2.0**-149 * 0.25], "f64"), "f32")
cast_case("f64-f16", rand((3, 3), "f64", -10, 10), "f16")
cast_case("bf16-f32", rand((3, 3), "bf16"), "f32")
cast_case("f16-f64", rand((3, 3), "f16"), "f64")
cast_case("f16-bf16", rand((3, 3), "f16"), "bf16")
cast_case("bf16-f16", arr([1.0, 3e38, 1e-10, -7.5], "bf16"), "f16")
cast_case("f32-f32", rand((2, 2)), "f32")
cast_case("i64-i64", arr([-2**63, 2**63 - 1], "i64"), "i64")
cast_case("scalar", arr(-3.75), "i32")

# -- reductions --------------------------------------------------------------------------------------------------


def reduce_oracle(kind: str, axes: Sequence[int] | None, keepdims: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def oracle(x: torch.Tensor) -> torch.Tensor:
        dim = tuple(range(x.ndim)) if axes is None else tuple(axes)
        if kind == "sum":  # kiln's sum keeps the input dtype (no promotion of ints to i64)
            return torch.sum(x, dim=dim, keepdim=keepdims, dtype=x.dtype)
        if kind == "mean":
            return torch.mean(x, dim=dim, keepdim=keepdims)
        return (torch.amax if kind == "max" else torch.amin)(x, dim=dim, keepdim=keepdims)
    return oracle


AXES: dict[str, tuple[list[int] | None, bool]] = {
    "all": (None, False), "all-keep": (None, True), "a0": ([0], False), "neg1": ([-1], False),
    "a1-keep": ([1], True), "a02": ([0, 2], False), "neg13-keep": ([-1, -3], True), "neg2-a0": ([-2, 0], False),
    "every-axis": ([0, 1, 2], False),
}
for kind in ("sum", "mean", "max", "min"):
    for name, (axes, keep) in AXES.items():
        case(kind, name, [rand((2, 3, 4))], reduce_oracle(kind, axes, keep), axes=axes, keepdims=keep)
    for dt in ("f64", "f16", "bf16"):
        case(kind, dt, [rand((3, 5), dt)], reduce_oracle(kind, [1], False), axes=[1])
    case(kind, "scalar", [arr(2.5)], reduce_oracle(kind, None, False))
    case(kind, "rank1-keep", [rand((7,))], reduce_oracle(kind, None, True), keepdims=True)
    if kind != "mean":  # mean is float-only
        for dt, (lo, hi) in {"i32": (-100, 100), "i64": (-100, 100), "u8": (0, 256)}.items():
            case(kind, dt, [rand((3, 4), dt, lo, hi)], reduce_oracle(kind, [0], False), axes=[0])
case("sum", "f32-sizable", [rand((4, 64, 33))], reduce_oracle("sum", [1, 2], False), tol=(1e-5, 1e-4), axes=[1, 2])
case("sum", "i32-wrap", [arr([2**30, 2**30, 2**30, 2**30 + 5], "i32")], reduce_oracle("sum", None, False))
case("sum", "u8-wrap", [arr([[200, 100], [255, 1]], "u8")], reduce_oracle("sum", [1], False), axes=[1])
case("sum", "inf-nan", [arr([[INF, 1.0], [INF, -INF], [NAN, 0.0]])], reduce_oracle("sum", [1], False), axes=[1])
case("mean", "inf-nan", [arr([[INF, 1.0], [INF, -INF], [NAN, 0.0]])], reduce_oracle("mean", [1], False), axes=[1])
case("max", "nan", [arr([[NAN, 1.0], [-INF, -INF], [2.0, NAN]])], reduce_oracle("max", [1], False), axes=[1])
case("min", "nan", [arr([[NAN, 1.0], [INF, INF], [2.0, NAN]])], reduce_oracle("min", [1], False), axes=[1])
case("max", "i64-extremes", [arr([-2**63, 2**63 - 1], "i64")], reduce_oracle("max", None, False))
case("min", "i64-extremes", [arr([-2**63, 2**63 - 1], "i64")], reduce_oracle("min", None, False))

LARGE = np.array([[1000.0, 1001.0, 1002.0, -1000.0], [-1e4, -1e4 + 1, -1e4 - 5, -1e4], [3e4, -3e4, 0.0, 3e4]],
                 np.float32)
MASKED = arr([[0.5, -INF, 1.5, -INF], [-INF, -INF, 2.0, -INF]])
for kind, fn in {"softmax": torch.softmax, "log_softmax": torch.log_softmax}.items():
    case(kind, "default-axis", [rand((3, 5))], lambda x, fn=fn: fn(x, -1))
    case(kind, "a0", [rand((3, 5))], lambda x, fn=fn: fn(x, 0), axis=0)
    case(kind, "rank3-a1", [rand((2, 3, 4))], lambda x, fn=fn: fn(x, 1), axis=1)
    case(kind, "rank3-neg2", [rand((2, 3, 4))], lambda x, fn=fn: fn(x, -2), axis=-2)
    case(kind, "rank1", [rand((6,))], lambda x, fn=fn: fn(x, 0), axis=0)
    case(kind, "large", [LARGE], lambda x, fn=fn: fn(x, -1))
    case(kind, "large-a0", [LARGE], lambda x, fn=fn: fn(x, 0), axis=0)
    case(kind, "large-scaled", [rand((4, 8), "f32", -1e4, 1e4)], lambda x, fn=fn: fn(x, -1))
    case(kind, "masked", [MASKED], lambda x, fn=fn: fn(x, -1))
    for dt in ("f64", "f16", "bf16"):
        case(kind, dt, [rand((3, 5), dt, -5, 5)], lambda x, fn=fn: fn(x, -1))
    case(kind, "large-f16", [rand((3, 5), "f16", -3e4, 3e4)], lambda x, fn=fn: fn(x, -1))
    case(kind, "large-f64", [rand((3, 5), "f64", -1e300, 1e300)], lambda x, fn=fn: fn(x, -1))

# -- prod, and the ops along one axis (argmax, argmin, topk, cumsum) -----------------------------------------------


def prod_oracle(axes: Sequence[int] | None, keepdims: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.prod takes one dim: the reduced dims moved last and merged (kiln's prod keeps the input dtype)."""
    def oracle(x: torch.Tensor) -> torch.Tensor:
        dims = sorted(d % max(x.ndim, 1) for d in (range(x.ndim) if axes is None else axes))
        kept = [d for d in range(x.ndim) if d not in dims]
        y = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1).prod(-1, dtype=x.dtype)
        return y.reshape([1 if d in dims else x.shape[d] for d in range(x.ndim)]) if keepdims else y
    return oracle


for name, (axes, keep) in AXES.items():
    case("prod", name, [rand((2, 3, 4), lo=0.5, hi=1.5)], prod_oracle(axes, keep), axes=axes, keepdims=keep)
for dt in ("f64", "f16", "bf16"):
    case("prod", dt, [rand((3, 5), dt, 0.5, 1.5)], prod_oracle([1], False), axes=[1])
case("prod", "i32-wrap", [arr([[2**16, 2**16, 3], [-5, 7, 0]], "i32")], prod_oracle([1], False), axes=[1])
case("prod", "i64", [rand((3, 4), "i64", -9, 9)], prod_oracle([0], False), axes=[0])
case("prod", "zeros-inf-nan", [arr([[0.0, INF], [NAN, 2.0], [-0.0, 3.0]])], prod_oracle([1], False), axes=[1])

# ONNX ArgMax: "the index of the first occurrence ... select_last_index ... the last occurrence"
TIES = arr([[3.0, 1.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [-INF, 7.0, 7.0, -INF]])
for kind, fn in {"argmax": torch.argmax, "argmin": torch.argmin}.items():
    case(kind, "a1", [rand((3, 5))], lambda x, fn=fn: fn(x, 1), axis=1)
    case(kind, "a0-keep", [rand((3, 5))], lambda x, fn=fn: fn(x, 0, keepdim=True), axis=0, keepdims=True)
    case(kind, "neg1-rank3", [rand((2, 3, 4))], lambda x, fn=fn: fn(x, -1), axis=-1)
    case(kind, "i32", [rand((4, 6), "i32", -50, 50)], lambda x, fn=fn: fn(x, 1), axis=1)
    case(kind, "ties-first", [TIES], lambda x, fn=fn: fn(x, 1), axis=1)
    case(kind, "ties-last", [TIES], lambda x, fn=fn: x.shape[1] - 1 - fn(x.flip(1), 1), axis=1,
         select_last_index=True)
    case(kind, "ties-last-keep", [TIES], lambda x, fn=fn: x.shape[0] - 1 - fn(x.flip(0), 0, keepdim=True), axis=0,
         keepdims=True, select_last_index=True)


def topk_oracle(k: int, axis: int, largest: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """torch.topk; ONNX's tie order (lower index first) from a stable sort, which torch.topk does not promise."""
    def oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, idx = torch.sort(x, dim=axis, descending=largest, stable=True)
        return values.narrow(axis, 0, k), idx.narrow(axis, 0, k)
    return oracle


case("topk", "largest", [rand((3, 6))], lambda x: tuple(torch.topk(x, 3)), k=3)
case("topk", "smallest-a0", [rand((5, 4))], lambda x: tuple(torch.topk(x, 2, 0, largest=False)), k=2, axis=0,
     largest=False)
case("topk", "ties-largest", [TIES], topk_oracle(3, 1, True), k=3, axis=1)
case("topk", "ties-smallest", [TIES], topk_oracle(4, 1, False), k=4, axis=1, largest=False)
case("topk", "i64-rank3", [rand((2, 5, 3), "i64", -4, 4)], topk_oracle(2, 1, True), k=2, axis=1)
case("topk", "k0", [rand((2, 3))], topk_oracle(0, -1, True), k=0)
for dt in ("f16", "bf16"):
    case("topk", dt, [rand((3, 6), dt)], topk_oracle(2, -1, True), k=2)


def cumsum_oracle(axis: int, exclusive: bool, reverse: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """ONNX CumSum: exclusive drops each element's own term, reverse sums from the end."""
    def oracle(x: torch.Tensor) -> torch.Tensor:
        y = x.flip(axis) if reverse else x
        out = torch.cumsum(y, axis, dtype=x.dtype)
        if exclusive:
            out = out - y
        return out.flip(axis) if reverse else out
    return oracle


for excl in (False, True):
    for rev in (False, True):
        name = f"{'exclusive' if excl else 'inclusive'}-{'reverse' if rev else 'forward'}"
        case("cumsum", name, [rand((3, 4), "i32", -9, 9)], cumsum_oracle(1, excl, rev), axis=1, exclusive=excl,
             reverse=rev)
        case("cumsum", f"{name}-f64", [rand((4, 3), "f64")], cumsum_oracle(0, excl, rev), axis=0, exclusive=excl,
             reverse=rev)
case("cumsum", "f32-neg-axis", [rand((2, 3, 5))], cumsum_oracle(-1, False, False), axis=-1)
case("cumsum", "f16", [rand((6,), "f16")], cumsum_oracle(0, False, False))

# -- linalg -----------------------------------------------------------------------------------------------------

MATMUL = {
    "2d": ((3, 4), (4, 5)),
    "batched": ((2, 3, 4), (2, 4, 5)),
    "batch-lhs-only": ((2, 3, 4), (4, 5)),
    "batch-rhs-only": ((3, 4), (2, 4, 5)),
    "batch-bcast": ((2, 1, 3, 4), (5, 4, 6)),
    "batch-bcast-both": ((2, 1, 3, 4), (1, 3, 4, 2)),
    "1d-2d": ((4,), (4, 5)),
    "2d-1d": ((3, 4), (4,)),
    "1d-1d": ((4,), (4,)),
    "1d-3d": ((4,), (2, 4, 5)),
    "3d-1d": ((2, 3, 4), (4,)),
    "k1": ((3, 1), (1, 2)),
}
for name, (sa, sb) in MATMUL.items():
    case("matmul", name, [rand(sa), rand(sb)], torch.matmul)
for dt in ("f64", "f16", "bf16"):
    case("matmul", dt, [rand((2, 3, 4), dt), rand((4, 5), dt)], torch.matmul)
for dt in ("i32", "i64", "u8"):  # u8 wraps
    case("matmul", dt, [rand((3, 4), dt, 0, 100), rand((4, 2), dt, 0, 100)], torch.matmul)
case("matmul", "nan-inf", [arr([[INF, 1.0], [NAN, 0.0], [1.0, 2.0]]), arr([[1.0, 0.0], [0.0, 1.0]])], torch.matmul)

# kiln's linear stores the weight [in, out] as Burn does; torch's F.linear takes it [out, in]
case("linear", "bias", [rand((3, 4)), rand((4, 5)), rand((5,))], lambda x, w, b: F.linear(x, w.T, b))
case("linear", "no-bias", [rand((3, 4)), rand((4, 5))], lambda x, w: F.linear(x, w.T))
case("linear", "batched", [rand((2, 3, 4)), rand((4, 5)), rand((5,))], lambda x, w, b: F.linear(x, w.T, b))
case("linear", "rank4", [rand((2, 2, 3, 4)), rand((4, 1))], lambda x, w: F.linear(x, w.T))
case("linear", "1d", [rand((4,)), rand((4, 5)), rand((5,))], lambda x, w, b: F.linear(x, w.T, b))
for dt in ("f64", "f16", "bf16"):
    case("linear", dt, [rand((3, 4), dt), rand((4, 5), dt), rand((5,), dt)], lambda x, w, b: F.linear(x, w.T, b))

for name, scale in {"half": 0.5, "neg": -2.0, "zero": 0.0}.items():
    case("lora", name, [rand((4, 5)), rand((4, 2)), rand((2, 5))], lambda w, a, b, s=scale: w + s * (a @ b),
         scale=scale)
case("lora", "f64", [rand((3, 6), "f64"), rand((3, 1), "f64"), rand((1, 6), "f64")], lambda w, a, b: w + 2 * (a @ b),
     scale=2)
case("lora", "bf16", [rand((3, 4), "bf16"), rand((3, 2), "bf16"), rand((2, 4), "bf16")],
     lambda w, a, b: (w.float() + 0.25 * (a.float() @ b.float())).bfloat16(), scale=0.25)


def dora_oracle(scale: float) -> Callable[..., torch.Tensor]:
    """DoRA (Liu et al. 2024) for [in, out] weights: V = W + s * (A @ B), W' = m * V / ||V||_c over axis 0."""
    def fn(w, a, b, m):
        v = w + scale * (a @ b)
        return m * v / torch.sqrt(torch.sum(v * v, dim=0))
    return fn


for name, scale in {"half": 0.5, "neg": -2.0, "zero": 0.0}.items():
    case("dora", name, [rand((4, 5)), rand((4, 2)), rand((2, 5)), rand((5,), lo=0.1)], dora_oracle(scale),
         scale=scale)
case("dora", "f64", [rand((3, 6), "f64"), rand((3, 1), "f64"), rand((1, 6), "f64"), rand((6,), "f64")],
     dora_oracle(2.0), scale=2.0)

# -- dropout: the deterministic corners (the stochastic ones have their own tests below) --------------------------

case("dropout", "not-training", [rand((4, 5)), arr(False, "bool")], lambda x, t: F.dropout(x, 0.5, training=False),
     tol=EXACT)
case("dropout", "p0-training", [rand((4, 5)), arr(True, "bool")], lambda x, t: F.dropout(x, 0.0, training=True),
     tol=EXACT, p=0.0)
case("dropout", "not-training-f16", [rand((4, 5), "f16"), arr(False, "bool")],
     lambda x, t: F.dropout(x, 0.9, training=False), tol=EXACT, p=0.9)

# -- collectives: a process group of one, where torch.distributed.all_reduce leaves a tensor as it is (the
# multi-process semantics are checked against torch.distributed in tests/runtime/test_distributed.py) --------------

case("all_reduce", "mean-bucket", [rand((2, 3)), rand((4,))], lambda a, b: (a.clone(), b.clone()), tol=EXACT)
case("all_reduce", "sum-f64", [rand((3,), "f64")], lambda a: a.clone(), tol=EXACT, op="sum")
case("all_reduce", "f16", [rand((2, 2), "f16")], lambda a: a.clone(), tol=EXACT)
# its two halves (data-parallel{overlap}): on a group of one the start hands back its operands, the wait the result
case("all_reduce_start", "bucket", [rand((2, 3)), rand((4,))], lambda a, b: (a.clone(), b.clone()), tol=EXACT,
     bucket=2)
case("all_reduce_wait", "sum-bucket", [rand((2, 3)), rand((4,))], lambda a, b: (a.clone(), b.clone()), tol=EXACT,
     op="sum", bucket=2)
# torch.distributed.broadcast leaves the source rank's tensor as it is: on a group of one, rank 0 is the source
case("broadcast", "bucket", [rand((2, 3)), rand((4,))], lambda a, b: (a.clone(), b.clone()), tol=EXACT)
case("broadcast", "i64", [arr(np.arange(5), "i64")], lambda a: a.clone(), tol=EXACT)

# -- data movement -----------------------------------------------------------------------------------------------

for name, (shape, perm) in {"reverse": ((2, 3, 4), None), "2d": ((3, 5), None), "1d": ((4,), None),
                            "scalar": ((), None), "perm102": ((2, 3, 4), [1, 0, 2]),
                            "identity": ((2, 3), [0, 1]), "rank4": ((2, 3, 1, 4), [3, 1, 0, 2])}.items():
    rank = len(shape)
    p = list(reversed(range(rank))) if perm is None else perm
    case("transpose", name, [rand(shape)], lambda x, p=p: torch.permute(x, p), tol=EXACT, perm=perm)
for dt in ("bool", "i64", "u8", "bf16", "f16"):
    case("transpose", dt, [rand((2, 3), dt, 0, 9)], lambda x: x.permute(1, 0), tol=EXACT)

for name, (src, dst) in {"flatten-lead": ((2, 3, 4), [6, 4]), "flat": ((2, 3, 4), [-1]),
                         "infer-mid": ((2, 3, 4), [4, -1, 2]), "infer-last": ((2, 3, 4), [2, -1]),
                         "unit-dims": ((2, 3, 4), [1, 24, 1]), "from-scalar": ((), [1, 1]), "to-scalar": ((1,), []),
                         "empty": ((0, 3), [3, 0]), "empty-infer": ((0, 3), [-1, 3])}.items():
    case("reshape", name, [rand(src)], lambda x, s=dst: x.reshape(s), tol=EXACT, shape=dst)
for dt in ("bool", "i32", "bf16"):
    case("reshape", dt, [rand((2, 3), dt, 0, 9)], lambda x: x.reshape(3, 2), tol=EXACT, shape=[3, 2])
# `copy`: target dims taken from `like`'s axes (here [like.shape[1], like.shape[0], inferred])
case("reshape", "copy", [rand((4, 6)), rand((3, 2, 5))], lambda x, like: x.reshape(like.shape[1], like.shape[0], -1),
     tol=EXACT, shape=[-1, -1, -1], copy=[1, 0, -1])

for name, (src, dst) in {"lead-and-size1": ((3, 1), [2, 3, 4]), "keep-dim": ((3, 1), [2, -1, 4]),
                         "keep-all": ((2, 3), [-1, -1]), "scalar": ((), [2, 3]), "row": ((1, 4), [3, 4]),
                         "same": ((2, 3), [2, 3]), "size1-to-0": ((1, 3), [0, 3])}.items():
    case("broadcast_to", name, [rand(src)], lambda x, s=dst: x.expand(*s), tol=EXACT, shape=dst)
for dt in ("bool", "i64", "bf16"):
    case("broadcast_to", dt, [rand((1, 3), dt, 0, 9)], lambda x: x.expand(2, 3), tol=EXACT, shape=[2, 3])

CONCAT = {
    "three-a1": ([(2, 1), (2, 3), (2, 2)], 1),
    "three-neg1": ([(2, 1), (2, 3), (2, 2)], -1),
    "three-a0": ([(1, 3), (2, 3), (3, 3)], 0),
    "one": ([(2, 3)], 0),
    "four-rank3": ([(2, 1, 4), (2, 2, 4), (2, 3, 4), (2, 1, 4)], 1),
    "rank1": ([(2,), (3,)], 0),
    "empty-part": ([(0, 3), (2, 3)], 0),
}
for name, (shapes, axis) in CONCAT.items():
    case("concat", name, [rand(s) for s in shapes], lambda *xs, a=axis: torch.cat(xs, dim=a), tol=EXACT, axis=axis)
for dt in ("bool", "i32", "u8", "bf16"):
    case("concat", dt, [rand((2, 2), dt, 0, 9), rand((1, 2), dt, 0, 9)], lambda *xs: torch.cat(xs), tol=EXACT)


def slice_case(name: str, shape: tuple[int, ...], oracle: Callable[[torch.Tensor], torch.Tensor], dtype: str = "f32",
               **attrs: Any) -> None:
    case("slice", name, [rand(shape, dtype, 0, 9)], oracle, tol=EXACT, **attrs)


slice_case("a0", (5, 6), lambda x: x[1:4], starts=[1], ends=[4])
slice_case("two-axes", (5, 6), lambda x: x[1:4, 2:5], starts=[1, 2], ends=[4, 5])
slice_case("axis1", (5, 6), lambda x: x[:, 1:3], starts=[1], ends=[3], axes=[1])
slice_case("neg-axis", (2, 5, 6), lambda x: x[..., 2:], starts=[2], ends=[6], axes=[-1])
slice_case("neg-start", (5, 6), lambda x: x[:, -3:], starts=[-3], ends=[100], axes=[1])
slice_case("neg-end", (5, 6), lambda x: x[1:-1], starts=[1], ends=[-1])
slice_case("clamped", (5, 6), lambda x: x[-100:100, 0:1000], starts=[-100, 0], ends=[100, 1000])
slice_case("steps", (5, 6), lambda x: x[0:5:2, 1:6:3], starts=[0, 1], ends=[5, 6], steps=[2, 3])
slice_case("step-neg-start", (7,), lambda x: x[-6::2], starts=[-6], ends=[7], steps=[2])
slice_case("empty", (5, 6), lambda x: x[4:2], starts=[4], ends=[2])
slice_case("empty-beyond", (5, 6), lambda x: x[:, 7:9], starts=[7], ends=[9], axes=[1])
slice_case("axes-reordered", (4, 5, 6), lambda x: x[1:3, :, 0:6:2], starts=[0, 1], ends=[6, 3], axes=[2, 0],
           steps=[2, 1])
# negative steps run backwards as in numpy (torch slicing has none, so the kept indices are spelled out)
slice_case("reverse", (5, 6), lambda x: x.flip(1), starts=[-1], ends=[-100], axes=[1], steps=[-1])
slice_case("neg-step2", (5, 6), lambda x: x[[4, 2]], starts=[4], ends=[0], steps=[-2])
slice_case("neg-step-clamped", (5, 6), lambda x: x[:, [5, 2]], starts=[100], ends=[-100], axes=[1], steps=[-3])
slice_case("i64", (4, 3), lambda x: x[1:], "i64", starts=[1], ends=[4])
slice_case("bool", (4, 3), lambda x: x[:, ::2], "bool", starts=[0], ends=[3], axes=[1], steps=[2])
slice_case("bf16", (4, 3), lambda x: x[-2:], "bf16", starts=[-2], ends=[4])

X53 = rand((5, 3))
case("take", "embedding", [X53, arr([4, 0, 2, 2], "i64")], lambda x, i: torch.index_select(x, 0, i), tol=EXACT)
case("take", "i32-indices", [X53, arr([1, 3], "i32")], lambda x, i: torch.index_select(x, 0, i), tol=EXACT)
case("take", "2d-indices", [X53, arr([[0, 1], [4, 4], [3, 2]], "i64")], lambda x, i: x[i], tol=EXACT)
case("take", "axis1", [X53, arr([2, 0, 0, 1], "i64")], lambda x, i: x[:, i], tol=EXACT, axis=1)
case("take", "axis-neg1-2d", [rand((2, 3, 4)), arr([[3, 0], [1, 1]], "i64")], lambda x, i: x[..., i], tol=EXACT,
     axis=-1)
case("take", "negative-indices", [X53, arr([-1, -5, 0], "i64")], lambda x, i: x[i], tol=EXACT)
case("take", "scalar-index", [X53, arr(3, "i64")], lambda x, i: x[i], tol=EXACT)
case("take", "empty-indices", [X53, np.zeros((0,), np.int64)], lambda x, i: x[i], tol=EXACT)
for dt in ("bool", "i32", "bf16"):
    case("take", dt, [rand((4, 2), dt, 0, 9), arr([3, 1], "i64")], lambda x, i: x[i], tol=EXACT)

case("gather", "axis1", [rand((3, 4)), rand((3, 5), "i64", 0, 4)], lambda x, i: torch.gather(x, 1, i), tol=EXACT,
     axis=1)
case("gather", "axis0", [rand((3, 4)), rand((2, 4), "i64", 0, 3)], lambda x, i: torch.gather(x, 0, i), tol=EXACT)
case("gather", "axis-neg1-rank3", [rand((2, 3, 4)), rand((2, 3, 2), "i64", 0, 4)],
     lambda x, i: torch.take_along_dim(x, i, dim=-1), tol=EXACT, axis=-1)
case("gather", "i32-indices", [rand((3, 4)), rand((3, 2), "i32", 0, 4)],
     lambda x, i: torch.gather(x, 1, i.long()), tol=EXACT, axis=1)
case("gather", "rank1", [rand((6,)), arr([5, 0, 0, 3], "i64")], lambda x, i: torch.gather(x, 0, i), tol=EXACT)
for dt in ("bool", "i64", "bf16"):
    case("gather", dt, [rand((2, 3), dt, 0, 9), rand((2, 2), "i64", 0, 3)], lambda x, i: torch.gather(x, 1, i),
         tol=EXACT, axis=1)

# tile: numpy.tile with one count per dim (torch's Tensor.repeat); scatter_nd: ONNX ScatterND, reduction none


def scatter_nd_oracle(data: torch.Tensor, idx: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """The ScatterND spec's loop: output[indices[idx]] = updates[idx] for each index position."""
    out = data.clone()
    for pos in np.ndindex(*idx.shape[:-1]):
        out[tuple(int(i) for i in idx[pos])] = updates[pos]
    return out



REDUCE = {"add": torch.add, "mul": torch.mul, "max": torch.maximum, "min": torch.minimum}


def scatter_nd_reduce_oracle(reduction: str):
    """ScatterND's reduction loop: "output[indices[idx]] = f(output[indices[idx]], updates[idx])" in index order."""
    def oracle(data: torch.Tensor, idx: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        out = data.clone()
        for pos in np.ndindex(*idx.shape[:-1]):
            at = tuple(int(i) for i in idx[pos])
            out[at] = REDUCE[reduction](out[at], updates[pos])
        return out
    return oracle

case("tile", "2d", [rand((2, 3))], lambda x: x.repeat(2, 3), tol=EXACT, repeats=[2, 3])
case("tile", "ones-and-zero", [rand((2, 1, 3), "i64", 0, 9)], lambda x: x.repeat(1, 4, 0), repeats=[1, 4, 0])
case("tile", "bool", [rand((3,), "bool")], lambda x: x.repeat(2), repeats=[2])
case("tile", "scalar", [arr(1.5)], lambda x: x.clone(), tol=EXACT, repeats=[])
case("tile", "bf16", [rand((2, 2), "bf16")], lambda x: x.repeat(1, 2), tol=EXACT, repeats=[1, 2])
case("scatter_nd", "rows", [rand((5, 3)), arr([[1], [-1]], "i64"), rand((2, 3))], scatter_nd_oracle, tol=EXACT)
case("scatter_nd", "elements", [rand((3, 4)), arr([[0, 1], [2, 3], [1, -4]], "i64"), rand((3,))], scatter_nd_oracle,
     tol=EXACT)
case("scatter_nd", "whole", [rand((2, 2), "i32", -9, 9), np.zeros((1, 0), np.int64), rand((1, 2, 2), "i32", -9, 9)],
     scatter_nd_oracle)
for reduction in REDUCE:  # repeated and negative indices: every update combines, in order
    case("scatter_nd_reduce", f"{reduction}-repeated-rows", [rand((4, 3)), arr([[1], [-3], [3], [1]], "i64"),
                                                             rand((4, 3))],
         scatter_nd_reduce_oracle(reduction), reduction=reduction)
case("scatter_nd_reduce", "add-elements-i32", [rand((2, 3), "i32", -9, 9), arr([[0, 1], [1, 2], [0, 1]], "i32"),
                                               rand((3,), "i32", -9, 9)], scatter_nd_reduce_oracle("add"),
     reduction="add")
case("scatter_nd", "i32-indices-rank3", [rand((2, 3, 4), "f16"), arr([[[1, 2]], [[0, 0]]], "i32"),
                                         rand((2, 1, 4), "f16")], scatter_nd_oracle, tol=EXACT)

# -- nn: convolution, pooling, normalization, erf (torch layouts: NCL / NCHW, weight [out, in/groups, *k]) ----------

CONV1D = {
    "plain": ((2, 3, 9), (4, 3, 3), {}),
    "stride-pad": ((2, 3, 9), (4, 3, 3), {"stride": [2], "padding": [1]}),
    "dilation": ((1, 2, 10), (3, 2, 3), {"dilation": [3], "padding": [2]}),
    "groups": ((2, 4, 7), (6, 2, 2), {"groups": 2}),
    "depthwise": ((2, 3, 6), (3, 1, 3), {"groups": 3, "padding": [1]}),
    "k1": ((1, 2, 4), (5, 2, 1), {}),
}
for name, (sx, sw, attrs) in CONV1D.items():
    opts = {"stride": attrs.get("stride", [1]), "padding": attrs.get("padding", [0]),
            "dilation": attrs.get("dilation", [1]), "groups": attrs.get("groups", 1)}
    case("conv1d", name, [rand(sx), rand(sw)], lambda x, w, o=opts: F.conv1d(x, w, None, **o), **attrs)
    case("conv1d", f"{name}-bias", [rand(sx), rand(sw), rand(sw[:1])],
         lambda x, w, b, o=opts: F.conv1d(x, w, b, **o), **attrs)
CONV2D = {
    "plain": ((2, 3, 6, 5), (4, 3, 3, 2), {}),
    "stride-pad": ((2, 3, 7, 7), (4, 3, 3, 3), {"stride": [2, 1], "padding": [1, 2]}),
    "dilation": ((1, 2, 9, 8), (3, 2, 3, 2), {"dilation": [2, 3], "stride": [1, 2]}),
    "groups": ((2, 4, 5, 5), (6, 2, 2, 3), {"groups": 2, "padding": [1, 0]}),
    "depthwise": ((1, 3, 5, 5), (3, 1, 3, 3), {"groups": 3, "padding": [1, 1]}),
    "kernel-is-input": ((2, 2, 3, 3), (4, 2, 3, 3), {}),
}
for name, (sx, sw, attrs) in CONV2D.items():
    opts = {"stride": attrs.get("stride", [1, 1]), "padding": attrs.get("padding", [0, 0]),
            "dilation": attrs.get("dilation", [1, 1]), "groups": attrs.get("groups", 1)}
    case("conv2d", name, [rand(sx), rand(sw)], lambda x, w, o=opts: F.conv2d(x, w, None, **o), **attrs)
    case("conv2d", f"{name}-bias", [rand(sx), rand(sw), rand(sw[:1])],
         lambda x, w, b, o=opts: F.conv2d(x, w, b, **o), **attrs)
for dt in ("f64", "f16", "bf16"):
    case("conv2d", dt, [rand((1, 2, 5, 5), dt), rand((3, 2, 3, 3), dt), rand((3,), dt)],
         lambda x, w, b: F.conv2d(x, w, b, padding=1), tol=TOL[DType(dt).numpy] if dt == "f64" else (2e-2, 5e-2),
         padding=[1, 1])
    case("conv1d", dt, [rand((1, 2, 6), dt), rand((3, 2, 3), dt)], lambda x, w: F.conv1d(x, w),
         tol=None if dt == "f64" else (2e-2, 5e-2))

POOLS = {
    "k2": ([2, 2], {}),
    "k3-s1": ([3, 3], {"stride": [1, 1]}),
    "k3-s2-p1": ([3, 3], {"stride": [2, 2], "padding": [1, 1]}),
    "k2x3-s-p": ([2, 3], {"stride": [1, 2], "padding": [1, 1]}),
    "k3-p1-default-stride": ([3, 3], {"padding": [1, 0]}),
}
for name, (kernel, attrs) in POOLS.items():
    opts = {"stride": attrs.get("stride"), "padding": attrs.get("padding", [0, 0])}
    case("max_pool2d", name, [rand((2, 3, 7, 6))], lambda x, k=kernel, o=opts: F.max_pool2d(x, k, **o), tol=EXACT,
         kernel=kernel, **attrs)
    for include in (True, False):
        case("avg_pool2d", f"{name}-{'with' if include else 'without'}-pad", [rand((2, 3, 7, 6))],
             lambda x, k=kernel, o=opts, c=include: F.avg_pool2d(x, k, count_include_pad=c, **o),
             kernel=kernel, count_include_pad=include, **attrs)
case("max_pool2d", "dilation", [rand((1, 2, 8, 9))],
     lambda x: F.max_pool2d(x, 2, stride=1, padding=1, dilation=[2, 3]), tol=EXACT, kernel=[2, 2], stride=[1, 1],
     padding=[1, 1], dilation=[2, 3])
case("max_pool2d", "negative-inputs-padded", [rand((1, 1, 4, 4), "f32", -9, -1)],
     lambda x: F.max_pool2d(x, 3, stride=2, padding=1), tol=EXACT, kernel=[3, 3], stride=[2, 2], padding=[1, 1])
case("max_pool2d", "nan", [arr([[[[NAN, 1.0], [2.0, 3.0]]]])], lambda x: F.max_pool2d(x, 2), tol=EXACT,
     kernel=[2, 2])
for dt in ("f64", "f16", "bf16"):
    case("max_pool2d", dt, [rand((1, 2, 5, 5), dt)], lambda x: F.max_pool2d(x, 2, 1), tol=EXACT, kernel=[2, 2],
         stride=[1, 1])
    case("avg_pool2d", dt, [rand((1, 2, 5, 5), dt)], lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
         kernel=[3, 3], stride=[2, 2], padding=[1, 1], count_include_pad=False)

for name, (shape, size) in {"divisible": ((2, 3, 8, 6), [4, 3]), "uneven": ((1, 2, 7, 5), [3, 2]),
                            "global": ((2, 3, 5, 4), [1, 1]), "upsample": ((1, 1, 2, 3), [5, 4]),
                            "same": ((1, 2, 3, 3), [3, 3])}.items():
    case("adaptive_avg_pool2d", name, [rand(shape)], lambda x, s=size: F.adaptive_avg_pool2d(x, s), output_size=size)
for dt in ("f64", "f16", "bf16"):
    case("adaptive_avg_pool2d", dt, [rand((1, 2, 7, 5), dt)], lambda x: F.adaptive_avg_pool2d(x, [3, 2]),
         output_size=[3, 2])

# 3-D (NCDHW) convolution and pooling against torch's conv3d / conv_transpose3d / max_pool3d / avg_pool3d.
case("conv3d", "stride-pad-dilation-groups", [rand((2, 4, 5, 6, 5)), rand((6, 2, 3, 2, 2)), rand((6,))],
     lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2), groups=2),
     stride=[1, 2, 1], padding=[1, 0, 1], dilation=[1, 1, 2], groups=2)
case("conv_transpose3d", "stride-pad-outpad", [rand((1, 2, 3, 4, 3)), rand((2, 3, 2, 3, 2)), rand((3,))],
     lambda x, w, b: F.conv_transpose3d(x, w, b, stride=(2, 1, 2), padding=(1, 1, 0), output_padding=(1, 0, 1)),
     stride=[2, 1, 2], padding=[1, 1, 0], output_padding=[1, 0, 1])
case("max_pool3d", "stride-pad-dilation", [rand((2, 2, 6, 7, 5))],
     lambda x: F.max_pool3d(x, (3, 2, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 2, 1)), tol=EXACT,
     kernel=[3, 2, 2], stride=[2, 1, 2], padding=[1, 1, 0], dilation=[1, 2, 1])
for include in (True, False):
    case("avg_pool3d", f"pad-{'with' if include else 'without'}", [rand((1, 3, 5, 6, 4))],
         lambda x, c=include: F.avg_pool3d(x, (3, 2, 3), stride=(2, 2, 1), padding=(1, 1, 1), count_include_pad=c),
         kernel=[3, 2, 3], stride=[2, 2, 1], padding=[1, 1, 1], count_include_pad=include)



def dilated_avg_pool(x, kernel, stride, padding, dilation, include):
    """ONNX's dilated AveragePool (torch's avg_pool has no dilation): a depthwise conv with a ones kernel, divided
    by the whole kernel or by the same conv of the unpadded ones."""
    c, nd = x.shape[1], len(kernel)
    conv = (F.conv2d, F.conv3d)[nd - 2]
    ones = torch.ones((c, 1, *kernel), dtype=x.dtype)
    opts = {"stride": stride, "padding": padding, "dilation": dilation}
    total = conv(x, ones, groups=c, **opts)
    return total / math.prod(kernel) if include else total / conv(torch.ones_like(x), ones, groups=c, **opts)


for include in (True, False):
    case("avg_pool2d", f"dilation-{'with' if include else 'without'}-pad", [rand((1, 2, 8, 9))],
         lambda x, c=include: dilated_avg_pool(x, (2, 3), (1, 2), (1, 1), (2, 2), c),
         kernel=[2, 3], stride=[1, 2], padding=[1, 1], dilation=[2, 2], count_include_pad=include)
    case("avg_pool3d", f"dilation-{'with' if include else 'without'}-pad", [rand((1, 2, 6, 5, 7))],
         lambda x, c=include: dilated_avg_pool(x, (2, 2, 3), (2, 1, 1), (1, 0, 1), (2, 1, 2), c),
         kernel=[2, 2, 3], stride=[2, 1, 1], padding=[1, 0, 1], dilation=[2, 1, 2], count_include_pad=include)

# Transposed convolution against torch.nn.functional.conv_transpose{1,2}d: "out = (in - 1) * stride - 2 * padding
# + dilation * (kernel - 1) + output_padding + 1", weight [in, out / groups, *kernel].
CONV_TRANSPOSE = {
    "plain": ((2, 3, 4, 5), (3, 2, 3, 2), {}),
    "stride-pad-outpad": ((1, 2, 4, 3), (2, 3, 3, 3), {"stride": [2, 3], "padding": [1, 1], "output_padding": [1, 2]}),
    "dilation-groups": ((2, 4, 3, 4), (4, 3, 2, 3), {"dilation": [2, 1], "groups": 2, "stride": [1, 2]}),
    "depthwise": ((1, 3, 5, 5), (3, 1, 3, 3), {"groups": 3, "padding": [1, 1]}),
}
for name, (sx, sw, attrs) in CONV_TRANSPOSE.items():
    for nd in (1, 2):
        sxn, swn = sx[:2 + nd], sw[:2 + nd]
        a = {k: v if k == "groups" else v[:nd] for k, v in attrs.items()}
        opts = {"stride": 1, "padding": 0, "output_padding": 0, "dilation": 1, "groups": 1, **a}
        fn = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
        groups = attrs.get("groups", 1)
        case(f"conv_transpose{nd}d", name, [rand(sxn), rand(swn)], lambda x, w, o=opts, f=fn: f(x, w, None, **o), **a)
        case(f"conv_transpose{nd}d", f"{name}-bias", [rand(sxn), rand(swn), rand((swn[1] * groups,))],
             lambda x, w, b, o=opts, f=fn: f(x, w, b, **o), **a)
for dt in ("f64", "f16"):
    case("conv_transpose2d", dt, [rand((1, 2, 3, 3), dt), rand((2, 3, 2, 2), dt)],
         lambda x, w: F.conv_transpose2d(x, w, stride=2), tol=None if dt == "f64" else (2e-2, 5e-2), stride=[2, 2])

# pad against torch.nn.functional.pad (pairs from the last axis; "reflect" omits the edge, "replicate" repeats it;
# negative constant pads crop).
PADS = {"widen": ([0, 1, 2, 0], [0, 0, 1, 3]), "crop-and-pad": ([0, 0, -1, 2], [0, 0, 2, -2]),
        "crop-only": ([0, -1, 0, -2], [0, 0, -1, 0])}


def torch_pads(before, after):
    return [w for b, a in zip(reversed(before), reversed(after)) for w in (b, a)]


def torch_pad(x, before, after, mode, value=0.0):
    """F.pad crops only in constant mode, so the crop is a slice first; its reflect and replicate modes pad trailing
    dims only, so each axis is padded moved last."""
    x = x[tuple(slice(max(-b, 0), x.shape[i] - max(-a, 0)) for i, (b, a) in enumerate(zip(before, after)))]
    if mode == "constant":
        return F.pad(x, torch_pads([max(b, 0) for b in before], [max(a, 0) for a in after]), value=value)
    for axis, (b, a) in enumerate(zip(before, after)):
        if b > 0 or a > 0:
            moved = x.movedim(axis, -1)
            flat = F.pad(moved.reshape(1, -1, moved.shape[-1]), [max(b, 0), max(a, 0)],
                         {"edge": "replicate"}.get(mode, mode))
            x = flat.reshape(*moved.shape[:-1], flat.shape[-1]).movedim(-1, axis)
    return x


for name, (before, after) in PADS.items():
    for mode in ("constant", "reflect", "edge"):
        case("pad", f"{name}-{mode}", [rand((2, 3, 5, 6))],
             lambda x, b=before, a=after, m=mode: torch_pad(x, b, a, m, 1.5), tol=EXACT, before=before, after=after,
             mode=mode, **({"value": 1.5} if mode == "constant" else {}))
case("pad", "negative-constant-is-torch-crop", [rand((3, 4))], lambda x: F.pad(x, [-1, 2, 1, -2]), tol=EXACT,
     before=[1, -1], after=[-2, 2])
case("pad", "i64", [rand((2, 3), "i64", -5, 5)], lambda x: F.pad(x, [1, 1], value=7), tol=EXACT, before=[0, 1],
     after=[0, 1], value=7.0)
for dt in ("f16", "bf16"):
    case("pad", dt, [rand((1, 2, 4, 4), dt)], lambda x: F.pad(x, [1, 2, 2, 1], "reflect"), tol=EXACT,
         before=[0, 0, 2, 1], after=[0, 0, 1, 2], mode="reflect")

# resize against torch.nn.functional.interpolate: "nearest" is ONNX's asymmetric + floor, "nearest-exact"
# half_pixel + round_prefer_ceil, bilinear/linear align_corners=False pytorch_half_pixel, True align_corners.
RESIZES = {
    "nearest-up": ((1, 2, 3, 4), [7, 9], "nearest", {"coordinate_mode": "asymmetric", "nearest_mode": "floor"}),
    "nearest-down": ((2, 1, 7, 6), [3, 4], "nearest", {"coordinate_mode": "asymmetric", "nearest_mode": "floor"}),
    "nearest-exact": ((1, 2, 5, 4), [8, 3], "nearest-exact", {"nearest_mode": "round_prefer_ceil"}),
    "bilinear-up": ((1, 2, 3, 4), [7, 9], "bilinear", {"mode": "linear", "coordinate_mode": "pytorch_half_pixel"}),
    "bilinear-down": ((2, 2, 9, 7), [4, 3], "bilinear", {"mode": "linear", "coordinate_mode": "pytorch_half_pixel"}),
    "bilinear-corners": ((1, 1, 4, 5), [6, 3], "bilinear-corners", {"mode": "linear",
                                                                    "coordinate_mode": "align_corners"}),
}


def interpolate(x, size, mode):
    if mode == "bilinear-corners":
        return F.interpolate(x, size, mode="bilinear", align_corners=True)
    return F.interpolate(x, size, mode=mode)


for name, (shape, size, mode, attrs) in RESIZES.items():
    case("resize", name, [rand(shape)], lambda x, s=size, m=mode: interpolate(x, s, m),
         tol=EXACT if "nearest" in mode else None, size=size, **attrs)
case("resize", "linear-1d-scale", [rand((2, 3, 5))],
     lambda x: F.interpolate(x, scale_factor=1.5, mode="linear", recompute_scale_factor=False), size=[7],
     scales=[1.5], mode="linear")
# cubic against torch's bicubic (A = -0.75, edge taps clamped; align_corners=False is half_pixel); antialias against
# torch's antialias=True, which drops taps outside the input (exclude_outside) and, for bicubic, uses A = -0.5.
CUBIC = {"mode": "cubic", "coordinate_mode": "half_pixel"}
case("resize", "cubic-up", [rand((1, 2, 4, 5))], lambda x: F.interpolate(x, [9, 7], mode="bicubic"), size=[9, 7],
     **CUBIC)
case("resize", "cubic-down-corners", [rand((1, 2, 9, 7))],
     lambda x: F.interpolate(x, [4, 3], mode="bicubic", align_corners=True), size=[4, 3], mode="cubic",
     coordinate_mode="align_corners")
case("resize", "cubic-antialias", [rand((1, 2, 9, 7))],
     lambda x: F.interpolate(x, [4, 3], mode="bicubic", antialias=True), size=[4, 3], cubic_coeff_a=-0.5,
     exclude_outside=True, antialias=True, **CUBIC)
case("resize", "linear-antialias", [rand((2, 1, 9, 7))],
     lambda x: F.interpolate(x, [4, 5], mode="bilinear", antialias=True), size=[4, 5], mode="linear",
     coordinate_mode="half_pixel", exclude_outside=True, antialias=True)
case("resize", "f64", [rand((1, 1, 3, 3), "f64")], lambda x: F.interpolate(x, [5, 4], mode="bilinear"), size=[5, 4],
     mode="linear", coordinate_mode="pytorch_half_pixel")
# tf_crop_and_resize: "x_original = start_x * (length_original - 1) + x_resized * (end_x - start_x) *
# (length_original - 1) / (length_resized - 1)", samples outside the input taking extrapolation_value. Against
# torch's grid_sample (align_corners=True reads the same corner-based coordinates) at points chosen to lie inside
# or over a pixel outside, where its zero padding gives the extrapolation value 0.


def crop_and_resize(x, rows, cols):
    """grid_sample at input rows/cols (pixel units) of x [N, C, H, W]; zero beyond the edges."""
    h, w = x.shape[2:]
    gy, gx = torch.meshgrid(torch.tensor(rows, dtype=x.dtype) / (h - 1) * 2 - 1,
                            torch.tensor(cols, dtype=x.dtype) / (w - 1) * 2 - 1, indexing="ij")
    grid = torch.stack([gx, gy], -1)[None].expand(x.shape[0], -1, -1, -1)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)


# rows: roi [-0.5, 1.5] of 4 over 5 outputs samples -2, 0, 2, 4, 6; cols: [0.1, 0.9] of 3 samples 0.3 ... 2.7
CROP = {"size": [5, 4], "mode": "linear", "coordinate_mode": "tf_crop_and_resize", "roi": [-0.5, 0.1, 1.5, 0.9]}
case("resize", "tf-crop-and-resize", [rand((2, 3, 5, 4))],
     lambda x: crop_and_resize(x, [-2.0, 0.0, 2.0, 4.0, 6.0], [0.3, 1.1, 1.9, 2.7]), **CROP)
case("resize", "tf-crop-and-resize-nearest", [rand((1, 2, 5, 4))],
     lambda x: crop_and_resize(x, [-2.0, 0.0, 2.0, 4.0, 6.0], [0.0, 1.0, 2.0, 3.0]), tol=EXACT,
     **{**CROP, "mode": "nearest", "roi": [-0.5, 0.0, 1.5, 1.0]})


def norm_oracle(kind: str, axes: Sequence[int], eps: float) -> Callable[..., torch.Tensor]:
    """torch's layer_norm / rms_norm over trailing axes; other axes spelled out with torch reductions."""
    def oracle(x: torch.Tensor, gamma: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> torch.Tensor:
        dims = sorted(a % x.ndim for a in axes)
        if dims == list(range(x.ndim - len(dims), x.ndim)):
            shape = [x.shape[d] for d in dims]
            if kind == "layer_norm":
                return F.layer_norm(x, shape, gamma, beta, eps)
            return F.rms_norm(x, shape, gamma, eps)
        view = [x.shape[d] if d in dims else 1 for d in range(x.ndim)]
        if kind == "layer_norm":
            y = (x - x.mean(dims, keepdim=True)) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
        else:
            y = x * torch.rsqrt((x * x).mean(dims, keepdim=True) + eps)
        y = y if gamma is None else y * gamma.reshape(view)
        return y if beta is None else y + beta.reshape(view)
    return oracle


for kind in ("layer_norm", "rms_norm"):
    affine = 3 if kind == "layer_norm" else 2
    for name, (shape, axes) in {"last": ((2, 3, 8), [-1]), "last-two": ((2, 3, 8), [1, 2]),
                                "middle": ((2, 5, 4), [1]), "first": ((6, 3), [0]), "rank1": ((7,), [-1]),
                                "all": ((2, 3, 4), [0, 1, 2])}.items():
        params = [rand([shape[a] for a in sorted(x % len(shape) for x in axes)]) for _ in range(affine - 1)]
        case(kind, name, [rand(shape)], norm_oracle(kind, axes, 1e-5), axes=axes)
        case(kind, f"{name}-affine", [rand(shape), *params], norm_oracle(kind, axes, 1e-5), axes=axes)
    case(kind, "eps", [rand((3, 4), "f32", -1e-3, 1e-3)], norm_oracle(kind, [-1], 0.1), eps=0.1)
    # a large offset over a small spread: torch and kiln both lose ~3e-3 to f32 conditioning here, while the
    # naive E[x^2] - E[x]^2 would lose everything
    case(kind, "large-offset", [rand((3, 16), "f32", 1e4, 1e4 + 1)], norm_oracle(kind, [-1], 1e-5), tol=(1e-2, 1e-2))
    for dt in ("f64", "f16", "bf16"):
        case(kind, dt, [rand((2, 3, 8), dt), *[rand((8,), dt) for _ in range(affine - 1)]],
             norm_oracle(kind, [-1], 1e-5))
    if kind == "layer_norm":
        case(kind, "gamma-only", [rand((2, 6)), rand((6,))], norm_oracle(kind, [-1], 1e-5))


def batch_norm_oracle(momentum: float, eps: float) -> Callable[..., tuple[torch.Tensor, ...]]:
    """torch's batch_norm; while training it updates the running stats in place, which kiln returns."""
    def oracle(x, gamma, beta, mean, var, training):
        mean, var = mean.clone(), var.clone()
        y = F.batch_norm(x, mean, var, gamma, beta, bool(training), momentum, eps)
        return y, mean, var
    return oracle


for name, shape in {"nc": (5, 3), "ncl": (2, 3, 4), "nchw": (2, 3, 4, 5)}.items():
    for training in (True, False):
        inputs = [rand(shape), rand((3,)), rand((3,)), rand((3,)), rand((3,), "f32", 0.5, 2), arr(training, "bool")]
        case("batch_norm", f"{name}-{'train' if training else 'eval'}", inputs, batch_norm_oracle(0.1, 1e-5))
case("batch_norm", "momentum-eps", [rand((4, 2, 3)), rand((2,)), rand((2,)), rand((2,)), rand((2,), "f32", 0.5, 2),
                                    arr(True, "bool")], batch_norm_oracle(0.7, 0.01), momentum=0.7, eps=0.01)
case("batch_norm", "momentum-1", [rand((4, 2)), rand((2,)), rand((2,)), rand((2,)), rand((2,), "f32", 0.5, 2),
                                  arr(True, "bool")], batch_norm_oracle(1.0, 1e-5), momentum=1.0)
case("batch_norm", "f64-train", [rand((3, 2, 5), "f64"), rand((2,), "f64"), rand((2,), "f64"), rand((2,), "f64"),
                                 rand((2,), "f64", 0.5, 2), arr(True, "bool")], batch_norm_oracle(0.1, 1e-5))

for dt in FLOATS:
    case("erf", dt, [rand((3, 4), dt)], torch.erf)
case("erf", "edge", [arr([0.0, -0.0, 1e-30, 3.0, -6.0, INF, -INF, NAN])], torch.erf)
case("erf", "scalar", [arr(0.3)], torch.erf)

# -- quant: Burn's symmetric quantization (random inputs hold no rounding ties, where torch.round differs) -------


def quant_oracle(lo: int, hi: int, block: int | None = None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scales) with scale = 2 * max|x| / (hi - lo) per tensor, or per `block` elements of the last dim."""
    def oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = x.reshape(-1, block) if block else x.reshape(1, -1)
        scale = 2 * blocks.abs().amax(1, keepdim=True) / (hi - lo)
        codes = torch.clamp(torch.round(blocks / scale), lo, hi).to(torch.int8).reshape(x.shape)
        return codes, scale.reshape(*x.shape[:-1], x.shape[-1] // block) if block else scale.reshape(1)
    return oracle


case("quantize", "q8s", [rand((4, 6))], quant_oracle(-127, 127), value="q8s")
case("quantize", "q8f-block", [rand((4, 6))], quant_oracle(-128, 127, 3), value="q8f", block=[3])
case("dequantize", "q8s", [rand((4, 6), "i8", -127, 128), rand((1,), "f32", 0.01, 0.1)], lambda c, s: c.float() * s,
     value="q8s")
case("dequantize", "q4f-block", [rand((4, 6), "i8", -8, 8), rand((4, 2), "f32", 0.01, 0.1)],
     lambda c, s: c.float() * s.repeat_interleave(3, 1), value="q4f", block=[3])

# -- sources: no operands ----------------------------------------------------------------------------------------

for name, value in {"f32": rand((2, 3)), "i64": arr([[1, -2**63]], "i64"), "bool": arr([True, False], "bool"),
                    "bf16-scalar": arr(0.1, "bf16"), "u8": arr([0, 255], "u8"), "f16": arr([65504.0, 1e-7], "f16"),
                    "empty": np.zeros((0, 2), np.float32)}.items():
    case("constant", name, [], lambda v=value: to_torch(v), tol=EXACT, value=value)
for kind, fn in {"zeros": torch.zeros, "ones": torch.ones}.items():
    case(kind, "default-f32", [], lambda fn=fn: fn((2, 3)), tol=EXACT, shape=[2, 3])
    case(kind, "scalar", [], lambda fn=fn: fn(()), tol=EXACT, shape=[])
    case(kind, "empty", [], lambda fn=fn: fn((0, 4)), tol=EXACT, shape=[0, 4])
    for dt in ("f64", "f16", "bf16", "i64", "i32", "u8", "bool"):
        case(kind, dt, [], lambda fn=fn, dt=dt: fn((3,), dtype=TORCH_DTYPE[dt]), tol=EXACT, shape=[3], dtype=dt)
for name, (value, dt) in {"f32": (2.5, "f32"), "f32-inf": (-INF, "f32"), "f32-nan": (NAN, "f32"),
                          "f32-rounds": (0.1, "f32"), "bf16-rounds": (0.1, "bf16"), "bf16-large": (3e38, "bf16"),
                          "f16-rounds": (1 / 3, "f16"), "f64": (1 / 3, "f64"), "i32": (-7, "i32"),
                          "i32-trunc": (-3.7, "i32"), "i64-large": (2**40, "i64"), "u8": (200, "u8"),
                          "bool-nonzero": (0.5, "bool"), "bool-zero": (0.0, "bool")}.items():
    case("full", name, [], lambda v=value, dt=dt: torch.full((2, 2), v, dtype=TORCH_DTYPE[dt]), tol=EXACT,
         shape=[2, 2], value=value, dtype=dt)


# ---------------------------------------------------------------------------------------------------------------
# the table's tests


def test_every_registered_op_has_a_torch_case() -> None:
    missing = sorted(set(kir.registered()) - {c.kind for c in CASES})
    assert not missing, f"ops with no torch case in {__file__}: {missing}"


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_op_matches_torch(c: Case) -> None:
    got = run_all(c.kind, c.inputs, c.attrs)
    with torch.no_grad():
        want = c.oracle(*(to_torch(a) for a in c.inputs))
    assert_all_match(got, want, c.tol)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_cast_rounding_is_bit_exact_with_torch(dtype: str) -> None:
    """f32 -> bf16/f16 rounds to nearest even like torch, bit for bit, over random bit patterns and exact ties."""
    random_bits = RNG.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    tie = np.arange(0, 2**31, 2**26, dtype=np.uint32)  # exponents across the range, low bits set below
    ties = np.concatenate([tie | 0x8000, tie | 0x18000, tie | 0x7FFF, tie | 0x8001, tie | 0x1000, tie | 0x3000])
    specials = np.array([0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x00008000, 0x00018000, 0x477FF000, 0x477FEFFF,
                         0x33800000, 0x33000001, 0x7F800000], np.uint32)
    bits = np.concatenate([random_bits, ties, ties | 0x80000000, specials, specials | 0x80000000])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    got = run_op("cast", [x], {"dtype": dtype})
    want = to_torch(x).to(TORCH_DTYPE[dtype])
    np.testing.assert_array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
    nan = run_op("cast", [arr([NAN, -NAN])], {"dtype": dtype})
    assert np.isnan(nan.astype(np.float32)).all()


def test_integer_division_by_zero_gives_zero() -> None:
    """kiln's documented choice (torch raises instead): x / 0 is 0 for integer dtypes, whatever x is."""
    for dt in ("i32", "i64", "u8"):
        a = arr([5, 0, 7, 100], dt) if dt == "u8" else arr([5, -5, 0, np.iinfo(DType(dt).numpy).min], dt)
        b = np.zeros(4, DType(dt).numpy)
        np.testing.assert_array_equal(run_op("div", [a, b]), np.zeros(4, DType(dt).numpy))
    got = run_op("div", [arr([7, -7, 7], "i32"), arr([0, 2, -2], "i32")])
    np.testing.assert_array_equal(got, [0, -3, -3])


def test_python_literal_operands_take_the_other_operands_dtype() -> None:
    for dt in ("f16", "i32", "bf16"):
        b = Builder("M")
        x = b.input("x", ((2, 3), dt))
        b.ret(b.mul(b.add(x, 2), 3))
        xv = rand((2, 3), dt, -5, 5)
        (got,) = interpret(b.build(), [xv])
        assert_matches(got, (to_torch(xv) + 2) * 3)


# ---------------------------------------------------------------------------------------------------------------
# dropout's stochastic semantics


def run_dropout(x: np.ndarray, training: bool, run_seed: int = 0, **attrs: Any) -> np.ndarray:
    return run_op("dropout", [x, arr(training, "bool")], attrs, seed=run_seed)


def test_dropout_identity_when_not_training_or_p_is_zero() -> None:
    x = rand((16, 16))
    np.testing.assert_array_equal(run_dropout(x, False, 3, p=0.7), x)
    np.testing.assert_array_equal(run_dropout(x, True, 3, p=0.0), x)


@pytest.mark.parametrize("dtype, p", [("f32", 0.3), ("f64", 0.5), ("f16", 0.1), ("bf16", 0.25)])
def test_dropout_zeroes_or_scales_and_keeps_about_1_minus_p(dtype: str, p: float) -> None:
    x = rand((128, 64), dtype, 0.5, 2.0)  # no zeros in x, so a zero in the output is a dropped element
    got = run_dropout(x, True, 11, p=p)
    assert got.dtype == x.dtype and got.shape == x.shape
    kept = got != 0
    t = to_torch(x)
    scaled = to_numpy((t.float() / (1 - p)).to(t.dtype) if dtype in ("f16", "bf16") else t / (1 - p))
    rtol, atol = TOL[np.dtype(x.dtype)]
    np.testing.assert_allclose(got[kept].astype(np.float64), scaled[kept].astype(np.float64), rtol=rtol, atol=atol)
    frac = kept.mean()
    assert abs(frac - (1 - p)) < 0.03, f"kept fraction {frac} for p = {p}"


def test_dropout_is_reproducible_per_seed() -> None:
    x = rand((32, 32), "f32", 1.0, 2.0)
    a = run_dropout(x, True, 5, p=0.5)
    np.testing.assert_array_equal(a, run_dropout(x, True, 5, p=0.5))
    assert not np.array_equal(a != 0, run_dropout(x, True, 6, p=0.5) != 0)  # another run seed
    assert not np.array_equal(a != 0, run_dropout(x, True, 5, p=0.5, seed=1) != 0)  # the op's own seed
    np.testing.assert_array_equal(run_dropout(x, True, 6, p=0.5, seed=1), run_dropout(x, True, 6, p=0.5, seed=1))


def test_dropout_training_flag_can_be_a_graph_flag() -> None:
    x = rand((8, 8), "f32", 1.0, 2.0)
    for value in (True, False):
        b = Builder("M")
        xv = b.input("x", ((8, 8), "f32"))
        b.ret(b.dropout(xv, b.flag("training", value), p=0.5))
        (got,) = interpret(b.build(), [x], seed=1)
        assert (got == x).all() != value


# ---------------------------------------------------------------------------------------------------------------
# dynamic dims: each family built with a `?` dim and run at two sizes


@dataclass(frozen=True)
class Dyn:
    family: str
    kind: str
    types: tuple[tuple[tuple[int | None, ...], str], ...]
    inputs: Callable[[int], list[np.ndarray]]
    oracle: Callable[..., torch.Tensor]
    result: tuple[int | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    tol: tuple[float, float] | None = None


DYNAMIC = [
    Dyn("elementwise", "exp", (((None, 3), "f32"),), lambda n: [rand((n, 3))], torch.exp, (None, 3)),
    Dyn("elementwise", "add", (((None, 1), "f32"), ((1, 4), "f32")), lambda n: [rand((n, 1)), rand((1, 4))],
        torch.add, (None, 4)),
    Dyn("elementwise", "less", (((None,), "i32"), ((), "i32")), lambda n: [rand((n,), "i32", -9, 9), arr(0, "i32")],
        torch.lt, (None,)),
    Dyn("elementwise", "where", (((None, 1), "bool"), ((None, 3), "f32"), ((3,), "f32")),
        lambda n: [rand((n, 1), "bool"), rand((n, 3)), rand((3,))], torch.where, (None, 3)),
    Dyn("elementwise", "cast", (((2, None), "f32"),), lambda n: [rand((2, n))], lambda x: x.to(torch.int32),
        (2, None), {"dtype": "i32"}),
    Dyn("reduction", "sum", (((None, 4), "f32"),), lambda n: [rand((n, 4))], lambda x: x.sum(0), (4,), {"axes": [0]}),
    Dyn("reduction", "mean", (((None, 4), "f32"),), lambda n: [rand((n, 4))], lambda x: x.mean(-1, keepdim=True),
        (None, 1), {"axes": [-1], "keepdims": True}),
    Dyn("reduction", "max", (((3, None), "i64"),), lambda n: [rand((3, n), "i64", -9, 9)], lambda x: x.amax(),
        ()),
    Dyn("reduction", "softmax", (((None, 4), "f32"),), lambda n: [rand((n, 4))], lambda x: torch.softmax(x, 0),
        (None, 4), {"axis": 0}),
    Dyn("elementwise", "logical_xor", (((None, 1), "bool"), ((3,), "bool")),
        lambda n: [rand((n, 1), "bool"), rand((3,), "bool")], torch.logical_xor, (None, 3)),
    Dyn("reduction", "argmax", (((None, 4), "f32"),), lambda n: [rand((n, 4))], lambda x: x.argmax(1), (None,),
        {"axis": 1}),
    Dyn("reduction", "topk", (((None, 5), "f32"),), lambda n: [rand((n, 5))], lambda x: tuple(torch.topk(x, 2)),
        (None, 2), {"k": 2}),
    Dyn("reduction", "cumsum", (((None, 3), "f32"),), lambda n: [rand((n, 3))], lambda x: x.cumsum(0), (None, 3)),
    Dyn("shape", "tile", (((None, 2), "f32"),), lambda n: [rand((n, 2))], lambda x: x.repeat(2, 3), (None, 6),
        {"repeats": [2, 3]}),
    Dyn("shape", "scatter_nd", (((4, 2), "f32"), ((None, 1), "i64"), ((None, 2), "f32")),
        lambda n: [rand((4, 2)), np.arange(n, dtype=np.int64).reshape(n, 1) % 4, rand((n, 2))],
        lambda d, i, u: scatter_nd_oracle(d, i.numpy(), u), (4, 2)),
    Dyn("linalg", "matmul", (((None, 4), "f32"), ((4, 3), "f32")), lambda n: [rand((n, 4)), rand((4, 3))],
        torch.matmul, (None, 3)),
    Dyn("linalg", "matmul", (((None, 2, 4), "f32"), ((4, None), "f32")), lambda n: [rand((n, 2, 4)), rand((4, n))],
        torch.matmul, (None, 2, None)),
    Dyn("linalg", "linear", (((None, 4), "f32"), ((4, 3), "f32"), ((3,), "f32")),
        lambda n: [rand((n, 4)), rand((4, 3)), rand((3,))], lambda x, w, b: F.linear(x, w.T, b), (None, 3)),
    Dyn("linalg", "lora", (((None, 5), "f32"), ((None, 2), "f32"), ((2, 5), "f32")),
        lambda n: [rand((n, 5)), rand((n, 2)), rand((2, 5))], lambda w, a, b: w + 0.5 * (a @ b), (None, 5),
        {"scale": 0.5}),
    Dyn("linalg", "dora", (((None, 5), "f32"), ((None, 2), "f32"), ((2, 5), "f32"), ((5,), "f32")),
        lambda n: [rand((n, 5)), rand((n, 2)), rand((2, 5)), rand((5,))], dora_oracle(0.5), (None, 5),
        {"scale": 0.5}),
    Dyn("random", "dropout", (((None, 8), "f32"), ((), "bool")), lambda n: [rand((n, 8)), arr(False, "bool")],
        lambda x, t: x, (None, 8)),
    Dyn("nn", "conv2d", (((None, 2, 5, 5), "f32"), ((3, 2, 3, 3), "f32"), ((3,), "f32")),
        lambda n: [rand((n, 2, 5, 5)), rand((3, 2, 3, 3)), rand((3,))], lambda x, w, b: F.conv2d(x, w, b, padding=1),
        (None, 3, 5, 5), {"padding": [1, 1]}),
    Dyn("nn", "conv1d", (((1, 2, None), "f32"), ((3, 2, 3), "f32")), lambda n: [rand((1, 2, n + 2)), rand((3, 2, 3))],
        F.conv1d, (1, 3, None)),
    Dyn("nn", "max_pool2d", (((2, 1, None, None), "f32"),), lambda n: [rand((2, 1, 2 * n, n + 1))],
        lambda x: F.max_pool2d(x, 2), (2, 1, None, None), {"kernel": [2, 2]}),
    Dyn("nn", "avg_pool2d", (((None, 1, 6, 6), "f32"),), lambda n: [rand((n, 1, 6, 6))],
        lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), (None, 1, 3, 3),
        {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "count_include_pad": False}),
    Dyn("nn", "adaptive_avg_pool2d", (((1, 2, None, None), "f32"),), lambda n: [rand((1, 2, n + 1, 2 * n))],
        lambda x: F.adaptive_avg_pool2d(x, [2, 3]), (1, 2, 2, 3), {"output_size": [2, 3]}),
    Dyn("nn", "layer_norm", (((None, 4), "f32"), ((4,), "f32"), ((4,), "f32")),
        lambda n: [rand((n, 4)), rand((4,)), rand((4,))], lambda x, g, b: F.layer_norm(x, [4], g, b), (None, 4)),
    Dyn("nn", "rms_norm", (((2, None), "f32"),), lambda n: [rand((2, n))],
        lambda x: F.rms_norm(x, [x.shape[-1]], eps=1e-5), (2, None)),
    Dyn("nn", "batch_norm", (((None, 3), "f32"), ((3,), "f32"), ((3,), "f32"), ((3,), "f32"), ((3,), "f32"),
                             ((), "bool")),
        lambda n: [rand((n, 3)), rand((3,)), rand((3,)), rand((3,)), rand((3,), "f32", 0.5, 2), arr(True, "bool")],
        batch_norm_oracle(0.1, 1e-5), (None, 3), tol=(1e-4, 1e-5)),  # n = 2 training is ill-conditioned
    Dyn("nn", "erf", (((None,), "f32"),), lambda n: [rand((n,))], torch.erf, (None,)),
    Dyn("shape", "transpose", (((None, 3), "f32"),), lambda n: [rand((n, 3))], lambda x: x.T, (3, None)),
    Dyn("collective", "all_reduce", (((None, 3), "f32"),), lambda n: [rand((n, 3))], lambda x: x, (None, 3)),
    Dyn("shape", "reshape", (((None, 6), "f32"),), lambda n: [rand((n, 6))], lambda x: x.reshape(-1, 3), (None, 3),
        {"shape": [-1, 3]}),
    Dyn("shape", "broadcast_to", (((None, 1), "f32"),), lambda n: [rand((n, 1))], lambda x: x.expand(2, -1, 4),
        (2, None, 4), {"shape": [2, -1, 4]}),
    Dyn("shape", "concat", (((None, 3), "f32"), ((2, 3), "f32")), lambda n: [rand((n, 3)), rand((2, 3))],
        lambda *xs: torch.cat(xs), (None, 3)),
    Dyn("shape", "concat", (((None, 2), "f32"), ((None, 3), "f32")), lambda n: [rand((n, 2)), rand((n, 3))],
        lambda *xs: torch.cat(xs, 1), (None, 5), {"axis": 1}),
    Dyn("shape", "slice", (((None, 3), "f32"),), lambda n: [rand((n, 3))], lambda x: x[1:-1, ::2], (None, 2),
        {"starts": [1, 0], "ends": [-1, 3], "steps": [1, 2]}),
    Dyn("shape", "take", (((5, 3), "f32"), ((None,), "i64")), lambda n: [rand((5, 3)), rand((n,), "i64", 0, 5)],
        lambda x, i: x[i], (None, 3)),
    Dyn("shape", "gather", (((None, 4), "f32"), ((None, 2), "i64")),
        lambda n: [rand((n, 4)), rand((n, 2), "i64", 0, 4)], lambda x, i: torch.gather(x, 1, i), (None, 2),
        {"axis": 1}),
    Dyn("spatial", "pad", (((None, 3, 4), "f32"),), lambda n: [rand((n, 3, 4))],
        lambda x: F.pad(x, [1, 2, -1, 0], "constant", 0.0), (None, 2, 7), {"before": [0, -1, 1], "after": [0, 0, 2]}),
    Dyn("spatial", "resize", (((None, 2, 3, 3), "f32"),), lambda n: [rand((n, 2, 3, 3))],
        lambda x: F.interpolate(x, [6, 5], mode="bilinear"), (None, 2, 6, 5),
        {"size": [6, 5], "mode": "linear", "coordinate_mode": "pytorch_half_pixel"}),
    Dyn("nn", "conv_transpose2d", (((None, 2, 3, 3), "f32"), ((2, 3, 2, 2), "f32")),
        lambda n: [rand((n, 2, 3, 3)), rand((2, 3, 2, 2))], lambda x, w: F.conv_transpose2d(x, w, stride=2),
        (None, 3, 6, 6), {"stride": [2, 2]}),
    Dyn("quant", "dequantize", (((None, 4), "i8"), ((None, 2), "f32")),
        lambda n: [rand((n, 4), "i8", -127, 128), rand((n, 2), "f32", 0.01, 0.1)],
        lambda c, s: c.float() * s.repeat_interleave(2, 1), (None, 4), {"value": "q8s", "block": [2]}),
]


def families() -> set[str]:
    return {opdef.infer.__module__.rsplit(".", 1)[-1] for opdef in kir.registered().values()}


def test_every_family_with_operands_has_a_dynamic_case() -> None:
    assert families() - {d.family for d in DYNAMIC} == {"source"}  # source ops have no operands (see below)


@pytest.mark.parametrize("d", DYNAMIC, ids=lambda d: f"{d.family}-{d.kind}-{len(d.result)}d")
def test_dynamic_dims_run_at_two_sizes(d: Dyn) -> None:
    graph = build_op(d.kind, d.types, d.attrs)
    assert graph.functions["forward"].results[0].type.shape == d.result
    for n in (2, 5):
        inputs = d.inputs(n)
        got = interpret(graph, inputs)
        assert_all_match(got, d.oracle(*(to_torch(a) for a in inputs)), EXACT if d.family == "shape" else d.tol)


def test_source_ops_feed_dynamic_graphs() -> None:
    """zeros/ones/full/constant are static by construction; they broadcast into a graph with a `?` batch."""
    b = Builder("M")
    x = b.input("x", ((None, 4), "f32"))
    y = b.add(b.mul(x, b.full(shape=[1, 4], value=2.0)), b.add(b.ones(shape=[4]), b.zeros(shape=[1, 1])))
    b.ret(b.sub(y, b.constant(np.float32(0.5))))
    graph = b.build()
    assert graph.functions["forward"].results[0].type.shape == (None, 4)
    for n in (1, 3):
        xv = rand((n, 4))
        (got,) = interpret(graph, [xv])
        assert_matches(got, to_torch(xv) * 2 + 1 - 0.5)


# ---------------------------------------------------------------------------------------------------------------
# type inference errors


@dataclass(frozen=True)
class Bad:
    name: str
    kind: str
    types: tuple[tuple[tuple[int | None, ...], str], ...]
    match: str
    attrs: dict[str, Any] = field(default_factory=dict)


F23 = ((2, 3), "f32")
BAD = [
    Bad("all-reduce-int", "all_reduce", (((2,), "i64"),), r"^all_reduce: operand 0 has dtype i64, expected a floating"),
    Bad("all-reduce-bucket-dtypes", "all_reduce", (F23, ((2,), "f64")),
        r"^all_reduce: operand 1 has dtype f64 but operand 0 has f32"),
    Bad("all-reduce-op", "all_reduce", (F23,), r"all_reduce.*op.*expected one of 'mean', 'sum'", {"op": "max"}),
    Bad("broadcast-bucket-dtypes", "broadcast", (F23, ((2,), "f16")),
        r"^broadcast: operand 1 has dtype f16 but operand 0 has f32"),
    Bad("broadcast-src", "broadcast", (F23,), r"broadcast.*src.*expected a rank >= 0", {"src": -1}),
    Bad("dtype-mismatch", "add", (F23, ((2, 3), "i32")), r"^add: operand 1 has dtype i32 but operand 0 has f32"),
    Bad("dtype-mismatch-f16", "maximum", (((3,), "f16"), ((3,), "bf16")), r"^maximum: operand 1 has dtype bf16"),
    Bad("no-broadcast", "mul", (F23, ((4,), "f32")), r"^mul: shapes \[2, 3\] and \[4\] do not broadcast"),
    Bad("no-broadcast-lead", "sub", (((2, 3, 4), "f32"), ((3, 3, 4), "f32")), r"^sub: shapes .* do not broadcast"),
    Bad("where-cond-dtype", "where", (F23, F23, F23), r"^where: operand 0 \(cond\) has dtype f32, expected bool"),
    Bad("where-branch-dtypes", "where", (((2, 3), "bool"), F23, ((2, 3), "f64")), r"^where: operand 1 has dtype f64"),
    Bad("where-no-broadcast", "where", (((2,), "bool"), F23, F23), r"^where: shapes .* do not broadcast"),
    Bad("compare-packed", "equal", (((2,), "i4"), ((2,), "i4")), r"^equal: operand 0 has packed dtype i4"),
    Bad("neg-bool", "neg", (((2,), "bool"),), r"^neg: operand 0 has dtype bool, expected a numeric dtype"),
    Bad("exp-int", "exp", (((2,), "i32"),), r"^exp: operand 0 has dtype i32, expected a floating dtype"),
    Bad("gelu-int", "gelu", (((2,), "i64"),), r"^gelu: operand 0 has dtype i64, expected a floating"),
    Bad("pow-int", "pow", (((2,), "i32"), ((2,), "i32")), r"^pow: operand 0 has dtype i32, expected a floating"),
    Bad("mean-int", "mean", (((2,), "i32"),), r"^mean: operand 0 has dtype i32, expected a floating"),
    Bad("softmax-int", "softmax", (((2,), "u8"),), r"^softmax: operand 0 has dtype u8, expected a floating"),
    Bad("cast-packed", "cast", (((2,), "nf4"),), r"^cast: operand 0 has packed dtype nf4", {"dtype": "f32"}),
    Bad("cast-bad-dtype", "cast", (F23,), r"^cast: attribute 'dtype' = 'float32': expected a dtype",
        {"dtype": "float32"}),
    Bad("sum-axis", "sum", (F23,), r"^sum: axis 2 is out of range for rank 2", {"axes": [2]}),
    Bad("max-neg-axis", "max", (F23,), r"^max: axis -3 is out of range for rank 2", {"axes": [-3]}),
    Bad("min-repeated-axis", "min", (F23,), r"^min: repeated axis in \(1, -1\)", {"axes": [1, -1]}),
    Bad("softmax-axis", "log_softmax", (F23,), r"^log_softmax: axis 2 is out of range", {"axis": 2}),
    Bad("keepdims-not-bool", "sum", (F23,), r"^sum: attribute 'keepdims' = 1: expected true or false",
        {"keepdims": 1}),
    Bad("bad-perm-repeat", "transpose", (F23,), r"^transpose: perm \[0, 0\] is not a permutation of rank 2",
        {"perm": [0, 0]}),
    Bad("bad-perm-rank", "transpose", (F23,), r"^transpose: perm \[1, 0, 2\] is not a permutation",
        {"perm": [1, 0, 2]}),
    Bad("reshape-count", "reshape", (F23,), r"^reshape: tensor<2x3xf32> has 6 elements but shape \[4, 2\] has 8",
        {"shape": [4, 2]}),
    Bad("reshape-infer", "reshape", (F23,), r"^reshape: cannot reshape tensor<2x3xf32> to \[4, -1\]",
        {"shape": [4, -1]}),
    Bad("reshape-two-infer", "reshape", (F23,), r"^reshape: shape \[-1, -1\] may hold one -1", {"shape": [-1, -1]}),
    Bad("broadcast-rank", "broadcast_to", (F23,), r"^broadcast_to: target rank 1 is below input rank 2",
        {"shape": [3]}),
    Bad("broadcast-dim", "broadcast_to", (F23,), r"^broadcast_to: input tensor<2x3xf32> cannot broadcast to \[2, 4\]",
        {"shape": [2, 4]}),
    Bad("broadcast-shrink", "broadcast_to", (((4,), "f32"),), r"^broadcast_to: input tensor<4xf32> cannot broadcast",
        {"shape": [1]}),
    Bad("broadcast-lead-shrink", "broadcast_to", (F23,), r"^broadcast_to: input tensor<2x3xf32> cannot broadcast",
        {"shape": [4, 1, 3]}),
    Bad("concat-dims", "concat", (F23, ((3, 3), "f32")), r"^concat: operands differ in dim 0", {"axis": 1}),
    Bad("concat-rank", "concat", (F23, ((3,), "f32")), r"^concat: operand 1 has rank 1 but operand 0 has 2"),
    Bad("concat-dtype", "concat", (F23, ((2, 3), "i64")), r"^concat: operand 1 has dtype i64"),
    Bad("concat-axis", "concat", (F23, F23), r"^concat: axis 2 is out of range for rank 2", {"axis": 2}),
    Bad("slice-step0", "slice", (F23,), r"^slice: a step of 0 is not allowed",
        {"starts": [0], "ends": [2], "steps": [0]}),
    Bad("slice-lengths", "slice", (F23,), r"^slice: starts, ends, axes and steps must have the same length",
        {"starts": [0, 1], "ends": [2]}),
    Bad("slice-axis", "slice", (F23,), r"^slice: axis 5 is out of range", {"starts": [0], "ends": [1], "axes": [5]}),
    Bad("matmul-contract", "matmul", (F23, ((4, 5), "f32")), r"^matmul: contracted dims of operand 0 \[2, 3\] and "
        r"operand 1 \[4, 5\] differ \(3 vs 4\)"),
    Bad("matmul-1d-contract", "matmul", (((3,), "f32"), ((4,), "f32")), r"^matmul: contracted dims .* \(3 vs 4\)"),
    Bad("matmul-batch", "matmul", (((2, 3, 4), "f32"), ((3, 4, 5), "f32")), r"^matmul batch dims: shapes"),
    Bad("matmul-scalar", "matmul", (((), "f32"), F23), r"^matmul: operand 0 is a scalar"),
    Bad("matmul-dtype", "matmul", (F23, ((3, 2), "f16")), r"^matmul: operand 1 has dtype f16"),
    Bad("matmul-bool", "matmul", (((2, 2), "bool"), ((2, 2), "bool")), r"^matmul: operand 0 has dtype bool"),
    Bad("linear-weight-rank", "linear", (F23, ((3, 4, 5), "f32")),
        r"^linear: operand 1 \(weight\) must be \[in, out\]"),
    Bad("linear-contract", "linear", (F23, ((4, 5), "f32")), r"^linear: contracted dims"),
    Bad("linear-bias-len", "linear", (F23, ((3, 5), "f32"), ((4,), "f32")),
        r"^linear: bias length and out features differ \(4 vs 5\)"),
    Bad("linear-bias-rank", "linear", (F23, ((3, 5), "f32"), ((1, 5), "f32")), r"^linear: operand 2 \(bias\) must be"),
    Bad("linear-bias-dtype", "linear", (F23, ((3, 5), "f32"), ((5,), "f64")), r"^linear: operand 2 has dtype f64"),
    Bad("lora-shape", "lora", (((4, 5), "f32"), ((4, 2), "f32"), ((2, 6), "f32")),
        r"^lora base and a @ b: shapes \[4, 5\] and \[4, 6\] do not broadcast", {"scale": 1.0}),
    Bad("lora-shape-bcast", "lora", (((4, 5), "f32"), ((1, 2), "f32"), ((2, 5), "f32")),
        r"^lora: a @ b has shape \[1, 5\] but base is \[4, 5\]", {"scale": 1.0}),
    Bad("lora-contract", "lora", (((4, 5), "f32"), ((4, 2), "f32"), ((3, 5), "f32")), r"^lora: contracted dims",
        {"scale": 1.0}),
    Bad("lora-rank", "lora", (((4, 5), "f32"), ((2,), "f32"), ((2, 5), "f32")), r"^lora: base, a and b must be 2-D",
        {"scale": 1.0}),
    Bad("dora-magnitude-shape", "dora", (((4, 5), "f32"), ((4, 2), "f32"), ((2, 5), "f32"), ((1, 5), "f32")),
        r"^dora: magnitude must be \[5\] \(one per output column of base .*\), got tensor<1x5xf32>$",
        {"scale": 1.0}),
    Bad("dora-magnitude-dtype", "dora", (((4, 5), "f32"), ((4, 2), "f32"), ((2, 5), "f32"), ((5,), "f64")),
        r"^dora: ", {"scale": 1.0}),
    Bad("dora-factor-shape", "dora", (((4, 5), "f32"), ((4, 2), "f32"), ((2, 6), "f32"), ((5,), "f32")),
        r"^dora base and a @ b: shapes", {"scale": 1.0}),
    Bad("lora-no-scale", "lora", (((4, 5), "f32"), ((4, 2), "f32"), ((2, 5), "f32")),
        r"^lora: missing attribute 'scale'"),
    Bad("unknown-attr", "add", (F23, F23), r"^add: unknown attribute 'alpha' \(expected none\)", {"alpha": 1.0}),
    Bad("unknown-attr-schema", "softmax", (F23,), r"^softmax: unknown attribute 'dim' \(expected \['axis'\]\)",
        {"dim": 1}),
    Bad("missing-attr", "reshape", (F23,), r"^reshape: missing attribute 'shape'"),
    Bad("missing-attr-cast", "cast", (F23,), r"^cast: missing attribute 'dtype'"),
    Bad("bad-attr-choice", "gelu", (F23,), r"^gelu: attribute 'approximate' = 'fast': expected one of",
        {"approximate": "fast"}),
    Bad("bad-attr-type", "leaky_relu", (F23,), r"^leaky_relu: attribute 'alpha' = 'x': expected a number",
        {"alpha": "x"}),
    Bad("too-many-operands", "add", (F23, F23, F23), r"^add: takes operands \(lhs, rhs\) but got 3"),
    Bad("too-few-operands", "where", (((2, 3), "bool"), F23), r"^where: takes operands \(cond, lhs, rhs\) but got 2"),
    Bad("unary-two-operands", "exp", (F23, F23), r"^exp: takes operands \(x\) but got 2"),
    Bad("linear-four-operands", "linear", (F23, ((3, 5), "f32"), ((5,), "f32"), ((5,), "f32")),
        r"^linear: takes operands \(x, weight, bias\?\) but got 4"),
    Bad("concat-none", "concat", (), r"^concat: takes operands \(xs\*\) but got 0"),
    Bad("zeros-operand", "zeros", (F23,), r"^zeros: takes operands \(\) but got 1", {"shape": [2]}),
    Bad("zeros-negative", "zeros", (), r"^zeros: negative dim in shape \[2, -1\]", {"shape": [2, -1]}),
    Bad("full-no-value", "full", (), r"^full: missing attribute 'value'", {"shape": [2]}),
    Bad("take-float-indices", "take", (F23, ((2,), "f32")),
        r"^take: operand 1 \(indices\) has dtype f32, expected i64"),
    Bad("take-u8-indices", "take", (F23, ((2,), "u8")), r"^take: operand 1 \(indices\) has dtype u8"),
    Bad("take-axis", "take", (F23, ((2,), "i64")), r"^take: axis 2 is out of range", {"axis": 2}),
    Bad("gather-float-indices", "gather", (F23, F23), r"^gather: operand 1 \(indices\) has dtype f32"),
    Bad("gather-rank", "gather", (F23, ((2,), "i64")), r"^gather: indices rank 1 differs from input rank 2"),
    Bad("gather-dim", "gather", (F23, ((3, 3), "i64")), r"^gather: operand 1 \(indices\) has dim 0 = 3 but input has 2",
        {"axis": 1}),
    Bad("dropout-flag-dtype", "dropout", (F23, ((), "f32")), r"^dropout: operand 1 \(training flag\) must be a bool "
        r"scalar, got tensor<f32>"),
    Bad("dropout-flag-rank", "dropout", (F23, ((1,), "bool")), r"^dropout: operand 1 \(training flag\) must be a bool"),
    Bad("dropout-int", "dropout", (((2,), "i32"), ((), "bool")), r"^dropout: operand 0 has dtype i32"),
    Bad("dropout-p", "dropout", (F23, ((), "bool")), r"^dropout: p = 1.0 is outside \[0, 1\)", {"p": 1.0}),
    Bad("dropout-missing-flag", "dropout", (F23,), r"^dropout: takes operands \(x, training\) but got 1"),
    Bad("floor-int", "floor", (((2,), "i32"),), r"^floor: operand 0 has dtype i32, expected a floating dtype"),
    Bad("logical-not-float", "logical_not", (F23,), r"^logical_not: operand 0 has dtype f32, expected bool"),
    Bad("logical-and-int", "logical_and", (((2,), "bool"), ((2,), "i32")),
        r"^logical_and: operand 1 has dtype i32, expected bool"),
    Bad("prod-bool", "prod", (((2,), "bool"),), r"^prod: operand 0 has dtype bool, expected a numeric dtype"),
    Bad("argmax-axis", "argmax", (F23,), r"^argmax: axis 2 is out of range for rank 2", {"axis": 2}),
    Bad("topk-k", "topk", (F23,), r"^topk: k = 4 is outside \[0, 3\] \(the length of axis 1 of tensor<2x3xf32>\)",
        {"k": 4}),
    Bad("topk-no-k", "topk", (F23,), r"^topk: missing attribute 'k'"),
    Bad("cumsum-axis", "cumsum", (F23,), r"^cumsum: axis -3 is out of range", {"axis": -3}),
    Bad("tile-repeats", "tile", (F23,), r"^tile: repeats \[2\] must hold one count >= 0 per dim of tensor<2x3xf32>",
        {"repeats": [2]}),
    Bad("tile-negative", "tile", (F23,), r"^tile: repeats \[1, -1\] must hold", {"repeats": [1, -1]}),
    Bad("scatter-nd-deep", "scatter_nd", (F23, ((1, 3), "i64"), ((1,), "f32")),
        r"^scatter_nd: operand 1 \(indices\) tensor<1x3xi64> needs a static last dim of at most the rank"),
    Bad("scatter-nd-updates", "scatter_nd", (F23, ((4, 1), "i64"), ((4, 2), "f32")),
        r"^scatter_nd: operand 2 \(updates\) is tensor<4x2xf32> but indices .* need shape \[4, 3\]"),
    Bad("scatter-nd-float-indices", "scatter_nd", (F23, ((1, 1), "f32"), ((1, 3), "f32")),
        r"^scatter_nd: operand 1 \(indices\) has dtype f32"),
    Bad("scatter-nd-dtype", "scatter_nd", (F23, ((1, 1), "i64"), ((1, 3), "f64")),
        r"^scatter_nd: operand 2 \(updates\) has dtype f64 but data has f32"),
    Bad("resize-crop-no-roi", "resize", (((1, 1, 3, 3), "f32"),), r"^resize: coordinate_mode tf_crop_and_resize "
        r"takes roi = None \(tf_crop_and_resize needs 4 numbers",
        {"size": [2, 2], "coordinate_mode": "tf_crop_and_resize"}),
    Bad("resize-roi-length", "resize", (((1, 1, 3, 3), "f32"),), r"^resize: coordinate_mode tf_crop_and_resize "
        r"takes roi = \(0.0, 1.0\)", {"size": [2, 2], "coordinate_mode": "tf_crop_and_resize", "roi": [0.0, 1.0]}),
    Bad("resize-roi-elsewhere", "resize", (((1, 1, 3, 3), "f32"),), r"^resize: coordinate_mode half_pixel takes roi",
        {"size": [2, 2], "roi": [0.0, 0.0, 1.0, 1.0]}),
    Bad("unknown-op", "frobnicate", (F23,), r"^unknown op 'frobnicate'"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda bad: bad.name)
def test_bad_builds_raise_shape_errors_naming_the_op(bad: Bad) -> None:
    with pytest.raises(ShapeError, match=bad.match):
        build_op(bad.kind, bad.types, bad.attrs)

