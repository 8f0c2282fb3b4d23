"""The CPU targets the schedule tests cross-build for, whatever the host: their kernels are inspected or built,
and run only where the host has the ISA."""

from tvm.target import Target

AVX512 = Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})  # 32 registers x 16 lanes
AVX2 = Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # 16 registers x 8 lanes
