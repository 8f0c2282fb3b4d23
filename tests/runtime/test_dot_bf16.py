"""bf16 products with `vdpbf16ps` on AVX512-BF16 CPUs without AMX (issue 13, bf16 through AVX512-BF16): numbers
against float64 numpy within docs/precision.md's bf16 bound where the host has AVX512-BF16 (a Zen 4 build runs on
Zen 4 and on Sapphire/Emerald Rapids); on every x86 host, cross-builds show which kernel each CPU gets."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import tvm
from test_amx_epilogue import callees, check_epilogues, consumer_graph
from test_amx_matmul import SAPPHIRE, _check, _products, _weight, attention_graph, kernel_names, linear_graph
from tvm.target import Target

from kiln.ir import Graph
from kiln.runtime.tvm.amx import KERNEL_NAME
from kiln.runtime.tvm.bf16_layout import even_chunks, task_place
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.dot_bf16 import DOT_KERNEL_NAME, dot_tile, has_dot
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.target import cpu_target

ZEN4 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})  # AVX512-BF16, no AMX
ZEN3 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})  # AVX2: bf16 widened to f32
needs_dot = pytest.mark.skipif(not has_dot(cpu_model(cpu_target())),
                               reason="the host CPU has no AVX512-BF16: a vdpbf16ps kernel cannot run")

pytestmark = pytest.mark.usefixtures("module_cache")


def test_each_cpu_gets_its_bf16_kernel() -> None:
    """Zen 4 multiplies a bound weight and both of attention's products with `vdpbf16ps`, Sapphire Rapids on AMX
    tiles (never the dot kernel), Zen 3 with neither."""
    linear, attention = linear_graph(_weight(77, 77), None, bias=False), attention_graph((2,), 128, 64, 128)
    assert sum(n.startswith(DOT_KERNEL_NAME) for n in kernel_names(linear, ZEN4)) == 1
    assert sum(n.startswith(DOT_KERNEL_NAME) for n in kernel_names(attention, ZEN4)) == 2
    assert not any(n.startswith((KERNEL_NAME, DOT_KERNEL_NAME)) for n in kernel_names(linear, ZEN3))
    sapphire = kernel_names(linear, SAPPHIRE)
    assert any(n.startswith(KERNEL_NAME) for n in sapphire) and not any(n.startswith(DOT_KERNEL_NAME) for n in sapphire)


def test_a_zen4_build_inlines_vdpbf16ps() -> None:
    """The LLVM IR linked into the kernel is inlined: the assembly has the instruction on zmm registers and no call
    of the wrapper."""
    program = compile_graph(linear_graph(_weight(77, 77), None, bias=True), target=ZEN4, precision="bf16",
                            cache=False).program
    asm = program.library.mod.imports[0].inspect_source("asm")
    assert re.search(r"vdpbf16ps\s+%zmm\d+, %zmm\d+, %zmm\d+", asm)
    assert "kiln_dpbf16ps" not in asm


@pytest.mark.parametrize(("rows", "groups", "tile"), [(None, 48, (6, 4)), (None, 2, (14, 2)), (1, 32, (1, 8)),
                                                      (3, 64, (3, 4))])
def test_the_register_tile_has_the_fewest_loads_per_instruction(rows: int | None, groups: int,
                                                                tile: tuple[int, int]) -> None:
    """32 registers: 6 rows x 4 vectors (24 sums, 4 B vectors and a broadcast; 10 loads per 24 instructions); 2
    column vectors leave 14 rows; a single row takes 8 vectors (9 loads per 8), 3 rows take 4 (7 loads per 12)."""
    assert dot_tile(rows, groups, 32) == tile


@needs_dot
@pytest.mark.parametrize(("k", "n"), [(64, 1000), (77, 77), (1000, 64), (768, 768)])
def test_dot_products_are_within_the_bf16_bound_at_any_batch(k: int, n: int) -> None:
    """A symbolic batch at M = 1, 7, 65, 128 and 600: row tiles of 6 leave a last tile moved back over its
    neighbour's rows; 600 rows of K = 1000 outgrow half an L2, so M runs in chunks; N = 77 and 1000 are no multiple
    of a 4-vector panel."""
    w = _weight(k, n)
    program = compile_graph(linear_graph(w, None, bias=False), target=ZEN4, precision="bf16")
    assert any(n.startswith(DOT_KERNEL_NAME) for f in program.program.op_map.values() for n in f)
    for rows in (1, 7, 65, 128, 600):
        _check(program, w, rows)


@pytest.mark.parametrize("consumer", ["gelu", "residual"])
@pytest.mark.parametrize("n", [64, 77, 10])
def test_bias_activation_and_residual_run_in_the_dot_kernels_store(consumer: str, n: int) -> None:
    """As on tiles: the bias with gelu or a residual add after a Zen 4 product is one dot kernel with that
    epilogue, after A's cast and padding: no elementwise kernel reads the product back, also where N (77, 10) is
    no whole number of C's panels."""
    names = callees(consumer_graph(7, _weight(77, n), consumer), ZEN4)
    assert len(names) == 2 and names[1] == f"{DOT_KERNEL_NAME}_epilogue"


