"""The CPU a build targets, as the schedule rules need it: vector width, registers, FMA units, caches, cores.

The ISA comes from the LLVM target (its `mcpu` and `mattr`, whose features LLVM knows for every named CPU), so a
cross-compile for `-mcpu=haswell` gets AVX2 tiles on any host. Caches come from sysfs when the target is this host
(its own CPU name, no extra attributes); otherwise, and wherever sysfs says nothing, they are the documented
defaults of the ISA class below (`CLASS_DEFAULTS`). Nothing here raises on an unknown value.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from tvm.target import Target, codegen

from .target import cpu_count, host_cpu

SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
FMA_UNITS = 2  # vector FMA pipes of every x86 core with FMA3 since Haswell and Zen (LLVM does not say; documented)
FMA_LATENCY = 4  # cycles of a vector FMA on those cores: FMA_UNITS x FMA_LATENCY independent sums keep them busy


@dataclass(frozen=True)
class CacheSizes:
    """Per-core data cache bytes (L3: the whole shared cache) and the cache line."""

    l1d: int
    l2: int
    l3: int
    line: int = 64


# Caches of a typical core of each ISA class, for cross-compiles and hosts whose sysfs says nothing:
# AVX-512 servers (Skylake-SP .. Sapphire Rapids, Zen 4) have 1-2 MiB of L2; AVX2 cores (Haswell .. Skylake
# client, Zen 1-3) 256-512 KiB, of which the smaller is assumed; plain SSE/NEON cores likewise.
CLASS_DEFAULTS = {
    512: CacheSizes(l1d=32 << 10, l2=1 << 20, l3=16 << 20),
    256: CacheSizes(l1d=32 << 10, l2=256 << 10, l3=8 << 20),
    128: CacheSizes(l1d=32 << 10, l2=256 << 10, l3=4 << 20),
}


@dataclass(frozen=True)
class CPUModel:
    """What kiln's schedule rules know of the CPU a build is for; `cpu_model(target)` makes one."""

    name: str  # LLVM's CPU name (`znver3`, `haswell`, `skylake-avx512`, `generic`)
    vector_bits: int  # widest float vector register: 512 (AVX-512), 256 (AVX/AVX2), 128 (SSE, NEON)
    vector_registers: int  # architectural vector registers: 32 (AVX-512, AArch64), 16 (x86 without AVX-512)
    fma: bool  # fused multiply-add instructions
    fma_units: int  # vector FMA (or multiply and add) pipes per core
    caches: CacheSizes
    cores: int
    host: bool  # caches read from this machine's sysfs rather than CLASS_DEFAULTS
    features: frozenset[str] = frozenset()  # LLVM's feature names ("avx512bf16", "avxvnni", "amx-int8", ...)

    def lanes(self, bits: int = 32) -> int:
        """Elements of `bits` bits in one vector register (8 float32 on AVX2, 16 on AVX-512)."""
        return self.vector_bits // bits

    @property
    def latency_sums(self) -> int:
        """Independent running sums that keep every FMA unit busy: each sum is one chain of dependent FMAs."""
        return self.fma_units * FMA_LATENCY

    @property
    def accumulators(self) -> int:
        """Vector registers a register tile may keep as running sums: half the file (the rest holds operands and
        addresses), and never fewer than hide the FMA latency on every unit."""
        return max(self.vector_registers // 2, min(self.vector_registers - 4, self.latency_sums))

    @property
    def key(self) -> str:
        """A short digest of every field: the compile-cache key and the calibration file name use it."""
        fields = {**asdict(self), "features": sorted(self.features)}  # a set's order differs between processes
        return hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=8).hexdigest()

    def describe(self) -> str:
        """One line for logs and `kiln calibrate`."""
        c = self.caches
        return (f"{self.name}: {self.vector_bits}-bit x {self.vector_registers} vector registers, "
                f"{self.fma_units} FMA units{'' if self.fma else ' (no FMA)'}, L1d {c.l1d >> 10} KiB, "
                f"L2 {c.l2 >> 10} KiB, L3 {c.l3 >> 20} MiB{'' if self.host else ' (class defaults)'}, "
                f"{self.cores} cores")


def _features(target: Target) -> set[str]:
    """LLVM's feature names for the target's CPU with its `mattr` applied (empty for a CPU LLVM does not know)."""
    try:
        return {str(f) for f in codegen.llvm_get_cpu_features(target)}
    except (RuntimeError, ValueError, TypeError):
        return set()


def _vector_shape(features: set[str]) -> tuple[int, int]:
    """(vector bits, vector registers) of the ISA the features name."""
    if "avx512f" in features:
        return 512, 32
    if "avx" in features:
        return 256, 16
    if "neon" in features or "sve" in features:
        return 128, 32
    return 128, 16


def _sysfs_size(text: str) -> int | None:
    """Bytes of a sysfs cache `size` ("32K", "1024K", "32M"); None when it is not one."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else None


def host_caches(root: Path = SYSFS_CACHE, default: CacheSizes = CLASS_DEFAULTS[256]) -> CacheSizes:
    """This machine's data caches from sysfs (`index*/level`, `type`, `size`, `coherency_line_size`); a level
    sysfs does not give keeps its value in `default`."""
    fields: dict[str, int] = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = _sysfs_size((index / "size").read_text())
            line = (index / "coherency_line_size").read_text().strip()
        except OSError:
            continue
        name = {"1": "l1d", "2": "l2", "3": "l3"}.get(level)
        if kind == "Instruction" or name is None or size is None:
            continue
        fields.setdefault(name, size)
        if name == "l1d" and line.isdigit():
            fields["line"] = int(line)
    return CacheSizes(**{**asdict(default), **fields})


def _is_host(target: Target) -> bool:
    """Whether the target is this machine's CPU as `host_cpu` states it (its name and exactly its `-mattr`)."""
    attrs, host = target.attrs, host_cpu()
    return str(attrs.get("mcpu", "")) == host["mcpu"] and [str(a) for a in attrs.get("mattr", []) or []] == \
        host.get("mattr", [])


@functools.cache
def _model(text: str) -> CPUModel:
    target = Target(text)
    features = _features(target)
    bits, registers = _vector_shape(features)
    fma = "fma" in features or bits == 128 and registers == 32  # AArch64 NEON always fuses
    host = _is_host(target)
    caches = host_caches(default=CLASS_DEFAULTS[bits]) if host else CLASS_DEFAULTS[bits]
    cores = int(target.attrs.get("num-cores", 0) or 0) or cpu_count()
    return CPUModel(str(target.attrs.get("mcpu", "") or "generic"), bits, registers, fma,
                    FMA_UNITS if fma else 1, caches, cores, host, frozenset(features))


def cpu_model(target: Target) -> CPUModel:
    """The model of an LLVM target's CPU (cached per target); a non-LLVM target's host CPU for its host code."""
    if target.kind.name != "llvm":
        target = target.host if target.host is not None else Target({"kind": "llvm"})
    return _model(str(target))
