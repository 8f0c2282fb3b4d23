"""The CPU targets the schedule tests cross-build for, whatever the host: their kernels are inspected or built,
and run only where the host has the ISA."""

from tvm.target import Target


def avx512(cores: int = 2) -> Target:
    """An AVX-512 target (32 registers x 16 lanes) for `cores` cores: the thread split and task rules depend on them."""
    return Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": cores})


AVX512 = avx512()
AVX2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # 16 registers x 8 lanes
