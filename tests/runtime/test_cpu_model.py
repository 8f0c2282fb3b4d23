"""The CPU model behind kiln's schedules, cross-compiling with `KILN_CPU`/`target=`, and the calibration cache.

Issue 13: "kiln's rules take their parameters from the CPU they compile for, never from constants tuned on one chip:
vector width and register count from the target's ISA (AVX2: 16 x 256-bit; AVX-512: 32 x 512-bit), FMA units,
L1/L2/L3 sizes (sysfs / cpuid; the LLVM host CPU name and features), cores."
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tvm
from cross_targets import AVX2 as HASWELL
from cross_targets import AVX512
from tile_text import column_widths
from tvm import relax
from tvm.target import Target, codegen

from kiln import ir
from kiln.ir import KilnError
from kiln.runtime.tvm import calibrate as calibrate_mod
from kiln.runtime.tvm.calibrate import calibrate, calibrate_on_first_use, candidates
from kiln.runtime.tvm.calibration import CALIBRATE_ENV, calibration_path, stored_tile
from kiln.runtime.tvm.compile import cache_key
from kiln.runtime.tvm.cpu import CLASS_DEFAULTS, CacheSizes, cpu_model, host_caches
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.schedules import CPUMatmul, default_cpu_rules
from kiln.runtime.tvm.target import CPU_ENV, HOST_FEATURES, cpu_count, cpu_target, mattr_for, resolve_target


def _host_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "flags :")
    return set(line.split(":", 1)[1].split())


# --- the model ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "bits", "registers", "fma"),
                         [(HASWELL, 256, 16, True), (AVX512, 512, 32, True),
                          (Target({"kind": "llvm", "mcpu": "generic"}), 128, 16, False)],
                         ids=["haswell", "skylake-avx512", "generic"])
def test_isa_comes_from_the_named_cpu(target: Target, bits: int, registers: int, fma: bool) -> None:
    """"vector width and register count from the target's ISA (AVX2: 16 x 256-bit; AVX-512: 32 x 512-bit)";
    a cross-compile target takes its caches from the documented class defaults."""
    model = cpu_model(target)
    assert (model.vector_bits, model.vector_registers, model.fma) == (bits, registers, fma)
    assert model.lanes() == bits // 32 and not model.host and model.caches == CLASS_DEFAULTS[bits]
    assert model.cores == 2


def test_mattr_changes_the_isa() -> None:
    model = cpu_model(Target({"kind": "llvm", "mcpu": "haswell", "mattr": ["+avx512f"]}))
    assert model.vector_bits == 512 and model.key != cpu_model(HASWELL).key
    assert "avx512f" in model.features and "avx512f" not in cpu_model(HASWELL).features


def test_host_model_matches_proc_cpuinfo_and_glibc() -> None:
    """The host's ISA agrees with the kernel's CPU flags and its caches with glibc's cpuid-based sysconf."""
    model = cpu_model(cpu_target())
    flags = _host_flags()
    if flags:
        assert model.vector_bits == (512 if "avx512f" in flags else 256 if "avx" in flags else 128)
        assert model.fma == ("fma" in flags or model.vector_bits == 128 and model.vector_registers == 32)
    assert model.host and model.cores == cpu_count()
    for flag, feature in HOST_FEATURES.items():  # what LLVM's name for the CPU misses, the target's -mattr states
        if flags:
            assert (feature in model.features) == (flag in flags), feature
    for name, got in (("SC_LEVEL1_DCACHE_SIZE", model.caches.l1d), ("SC_LEVEL2_CACHE_SIZE", model.caches.l2)):
        want = os.sysconf(name) if name in os.sysconf_names else 0
        if want > 0 and Path("/sys/devices/system/cpu/cpu0/cache/index0").exists():
            assert got == want, name


def test_host_mattr_adds_what_the_cpu_name_misses_and_drops_what_the_flags_lack() -> None:
    """A VM reporting an Emerald Rapids as rocketlake (no AMX in LLVM's table) still builds with AMX; a CPU name
    promising AVX-512 that the kernel's flags deny loses it, so no build faults on the host."""
    rocketlake = {str(f) for f in codegen.llvm_get_cpu_features(Target({"kind": "llvm", "mcpu": "rocketlake"}))}
    flags = {"fma", "avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_bf16", "avx512_bf16"}
    assert mattr_for(flags, rocketlake) == ("+amx-bf16", "+amx-tile", "+avx512bf16")
    assert mattr_for({"fma", "avx2"}, rocketlake) == ("-avx512f", "-avx512vnni")
    target = Target({"kind": "llvm", "mcpu": "rocketlake", "mattr": list(mattr_for(flags, rocketlake))})
    assert {"amx-bf16", "avx512bf16"} <= cpu_model(target).features


