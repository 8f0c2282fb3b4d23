"""The VNNI int8 kernel of `precision="int8"` (runtime/tvm/vnni_matmul.py): exact int32 products against int64
numpy on odd extents where the host has AVX512-VNNI, and the instruction choice by CPU on any x86 host (cross-built,
the assembly grepped)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.target import Target

from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.target import cpu_target
from kiln.runtime.tvm.vnni_matmul import (
    KERNEL_NAME,
    pack_codes,
    register_tile,
    vnni_int8_matmuls,
    vnni_kernel,
    vnni_lanes,
)

SAPPHIRE = Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})  # AVX512-VNNI, 16 lanes
ALDERLAKE = Target({"kind": "llvm", "mcpu": "alderlake", "num-cores": 2})  # AVX-VNNI only, 8 lanes
ZEN3 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})  # AVX2, no VNNI
HOST_VNNI = "avx512vnni" in cpu_model(cpu_target()).features


def _build(target: Target, parts: int, rows: int | None, depth: int, n: int, seed: int = 0):
    """(library, packed weight, correction, codes) of the kernel for `target` on random codes."""
    model = cpu_model(target)
    lanes = vnni_lanes(model)
    tile_rows, width = register_tile(model, rows, -(-n // lanes))
    codes = np.random.default_rng(seed).integers(-127, 128, (parts, depth, n)).astype(np.int8)
    packed, corr = pack_codes(codes, lanes, width)
    kernel = vnni_kernel(parts, depth, n, lanes, tile_rows, width, packed.shape[1])
    return tvm.tirx.build(kernel.with_attr("global_symbol", "main"), target=target), packed, corr, codes


@pytest.mark.skipif(not HOST_VNNI, reason="the host CPU has no AVX512-VNNI (vpdpbusd): the kernel cannot run here")
@pytest.mark.parametrize(("parts", "rows", "depth", "n"), [
    (1, 1, 1000, 77), (1, 7, 77, 1000), (1, 128, 64, 64), (1, 128, 1000, 77), (5, 7, 200, 77), (2, 1, 77, 64)])
def test_vnni_kernel_is_the_exact_signed_product(parts: int, rows: int, depth: int, n: int) -> None:
    """u8 x s8 sums with the +128 offset corrected equal int64 numpy's signed product exactly, for M = 1, 7, 128,
    K and N not multiples of 4 and 16 (zero-padded codes), per-block batches (parts > 1); codes reach +-127."""
    lib, packed, corr, codes = _build(cpu_target(), parts, rows, depth, n)
    x = np.random.default_rng(1).integers(-127, 128, (parts, rows, depth)).astype(np.int8)
    x[..., 0] = -127  # the extremes the activation quantizer emits
    out = tvm.runtime.tensor(np.zeros((parts, rows, n), np.int32))
    lib(tvm.runtime.tensor(x), tvm.runtime.tensor(packed), tvm.runtime.tensor(corr), out)
    np.testing.assert_array_equal(out.numpy(), np.einsum("pmk,pkn->pmn", x.astype(np.int64), codes.astype(np.int64)))


@pytest.mark.parametrize(("target", "register"), [(SAPPHIRE, "%zmm"), (ALDERLAKE, "%ymm")])
def test_vnni_cpus_multiply_with_vpdpbusd(target: Target, register: str) -> None:
    """Cross-built on any x86 host: AVX512-VNNI gets 16-lane vpdpbusd on zmm, AVX-VNNI 8-lane on ymm."""
    asm = _build(target, 1, None, 77, 77)[0].inspect_source("asm")
    lines = [line for line in asm.splitlines() if "vpdpbusd" in line]
    assert lines and all(register in line for line in lines)


def _int8_product(depth: int, n: int) -> tvm.IRModule:
    """x int8 [M, depth] @ a bound int8 weight -> int32, as `lowp.int8_matmul` emits it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var("m", "int64"), depth], "int8"))
    weight = np.random.default_rng(2).integers(-127, 128, (depth, n)).astype(np.int8)
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(R.matmul(x, relax.const(weight), out_dtype="int32"))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(("target", "vnni"), [(SAPPHIRE, True), (ZEN3, False)])
def test_only_vnni_cpus_get_the_kernel(target: Target, vnni: bool) -> None:
    """The pass replaces the int8 product by the VNNI kernel where the CPU has VNNI; on Zen 3 (AVX2) the plain
    matmul stays (LLVM widens it to vpmulld), so that build has no vpdpbusd."""
    mod = vnni_int8_matmuls(target)(_int8_product(77, 40))
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert (KERNEL_NAME in kernels) == vnni
    assert ("R.matmul" in mod.script()) != vnni
