"""Relax compilation pipelines for kiln: scheduled CPU code by default, TVM's dlight rules for CUDA.

CPU: fast-math pre-passes, library dispatch, legalize + FuseOps + FuseTIR, kiln's schedule rules
(`kiln.runtime.tvm.schedules`), dataflow lowering and VM finalization. Without the schedule step TVM emits
naive single-threaded loops, 100-300x slower than onnxruntime.

CUDA without a GPU (TVM 0.27.0.post1 wheel, checked on a host with nvcc 13.0 but no driver): `tvm.compile`
with `cuda_pipeline` succeeds in well under a second and the executable carries the generated CUDA C
source, but no device binary. libtvm_runtime_cuda.so cannot load without libcuda.so.1, so codegen
falls back to a source-only module: neither nvcc nor NVRTC is invoked (`tvm_callback_cuda_compile` is
never called), and looking up a kernel raises "CUDA runtime is not linked into this build". The source
itself is valid: `tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")` inside `with target:`
builds it for sm_90. With a GPU, TVM compiles through NVRTC by default, which needs the `cuda-bindings`
package (not a kiln dependency) unless TVM_CUDA_COMPILE_MODE=nvcc is set; that path is unverified here.
"""

from collections.abc import Collection, Mapping, Sequence

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu_passes
from tvm.relax.backend.cuda import pipeline as cuda_passes
from tvm.s_tir import dlight as dl
from tvm.target import Target

from kiln.runtime.tvm.schedules.fastmath import fast_math_passes

from .activation_products import bf16_activation_products
from .amx import bf16_products
from .amx_epilogue import amx_epilogues
from .attention_fusion import fused_attention
from .const_fold import fold_constant_kernels
from .conv_fold import fold_conv_epilogues
from .conv_regions import block_conv_regions
from .cpu import cpu_model
from .donation import donate_inputs
from .matmul_layout import pack_matmul_weights
from .memory_plan import bound_batches
from .norm_rows import row_norms
from .output_fusion import fuse_output_producers
from .plane_window import plane_windows
from .pool_rows import row_pools
from .relax_rewrite import marked_kernels
from .schedules import Safe, default_cpu_rules
from .selection_fusion import fuse_into_selections
from .symbolic_patterns import symbolic_injective
from .target import configure_threads
from .tir_pipeline import CPU_TIR_PIPELINE
from .vnni_matmul import vnni_int8_matmuls


def _run_in_target(target: Target, passes: list[tvm.transform.Pass], name: str) -> tvm.transform.Pass:
    """One module pass running `passes` in order inside `with target:` (passes query the current target)."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


@tvm.transform.module_pass(opt_level=0, name="KilnNoAliasShapeFuncs")
def _noalias_shape_funcs(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Mark the VM's shape functions `tirx.noalias` (they take one buffer, the shape heap).

    `VMShapeLower` adds a `shape_func` PrimFunc whenever a shape is symbolic, without that attribute. With
    one such function in the module, TVM 0.27's LLVM build no longer emits the kernels' noalias, 64-byte
    aligned `*_compute_` bodies, so LLVM must assume every store may alias the inputs and spills the
    register tiles of the matmul/conv kernels: dynamic-batch builds ran 2-2.5x slower than static ones.
    """
    return marked_kernels(mod, lambda func, attrs: "tirx.is_host_func" in attrs and "tirx.noalias" not in attrs
                          and len(func.params) <= 1, "tirx.noalias", True)


def cpu_fusion_passes(target: Target, fast_math: bool = True, block_convs: bool = True, precision: str = "f32"
                      ) -> list[tvm.transform.Pass]:
    """The CPU pipeline up to fusion: what MetaSchedule tunes, so its database keys match the build's kernels.
    `block_convs=False` keeps every conv NCHW (the A/B of `bench/worst_kernels.py`, the width-tile tests);
    `precision` is the build's resolved mode (a bf16 build's convs may run a bf16 kernel)."""
    return [relax.transform.DeadCodeElimination(),  # a weight decoded inside its matmul leaves its dequantize unused
            relax.transform.EliminateCommonSubexpr(),  # one bf16 cast of x for q, k and v (each rule casts its own)
            # softmax(s q kᵀ) v as one kernel (its exp is fast), its products bf16 in a bf16 build
            *([fused_attention(target, precision == "bf16")] if fast_math else []),
            # a bf16 build's products of two activations the lowering left in f32 for the line above
            *([bf16_activation_products(target)] if precision == "bf16" and bf16_products(target) else []),
            *(fast_math_passes(cpu_model(target).lanes()) if fast_math else []),
            *cpu_passes.library_dispatch_passes(target),
            *([block_conv_regions(target, precision)] if block_convs else []),  # NCHW[x]c regions (CPU model)
            fold_conv_epilogues(target),  # a bf16 conv's bias, activation, residual and next casts in its store
            plane_windows(target),  # the NCHW depthwise convs left, plane by plane
            row_pools(target),  # the NCHW pools left, down columns then along rows
            row_norms(target),  # layer and RMS norms over a last axis, a row in vectors
            pack_matmul_weights(target),  # 2-D matmul weights in the panel order of the register tile
            vnni_int8_matmuls(target),  # int8 products of bound Q8 codes as vpdpbusd kernels where the CPU has VNNI
            *_with_output_fusion(cpu_passes.legalize_passes(target)),
            amx_epilogues(target)]  # a tile product's bias, activation, residual and cast in the kernel's store