@needs_dot
@pytest.mark.parametrize(("rows", "k", "n"), [(128, 96, 64), (7, 77, 64), (608, 1000, 96), (37, 96, 64),
                                              (197, 64, 96), (20, 64, 16), (7, 77, 77), (608, 1000, 1000),
                                              (37, 96, 10), (20, 64, 40)])
def test_dot_epilogues_are_within_the_bf16_bound(rows: int, k: int, n: int) -> None:
    """`check_epilogues` from the dot kernel's store: 7 rows (one short row tile), 608 rows of K = 1000 (M in L2
    chunks, the last row tile moved back, so its epilogue stores some rows twice); 37 and 197 rows, whose last row
    tile moves back too (C is not padded: when it was, the padding's products had overwritten the first 27 rows);
    20 rows of 16 columns, whose register tile (30 rows for one vector) is cut to M; N of 77, 1000, 10 and 40,
    C padded to whole panels, whose columns past N the store must drop (storing them whole wrapped into the next
    rows at 608 x 1000)."""
    check_epilogues(rows, k, n, ZEN4)


@pytest.mark.parametrize("consumer", ["gelu", "residual"])
@pytest.mark.parametrize("rows", [32, 7])
def test_a_dynamic_batch_s_epilogues_run_in_the_dot_kernels_store(consumer: str, rows: int) -> None:
    """Over a dynamic batch too (x [batch, rows, K]: C's rows batch x rows, padded to 32s at 7): the consumer,
    with the reshape from C's rows to [batch, rows], is the dot kernel's epilogue, not a kernel of its own."""
    names = callees(consumer_graph(rows, _weight(96, 64), consumer, dynamic=True), ZEN4)
    assert names[-1] == f"{DOT_KERNEL_NAME}_epilogue" and len(names) == 2, names


@needs_dot
@pytest.mark.parametrize(("rows", "k", "n"), [(32, 96, 64), (7, 77, 64)])
def test_dynamic_batch_epilogues_are_within_the_bf16_bound(rows: int, k: int, n: int) -> None:
    """`check_epilogues` over a dynamic batch, run at batch 3: 96 whole rows, and 21 rows padded to 32, whose
    padding's products the epilogue's guard must drop."""
    check_epilogues(rows, k, n, ZEN4, batch=3)


def _fused(graph: Graph) -> tvm.IRModule:
    """`graph` lowered in bf16 for Zen 4 and through kiln's fusion passes."""
    module = lower(graph, "bound", None, "bf16", ZEN4).module
    with ZEN4:
        return tvm.transform.Sequential(cpu_fusion_passes(ZEN4))(module)


def test_a_known_m_is_not_padded() -> None:
    """37 rows (and K = 77, padded to whole pairs only): A is cast, not padded to 64 rows, and the dot kernel's
    epilogue writes the 37 rows unguarded: no copy adds or drops padding rows."""
    module = _fused(consumer_graph(37, _weight(77, 64), "residual"))
    main = str(module["forward"])
    assert "(1, 37, 78)" in main and "64, 78" not in main and "_unpadded" not in main, main
    (text,) = [f.script() for g, f in module.functions_items() if g.name_hint.startswith(f"{DOT_KERNEL_NAME}_epilogue")]
    assert "if " not in text, text


