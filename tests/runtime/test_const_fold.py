"""`fold_constant_kernels`: a bound build folds its constant kernels (batch-norm statistics, blocked per-channel
packs) in one LLVM build, to the module Relax's FoldConstant alone makes, and computes what torch computes.

Issue 13: "cold compile of ResNet-50 < 20 s"; FoldConstant's one build per folded kernel took 98 of its 109 s."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax

import kiln
from kiln import nn
from kiln.frontend.trace import trace
from kiln.runtime.tvm import const_fold
from kiln.runtime.tvm.compile import lowering_input
from kiln.runtime.tvm.const_fold import fold_constant_kernels
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.target import cpu_target

pytestmark = pytest.mark.usefixtures("module_cache")

WIDTHS = (4, 8, 16)
X_TYPE = ((1, WIDTHS[0], 8, 8), "f32")


class ConvNorms(kiln.Module):
    """Conv, batch norm, ReLU, twice: every norm's scale and shift are kernels on constants."""

    def __init__(self) -> None:
        self.convs = [nn.Conv2d(a, b, kernel_size=3, padding=1) for a, b in zip(WIDTHS, WIDTHS[1:])]
        self.norms = [nn.BatchNorm2d(b) for b in WIDTHS[1:]]

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = nn.functional.relu(norm(conv(x)))
        return x


def trained_state() -> dict[str, np.ndarray]:
    """Weights and running statistics far from the initial ones (a unit variance folds to nothing to see)."""
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in ConvNorms().state_dict().items()}
    for i in range(len(WIDTHS) - 1):
        state[f"norms.{i}.running_var"] = rng.uniform(0.5, 2.0, WIDTHS[i + 1]).astype(np.float32)
    return state


def model() -> ConvNorms:
    return ConvNorms().load_state_dict(trained_state()).valid()


def before_fold() -> tuple[tvm.IRModule, tvm.target.Target]:
    """The bound module as the CPU pipeline has it just before its constant folding."""
    target = cpu_target()
    passes = cpu_fusion_passes(target)
    at = next(i for i, p in enumerate(passes) if p.info.name == "KilnFoldConstantKernels")
    with target:
        lowered = lower(lowering_input(trace(model(), X_TYPE)), "bound").module
        return tvm.transform.Sequential(passes[:at])(lowered), target


def test_fold_then_fold_constant_is_fold_constant() -> None:
    """The pass folds what FoldConstant would, with the same kernels for the same target: followed by FoldConstant
    (which then only inlines), the module is structurally FoldConstant's own, constants' bytes included."""
    mod, target = before_fold()
    with target:
        want = relax.transform.FoldConstant()(mod)
        got = relax.transform.FoldConstant()(fold_constant_kernels()(mod))
    assert tvm_ffi.structural_equal(got, want)


def test_kernels_tvm_cannot_run_here_are_left_to_fold_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build or run that fails leaves the module as it was (FoldConstant then tries each kernel itself)."""
    def fail(*_args: object) -> None:
        raise RuntimeError("no LLVM here")

    mod, target = before_fold()
    monkeypatch.setattr(const_fold, "_evaluate", fail)
    with target:
        assert tvm_ffi.structural_equal(fold_constant_kernels()(mod), mod)


@pytest.mark.parametrize("target", ["llvm", "llvm -mcpu=haswell", "llvm -mcpu=skylake-avx512"])
def test_every_constant_kernel_folds_in_one_build(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """A bound compile makes two LLVM builds: the constant kernels, then the library (FoldConstant made one per
    folded kernel: 31 builds in all for these two norms), also where 16-lane blocks pad the 8 channels' packs to
    more elements than they read (AVX-512: they had gone to FoldConstant, one build each)."""
    builds = []
    module = sys.modules["tvm.tirx.build"]  # FoldConstant reaches it through TVM's registry, not `tvm.tirx.build`
    real = module.codegen_build
    monkeypatch.setattr(module, "codegen_build", lambda *a, **k: builds.append(1) or real(*a, **k))
    kiln.compile(model(), X_TYPE, target=target)
    assert len(builds) == 2, len(builds)


def test_folded_build_is_torch() -> None:
    """Inference batch norm, torch.nn.functional.batch_norm(training=False) after conv2d (padding 1), then ReLU."""
    x = np.random.default_rng(1).standard_normal(X_TYPE[0]).astype(np.float32)
    got = np.asarray(kiln.compile(model(), X_TYPE)(x))
    s = {k: torch.from_numpy(v) for k, v in trained_state().items()}
    want = torch.from_numpy(x)
    for i in range(len(WIDTHS) - 1):
        want = torch.nn.functional.conv2d(want, s[f"convs.{i}.weight"], s[f"convs.{i}.bias"], padding=1)
        want = torch.relu(torch.nn.functional.batch_norm(want, s[f"norms.{i}.running_mean"],
                                                         s[f"norms.{i}.running_var"], s[f"norms.{i}.gamma"],
                                                         s[f"norms.{i}.beta"], training=False, eps=1e-5))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