def _with_output_fusion(passes: list[tvm.transform.Pass]) -> list[tvm.transform.Pass]:
    """TVM's legalize-and-fuse passes with `symbolic_injective` and `fold_constant_kernels` just before FoldConstant
    (the first fixes what AnnotateTIROpPattern calls opaque; the second is one build for all constant kernels) and
    `fuse_output_producers` and `fuse_into_selections` just before FuseTIR."""
    passes = _insert_before(passes, "FoldConstant", symbolic_injective)
    passes = _insert_before(passes, "FoldConstant", fold_constant_kernels())
    passes = _insert_before(passes, "FuseTIR", fuse_output_producers)
    return _insert_before(passes, "FuseTIR", fuse_into_selections)


def _insert_before(passes: list[tvm.transform.Pass], name: str, new: tvm.transform.Pass) -> list[tvm.transform.Pass]:
    """`passes` with `new` just before TVM's pass called `name`."""
    at = next(i for i, p in enumerate(passes) if p.info.name == name)
    return [*passes[:at], new, *passes[at:]]


def cpu_pipeline(
    target: Target,
    fast_math: bool = True,
    extra_schedule_passes: Sequence[tvm.transform.Pass] = (),
    block_convs: bool = True,
    donated: Mapping[str, Collection[int]] | None = None,
    batch_bounds: Mapping[str, Mapping[str, int]] | None = None,
    precision: str = "f32",
) -> tvm.transform.Pass:
    """The relax pipeline for an LLVM target; also sizes TVM's thread pool to all cores.

    `extra_schedule_passes` run after fusion and before kiln's rules, so whatever they schedule (for
    example `relax.transform.MetaScheduleApplyDatabase`, which must be built inside `with target:`) wins
    and the rules cover the rest. `donated` names, per function, the inputs (by position) its caller gives up: the
    kernels may write their results into them (`donation.py`). `batch_bounds` gives, per function, its batch vars'
    largest values, for which the static memory plan sizes shared storage (`memory_plan.py`). `precision` is the
    build's resolved precision mode.
    """
    configure_threads()
    passes = [
        *cpu_fusion_passes(target, fast_math, block_convs, precision),
        *extra_schedule_passes,
        dl.ApplyDefaultSchedule(*default_cpu_rules(target)),
        *([donate_inputs(donated)] if donated else []),  # results written into the inputs a caller gives up
        *([bound_batches(batch_bounds)] if batch_bounds else []),  # storage shared over a bounded dynamic batch
        *cpu_passes.dataflow_lower_passes(target),
        *cpu_passes.finalize_passes(target),
        _noalias_shape_funcs,
    ]
    return _run_in_target(target, passes, "KilnCPUPipeline")


def cpu_compile(mod: tvm.IRModule | tvm.tirx.PrimFunc, target: Target,
                relax_pipeline: tvm.transform.Pass | str = "default") -> tvm.runtime.Executable:
    """`tvm.compile` for an LLVM target through kiln's TIR pipeline (`tir_pipeline.CPU_TIR_PIPELINE`): every build of
    kiln's CPU kernels, so the kernels calibrated, tuned, benched and tested are the ones a compile runs."""
    return tvm.compile(mod, target=target, relax_pipeline=relax_pipeline, tir_pipeline=CPU_TIR_PIPELINE)


def cuda_pipeline(target: Target) -> tvm.transform.Pass:
    """The relax pipeline for a CUDA target, scheduled by TVM's GPU dlight rules (first match wins).

    `dl.gpu.Transpose` is left out: on a dynamic batch it emits a symbolic-size local buffer that CUDA
    codegen rejects ("Can only handle constant size stack allocation").
    """
    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction()]
    rules += [dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    schedule = dl.ApplyDefaultSchedule(*(Safe(rule) for rule in rules))
    passes = [
        *cuda_passes.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        schedule,
        *cuda_passes.dataflow_lower_passes(target),
        *cuda_passes.finalize_passes(target),
    ]
    return _run_in_target(target, passes, "KilnCUDAPipeline")