def _sysfs(root: Path, entries: list[tuple[str, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
        (d / "coherency_line_size").write_text("128\n")
    return root


def test_sysfs_caches_and_defaults_for_what_it_omits(tmp_path: Path) -> None:
    """L1d/L2/L3 bytes read from sysfs `index*/`; instruction caches skipped; a level sysfs lacks (or a size it
    garbles) keeps the documented default, never a crash."""
    root = _sysfs(tmp_path, [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "2048K"),
                             ("3", "Unified", "garbage")])
    default = CacheSizes(l1d=1, l2=2, l3=3)
    assert host_caches(root, default) == CacheSizes(l1d=48 << 10, l2=2 << 20, l3=3, line=128)
    assert host_caches(tmp_path / "missing", default) == default


# --- every schedule size derived from the model --------------------------------------------------------------------


def test_contraction_tile_from_the_model() -> None:
    """AVX-512 (32 registers x 16 lanes) keeps the 8x32 tile and 128 KiB panels tuned on Zen 4; AVX2 (16 x 8) gets
    4x16 and an eighth of its L2, not the AVX-512 constants (on an AVX2 Zen 3 those ran a 3x3 conv 2.2x and a K=64
    attention matmul 1.7x slower; bench/RESULTS.md)."""
    avx512, avx2 = CPUMatmul().for_cpu(cpu_model(AVX512)), CPUMatmul().for_cpu(cpu_model(HASWELL))
    assert (avx512.mr, avx512.nr, avx512.panel_bytes, avx512.accumulators, avx512.lanes) == (8, 32, 128 << 10, 16, 16)
    assert (avx2.mr, avx2.nr, avx2.panel_bytes, avx2.accumulators, avx2.lanes) == (4, 16, 32 << 10, 8, 8)
    assert avx512.latency_sums == avx2.latency_sums == 8  # 2 FMA units x 4 cycles on both
    pinned = CPUMatmul(mr=6, nr=24).for_cpu(cpu_model(HASWELL))
    assert (pinned.mr, pinned.nr) == (6, 24)


def _asm(target: Target, shapes: list[tuple[int, ...]], body) -> tuple[str, relax.VirtualMachine | None]:
    library = cpu_compile(calibrate_mod.relax_module(shapes, body), target, cpu_pipeline(target))
    return library.mod.imports[0].inspect_source("asm"), library


def _vector_registers(asm: str) -> set[str]:
    return {m[0] for m in re.findall(r"%((x|y|z)mm)\d+", asm)}


def test_avx2_cross_build_uses_ymm_only_and_runs_correctly() -> None:
    """"an AVX2 build must be correct": `-mcpu=haswell` code holds ymm registers and never a zmm; it runs here
    (every x86 CPU with AVX-512 or AVX2 runs it) and matches numpy."""
    shapes = [(37, 70), (70, 77)]
    asm, library = _asm(HASWELL, shapes, lambda a, b: relax.op.nn.relu(relax.op.matmul(a, b)))
    assert "ymm" in _vector_registers(asm) and "zmm" not in _vector_registers(asm)
    if "avx2" not in _host_flags():
        pytest.skip("this host cannot run AVX2 code")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    got = relax.VirtualMachine(library, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    want = np.maximum(a.astype(np.float64) @ b.astype(np.float64), 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_avx512_cross_build_emits_zmm() -> None:
    """An AVX-512 build compiles on any host (it is not run: this CPU may lack AVX-512) and uses zmm registers."""
    asm, _ = _asm(AVX512, [(32, 64), (64, 64)], relax.op.matmul)
    assert "zmm" in _vector_registers(asm)


# --- naming another CPU ------------------------------------------------------------------------------------------


def test_target_strings_dicts_and_kiln_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_target("llvm -mcpu=skylake-avx512").attrs["mcpu"] == "skylake-avx512"
    assert list(resolve_target("llvm -mcpu=haswell -mattr=+avx512f").attrs["mattr"]) == ["+avx512f"]
    assert resolve_target({"kind": "llvm", "mcpu": "haswell"}).attrs["mcpu"] == "haswell"
    monkeypatch.setenv(CPU_ENV, "haswell")
    assert resolve_target("llvm").attrs["mcpu"] == "haswell" and not cpu_model(resolve_target("llvm")).host


@pytest.mark.parametrize("bad", ["llvm -mcpu=pentium-9000", "llvm -fast=1", "llvm -num-cores=two",
                                 {"kind": "llvm", "mcpu": "nope"}], ids=["cpu", "option", "cores", "dict"])
def test_bad_cpu_names_are_one_line_errors(bad: object) -> None:
    with pytest.raises(KilnError, match=r"pentium-9000|-fast=1|'two'|'nope'"):
        resolve_target(bad)


def test_bad_kiln_cpu_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_ENV, "zen99")
    with pytest.raises(KilnError, match="unknown LLVM CPU 'zen99'.*KILN_CPU"):
        cpu_target()


def test_cache_keys_differ_per_cpu() -> None:
    b = ir.Builder("m")
    x = b.input("x", ((4, 8), "f32"))
    b.ret(b.relu(x))
    graph = b.build()
    keys = {cache_key(graph, ("forward",), t, "bound", True) for t in (HASWELL, AVX512, cpu_target())}
    assert len(keys) == 3


# --- calibration -------------------------------------------------------------------------------------------------


TINY = (([(16, 32), (32, 32)], relax.op.matmul),)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_calibration_stores_the_fastest_tile_and_builds_use_it(cache: Path) -> None:
    """"a one-time calibration (a few candidate tiles per kernel class, seconds, run on first use and stored in the
    cache keyed by CPU model and TVM version) decides"; the compile-cache key changes with it."""
    target = cpu_target()
    model = cpu_model(target)
    graph = ir.Builder("m")
    x = graph.input("x", ((4, 8), "f32"))
    graph.ret(graph.relu(x))
    before = cache_key(graph.build(), ("forward",), target, "bound", True)
    tiles = [{"mr": 1, "nr": 8}, {"mr": 4, "nr": 16}]
    winner, seconds = calibrate(target, tiles, TINY, runs=2)
    assert winner in tiles and set(seconds) == {repr(t) for t in tiles}
    assert stored_tile(model) == winner
    path = calibration_path(model)
    assert path.parent == cache / "calibration" and model.key in path.name and tvm.__version__ in path.name
    rule = next(r.rule for r in default_cpu_rules(target) if isinstance(r.rule, CPUMatmul))
    assert (rule.mr, rule.nr) == (winner["mr"], winner["nr"])
    assert cache_key(graph.build(), ("forward",), target, "bound", True) != before


@pytest.mark.parametrize("text", ["{", '{"contraction": {"mr": -1}}', '{"contraction": {"rows": 4}}', "[]"],
                         ids=["not-json", "negative", "unknown-field", "not-an-object"])
def test_damaged_calibration_is_ignored(cache: Path, text: str) -> None:
    model = cpu_model(cpu_target())
    path = calibration_path(model)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert stored_tile(model) is None
    rule = next(r.rule for r in default_cpu_rules(cpu_target()) if isinstance(r.rule, CPUMatmul))
    assert rule.mr is None  # the model decides


def test_calibration_runs_only_on_opt_in(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `KILN_CALIBRATE=1` a build never times anything; with it, once per CPU model (and never for a
    cross-compile target, which cannot run here)."""
    calls: list[str] = []
    monkeypatch.setattr(calibrate_mod, "calibrate", lambda target: calls.append(str(target)) or
                        calibrate_mod.store_tile(cpu_model(target), {"mr": 4, "nr": 16}))
    calibrate_on_first_use(cpu_target())
    assert calls == []
    monkeypatch.setenv(CALIBRATE_ENV, "1")
    calibrate_on_first_use(HASWELL)
    calibrate_on_first_use(cpu_target())
    calibrate_on_first_use(cpu_target())
    assert len(calls) == 1 and json.loads(calibration_path(cpu_model(cpu_target())).read_text())["contraction"]


def test_default_candidates_start_with_the_model_tile() -> None:
    tiles = candidates(cpu_model(HASWELL))
    assert tiles[0] == {"mr": 4, "nr": 16} and len(tiles) == len({repr(t) for t in tiles}) <= 4


def test_kiln_calibrate_show_prints_the_model_and_times_nothing(cache: Path, capsys: pytest.CaptureFixture) -> None:
    from kiln.cli import main

    assert main(["calibrate", "--show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"cpu: {cpu_model(cpu_target()).describe()}\n") and "none (the model decides)" in out
    assert not (cache / "calibration").exists()


def _matmul_schedule(target: Target, m: int, k: int, n: int) -> str:
    """The TIR CPUMatmul gives the `m x k x n` matmul for `target`."""
    mod = relax.transform.LegalizeOps()(calibrate_mod.relax_module([(m, k), (k, n)], relax.op.matmul))
    (func,) = [f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    with target:
        return CPUMatmul().apply(func, target, False).mod["main"].script()


@pytest.mark.parametrize(("target", "width"), [(HASWELL, 64), (AVX512, 256)], ids=["avx2", "avx512"])
def test_batch1_matmul_tile_fills_the_accumulators(target: Target, width: int) -> None:
    """A batch-1 matmul (a GEMV) keeps as many vector sums in flight as the model's accumulators, 8 x 8 lanes on
    AVX2 and 16 x 16 on AVX-512, not the `TILE_VECTORS` of a row tile (13% of peak on Zen 3); batch 256 keeps `nr`."""
    rule = CPUMatmul().for_cpu(cpu_model(target))
    assert rule.lanes * rule.accumulators == width
    assert width in column_widths(_matmul_schedule(target, 1, 784, 512))
    assert rule.nr in column_widths(_matmul_schedule(target, 256, 784, 512))


def test_avx512_batch1_matmul_emits_zmm() -> None:
    """The widened batch-1 tile on `-mcpu=skylake-avx512` is zmm code (32 registers x 16 lanes)."""
    asm, _ = _asm(AVX512, [(1, 784), (784, 512)], relax.op.matmul)
    assert "zmm" in _vector_registers(asm)
