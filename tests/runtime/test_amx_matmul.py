"""bf16 matmuls on AMX tiles (issue 13, bf16 through AMX-BF16): numbers against float64 numpy within
docs/precision.md's bf16 bound where the host has AMX-BF16; on every x86 host, cross-builds show that a Sapphire
Rapids build runs `tdpbf16ps` and that CPUs without AMX (Zen 3, Zen 4) never get a tile instruction."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from test_precision import bf16_bound  # the documented bound, one place
from tvm import te, tirx
from tvm.target import Target

from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.activation_products import bf16_activation_products
from kiln.runtime.tvm.amx import KERNEL_NAME, _packed_pairs, has_tiles, runs_tiles, tile_kernel
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile
from kiln.runtime.tvm.target import cpu_target

SAPPHIRE = Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
NO_AMX = {"znver3": Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2}),  # AVX2 only
          "znver4": Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})}  # AVX512-BF16, no tiles
TILE_OPS = re.compile(r"\b(ldtilecfg|tileloadd|tdpbf16ps|tilestored|tilezero|tilerelease)\b")
HOST_TILES = has_tiles(cpu_target())
needs_tiles = pytest.mark.skipif(not HOST_TILES, reason="the host CPU has no AMX-BF16: the tile kernel cannot run")

pytestmark = pytest.mark.usefixtures("module_cache")


def linear_graph(w: np.ndarray, rows: int | None, bias: bool) -> Graph:
    """x [rows, K] @ W (+ b), W bound; `rows` None is a symbolic batch."""
    b = Builder("amx")
    x = b.input("x", ((rows, w.shape[0]), "f32"))
    weight = b.param("w", w.shape, data=w)
    b.ret(b.linear(x, weight, b.param("b", (w.shape[1],), data=np.linspace(-1, 1, w.shape[1], dtype=np.float32)))
          if bias else b.matmul(x, weight))
    return verify(b.build())


def kernel_names(graph: Graph, target: Target) -> list[str]:
    """The names of the functions a bf16 lowering of `graph` for `target` has (its kernels among them), sorted, after
    the pipeline's pass computing the products of two activations the lowering leaves in f32 (attention fusion's)."""
    module = bf16_activation_products(target)(lower(graph, "bound", None, "bf16", target).module)
    return sorted(gv.name_hint for gv in module.get_global_vars())


def _weight(k: int, n: int) -> np.ndarray:
    return np.random.default_rng(k * n).standard_normal((k, n)).astype(np.float32)


def _check(program, w: np.ndarray, rows: int, bias: np.ndarray | None = None) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, w.shape[0])).astype(np.float32)
    exact = x.astype(np.float64) @ w + (0.0 if bias is None else bias)
    err = np.abs(np.asarray(program(x)) - exact)
    assert np.all(err <= bf16_bound(x.astype(np.float64), w.astype(np.float64)))
    assert err.max() > 2.0 ** -16 * (np.abs(x) @ np.abs(w)).max()  # bf16's error: not an f32 build


@needs_tiles
@pytest.mark.parametrize(("k", "n"), [(64, 1000), (77, 77), (1000, 64), (1000, 77)])
def test_tiles_are_within_the_bf16_bound_at_any_batch(k: int, n: int) -> None:
    """A symbolic batch (rows padded to whole 32s) at M = 1, 7, 65, 128 and 600, K and N not multiples of 32 (65
    rows: three row blocks, so a panel split across two cores leaves its last task one block short; 600 rows of
    K = 1000 are more than half an L2 of 2 MiB or less holds, so with N = 77 (3 panels) M runs in chunks, the last
    one short)."""
    w = _weight(k, n)
    program = compile_graph(linear_graph(w, None, bias=False), precision="bf16")
    assert runs_tiles(program.program.target, program.program.op_map)
    for rows in (1, 7, 65, 128, 600):
        _check(program, w, rows)


@needs_tiles
@pytest.mark.parametrize("rows", [1, 7])
def test_tiles_configured_to_fewer_rows_with_a_bias(rows: int) -> None:
    """A static batch below 16 rows configures each tile to M rows (no padding); the bias adds after the tiles."""
    w = _weight(1000, 77)
    program = compile_graph(linear_graph(w, rows, bias=True), precision="bf16")
    assert runs_tiles(program.program.target, program.program.op_map)
    _check(program, w, rows, np.linspace(-1, 1, 77))


def _asm(target: Target) -> tuple[str, dict]:
    program = compile_graph(linear_graph(_weight(77, 77), None, bias=True), target=target, precision="bf16!",
                            cache=False).program
    return program.library.mod.imports[0].inspect_source("asm"), program.op_map, program.target


def test_sapphire_rapids_build_multiplies_on_tiles() -> None:
    """A cross-build for `-mcpu=sapphirerapids` (on any x86 host) configures, loads, multiplies and stores tiles."""
    asm, op_map, target = _asm(SAPPHIRE)
    assert {"ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"} <= set(TILE_OPS.findall(asm))
    assert runs_tiles(target, op_map)


@pytest.mark.parametrize("cpu", sorted(NO_AMX))
def test_cpus_without_amx_never_get_tiles(cpu: str) -> None:
    """Zen 3 (emulated bf16) and Zen 4 (AVX512-BF16, no AMX): no tile instruction, no tile kernel, so the
    executable never asks Linux for tile data."""
    asm, op_map, target = _asm(NO_AMX[cpu])
    assert not TILE_OPS.findall(asm)
    assert not runs_tiles(target, op_map) and not any(KERNEL_NAME in n for f in op_map.values() for n in f)
    assert not runs_tiles(target, {"forward": {KERNEL_NAME: [0]}})  # an input of that name asks for nothing


def test_the_tile_choice_follows_the_lowered_target_not_an_ambient_one() -> None:
    """`lower(..., target=)` decides: a Sapphire Rapids lowering calls the tile kernel with no `with target:` around
    it, and a Zen 4 lowering inside `with SAPPHIRE:` does not (tuning and calibration lower outside any context)."""
    graph = linear_graph(_weight(77, 77), None, bias=False)
    assert KERNEL_NAME in kernel_names(graph, SAPPHIRE)
    with SAPPHIRE:
        assert KERNEL_NAME not in kernel_names(graph, NO_AMX["znver4"])


def attention_graph(lead: tuple[int | None, ...], m: int | None, k: int, n: int) -> Graph:
    """q [*lead, m, k] @ (k_t [*lead, n, k])^T and p [*lead, m, n] @ v [*lead, n, k]: attention's two products,
    both operands activations, the right one written by a transpose as in an encoder."""
    b = Builder("attn")
    q = b.input("q", ((*lead, m, k), "f32"))
    keys = b.input("keys", ((*lead, n, k), "f32"))
    p = b.input("p", ((*lead, m, n), "f32"))
    v = b.input("v", ((*lead, n, k), "f32"))
    b.ret(b.matmul(q, b.transpose(keys, perm=(*range(len(lead)), len(lead) + 1, len(lead)))), b.matmul(p, v))
    return verify(b.build())


def _products(program, lead: tuple[int, ...], m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * k * n)
    q, keys, p, v = (rng.standard_normal(s).astype(np.float32)
                     for s in ((*lead, m, k), (*lead, n, k), (*lead, m, n), (*lead, n, k)))
    for y, (x, w) in zip(program(q, keys, p, v), ((q, np.swapaxes(keys, -1, -2)), (p, v)), strict=True):
        exact = x.astype(np.float64) @ w
        err = np.abs(np.asarray(y) - exact)
        assert np.all(err <= bf16_bound(x.astype(np.float64), w.astype(np.float64)))
        assert err.max() > 2.0 ** -16 * (np.abs(x) @ np.abs(w)).max()  # bf16's error: not an f32 build


@needs_tiles
@pytest.mark.parametrize(("lead", "m", "k", "n"), [((2, 3), 128, 64, 128), ((1,), 7, 77, 45), ((3,), 1, 33, 17)])
def test_attention_products_on_tiles_are_within_the_bf16_bound(lead: tuple[int, ...], m: int, k: int,
                                                               n: int) -> None:
    """Both products run on tiles (the right operand packed per call) at 128, 7 and 1 rows, K and N not multiples
    of 16 or 32, static shapes."""
    program = compile_graph(attention_graph(lead, m, k, n), precision="bf16")
    assert runs_tiles(program.program.target, program.program.op_map)
    _products(program, lead, m, k, n)


@needs_tiles
def test_attention_products_on_tiles_with_a_symbolic_batch_and_rows() -> None:
    """A symbolic batch and a symbolic M (rows padded to whole 32s): one build at batch 1 x 1 row and 2 x 37 rows."""
    program = compile_graph(attention_graph((None,), None, 64, 50), precision="bf16")
    assert runs_tiles(program.program.target, program.program.op_map)
    for lead, m in (((1,), 1), ((2,), 37)):
        _products(program, lead, m, 64, 50)


def test_sapphire_rapids_attention_products_call_the_tile_kernel() -> None:
    """A Sapphire Rapids lowering of attention's products calls the tile kernel for both, with no f32 or widened
    product left; a Zen 4 lowering (no AMX) calls no tile kernel (its `vdpbf16ps` kernel: test_dot_bf16.py)."""
    graph = attention_graph((2,), 128, 64, 128)
    assert sum(name.startswith(KERNEL_NAME) for name in kernel_names(graph, SAPPHIRE)) == 2
    assert not any(name.startswith(KERNEL_NAME) for name in kernel_names(graph, NO_AMX["znver4"]))


def _loops_around(stmt: tirx.Stmt, name: str, loops: tuple[tirx.ForKind, ...] = ()) -> list[tuple[tirx.ForKind, ...]]:
    """The kinds of the loops around each call of the intrinsic `name` in `stmt`, outermost first."""
    if isinstance(stmt, tirx.For):
        return _loops_around(stmt.body, name, (*loops, stmt.kind))
    if isinstance(stmt, tirx.Evaluate):
        return [loops] if f"llvm.x86.{name}" in str(stmt.value) else []
    if isinstance(stmt, tirx.SeqStmt):
        return [found for s in stmt.seq for found in _loops_around(s, name, loops)]
    inner = [getattr(stmt, a, None) for a in ("body", "then_case", "else_case")]
    return [found for s in inner if s is not None for found in _loops_around(s, name, loops)]


def test_each_task_configures_its_tiles_once() -> None:
    """ldtilecfg and tilerelease sit in the parallel task loop itself, the products two serial loops further in (M
    blocks, K steps): the configuration is paid once per task, not once per 32 x 32 block."""
    kernel = tile_kernel(16, 64, 64, shared_b=True, cores=2, l2_bytes=1 << 20)
    task = (tirx.ForKind.PARALLEL,)
    assert _loops_around(kernel.body, "ldtilecfg") == [task]
    assert _loops_around(kernel.body, "tilerelease") == [task]
    products = _loops_around(kernel.body, "tdpbf16ps")
    assert products and all(p[:3] == (*task, tirx.ForKind.SERIAL, tirx.ForKind.SERIAL) for p in products)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to nearest-even bf16, as their 16 bits (uint32)."""
    bits = x.astype(np.float32).view(np.uint32)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def test_packed_pairs_hold_amx_pair_layout() -> None:
    """An activation's pack, built alone, holds bf16(y[2p + e, 16j + n]) as half e of uint32 (j, p, n): AMX's
    [N/16, K/2, 16, 2] pair layout, rounded to nearest even and zero past K = 37 and N = 21 (padded to 64 x 32)."""
    y = np.random.default_rng(3).standard_normal((2, 37, 21)).astype(np.float32)
    placeholder = te.placeholder(y.shape, "float32", name="y")
    packed = _packed_pairs(placeholder, 64, 32)
    build = cpu_compile(te.create_prim_func([placeholder, packed]), cpu_target())
    out = tvm.runtime.empty(tuple(int(d) for d in packed.shape), "uint32")
    build(tvm.runtime.tensor(y), out)
    wide = np.zeros((2, 64, 32), np.uint32)
    wide[:, :37, :21] = _bf16_bits(y)
    expected = wide.reshape(2, 32, 2, 2, 16).transpose(0, 3, 1, 4, 2)  # [b, j, p, n, e]
    np.testing.assert_array_equal(out.numpy(), expected[..., 0] | (expected[..., 1] << 16))