def test_a_symbolic_m_is_not_padded_either() -> None:
    """A dynamic batch of 7-row inputs (M = batch x 7, which may be shorter than the register tile at run time):
    A is cast and reshaped, not copied into 32s of rows, and the epilogue stores unguarded."""
    module = _fused(consumer_graph(7, _weight(96, 64), "residual", dynamic=True))
    main = str(module["forward"])
    assert "_padded_bf16" not in main and "// 32" not in main, main
    (text,) = [f.script() for g, f in module.functions_items() if g.name_hint.startswith(f"{DOT_KERNEL_NAME}_epilogue")]
    assert "if " not in text, text


@needs_dot
@pytest.mark.parametrize(("rows", "batch"), [(3, 1), (3, 5), (1, 2)])
def test_a_symbolic_m_shorter_than_the_register_tile_is_within_the_bf16_bound(rows: int, batch: int) -> None:
    """M = 3, 15 and 2 rows at run time against a register tile of 6: the tile's rows past M repeat M's last."""
    check_epilogues(rows, 64, 64, ZEN4, batch=batch)


@needs_dot
@pytest.mark.parametrize(("lead", "m", "k", "n"), [((2, 3), 128, 64, 128), ((1,), 7, 77, 45), ((3,), 1, 33, 17)])
def test_attention_products_with_vdpbf16ps_are_within_the_bf16_bound(lead: tuple[int, ...], m: int, k: int,
                                                                     n: int) -> None:
    """Both products (the right operand packed per call, one B per batch) at 128, 7 and 1 rows."""
    program = compile_graph(attention_graph(lead, m, k, n), target=ZEN4, precision="bf16")
    _products(program, lead, m, k, n)


@needs_dot
def test_empty_batches_make_no_task() -> None:
    """A symbolic batch or M of 0 gives empty results: the task count never divides by zero (it did, and the
    process died of SIGFPE)."""
    linear = compile_graph(linear_graph(_weight(77, 77), None, bias=False), target=ZEN4, precision="bf16")
    assert linear(np.zeros((0, 77), np.float32)).shape == (0, 77)
    attention = compile_graph(attention_graph((None,), None, 64, 50), target=ZEN4, precision="bf16")
    for lead, m in (((0,), 5), ((2,), 0)):
        q, keys, p, v = (np.zeros(s, np.float32) for s in ((*lead, m, 64), (*lead, 50, 64), (*lead, m, 50),
                                                           (*lead, 50, 64)))
        assert [y.shape for y in attention(q, keys, p, v)] == [(*lead, m, 50), (*lead, m, 64)]


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 6])
def test_chunks_give_every_core_as_many_tasks(cores: int) -> None:
    """`even_chunks` and `task_place`, evaluated: the task count (chunks x batches x panels) is a multiple of the
    cores wherever there are enough row tiles to make it so, no chunk exceeds the L2 chunk, the chunks are even and
    cover each row tile once, and 0 row tiles make one empty chunk."""
    analyzer = tvm.sym.Analyzer()
    value = lambda e: int(analyzer.simplify(e))  # noqa: E731
    for mblocks, chunk, others in itertools.product(range(0, 40), (1, 3, 8, 100), (1, 2, 3, 5, 6)):
        chunks = value(even_chunks(mblocks, chunk, cores, tvm.tirx.const(others, "int64")))
        assert 1 <= chunks <= max(1, mblocks) and chunks * chunk >= mblocks
        step = cores // math.gcd(others, cores)  # chunks a multiple of it balance the tasks
        needed = math.ceil(mblocks / chunk)
        if 0 < math.ceil(needed / step) * step <= mblocks:  # room to round the chunks needed up to it
            assert chunks * others % cores == 0, (mblocks, chunk, others, chunks)
        spans = [[value(e) for e in task_place(tvm.tirx.const(t, "int64"), others, tvm.tirx.const(1, "int64"),
                                               mblocks, tvm.tirx.const(chunks, "int64"))[2:]]
                 for t in range(0, chunks * others, others)]
        assert [t for first, last in spans for t in range(first, last)] == list(range(mblocks))
        assert max(last - first for first, last in spans) - min(last - first for first, last in spans) <= 1
