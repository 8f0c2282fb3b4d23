"""Models from the ecosystem (issue 12, "Tests, against suites nobody here wrote"): "torchvision-style ResNet,
MobileNetV3, EfficientNet and a ViT written in plain torch, a BERT-style encoder, exported with torch.onnx.export
at two opsets with dynamic batch; each imported, compiled, and compared with onnxruntime and torch".

Built in `torch_zoo` with random weights. Each case imports the file and runs kiln's forward at two batch sizes
against onnxruntime on the same file and torch on the same weights; compiling through TVM costs ~10 s a model, so
that part runs with `KILN_ECOSYSTEM_COMPILE=1`. A case kiln cannot import yet is an expected failure saying why
(strict: it turns red once it imports, to drop the mark).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch_zoo
import tvm

import kiln
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.target import cpu_target

OPSETS = (13, 17)
_FAILS: dict[str, str] = {}  # why a model still fails to import
_COMPILE = os.environ.get("KILN_ECOSYSTEM_COMPILE") == "1"
_COMPILE_FAILS: dict[str, str] = {}  # why a model that imports and runs still fails to compile


def _marks(name: str) -> list:
    if name in _FAILS:
        return [pytest.mark.xfail(strict=True, raises=kiln.KilnError, reason=_FAILS[name])]
    if name in _COMPILE_FAILS:
        return [pytest.mark.xfail(_COMPILE, strict=True, raises=kiln.KilnError, reason=_COMPILE_FAILS[name])]
    return []


CASES = [pytest.param(name, opset, id=f"{name}-opset{opset}", marks=_marks(name))
         for name in ("token_mlp", "resnet", "mobilenetv3", "efficientnet", "vit", "bert", "yolo") for opset in OPSETS]
# issue 12, "a small GPT-2-style decoder ... exported with dynamic batch and sequence": torch exports its causal
# `triu` only from opset 14 (Trilu)
CASES += [pytest.param("gpt2", opset, id=f"gpt2-opset{opset}", marks=_marks("gpt2")) for opset in (14, 17)]


@functools.cache
def _zoo() -> dict:
    return torch_zoo.zoo()


@functools.cache
def _exported(name: str, opset: int) -> bytes:
    model, inputs, names = _zoo()[name]
    return torch_zoo.export(model, inputs, names, opset, torch_zoo.DYNAMIC_AXES.get(name))


def _batch(name: str, n: int) -> list[np.ndarray]:
    """Inputs at batch n: the example's rows repeated and perturbed (ids stay in the vocabulary); a dynamic
    sequence (axis 1) is 3 + 2n long, so one import serves two lengths too."""
    _, inputs, _ = _zoo()[name]
    rng = np.random.default_rng(n)
    seq = 1 in torch_zoo.DYNAMIC_AXES.get(name, {})
    out = []
    for t in inputs:
        a = np.resize(t.numpy(), (n, *((3 + 2 * n,) if seq else ()), *t.shape[1 + seq:]))
        out.append(a + rng.standard_normal(a.shape).astype(a.dtype) * 0.1 if a.dtype.kind == "f" else a)
    return out


@pytest.mark.parametrize("name, opset", CASES)
def test_imported_model_matches_onnxruntime_and_torch(name: str, opset: int):
    model, _, names = _zoo()[name]
    data = _exported(name, opset)
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (1, 3):  # dynamic batch (and sequence): one import serves both
        xs = _batch(name, n)
        (want,) = session.run(None, dict(zip(names, xs)))
        with torch.no_grad():
            reference = model(*(torch.from_numpy(x) for x in xs)).numpy()
        np.testing.assert_allclose(want, reference, rtol=1e-4, atol=1e-4)
        got = imported(*xs).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        if _COMPILE and n == 3:
            args = imported.graph.functions["forward"].args
            exe = kiln.compile(imported, *(a.type for a in args))
            np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=1e-3, atol=1e-4)



def test_a_dynamic_batch_export_compiles_to_the_blocked_and_packed_kernels():
    """Issue 13 (imported models fast where their user runs them): torch's export with a dynamic batch, as every
    case here has it, builds the kernels a static batch gets: blocked convs, the squeeze-excite and hard-swish inside
    the region, the classifier's transposed Gemm weight packed; one build against onnxruntime at batch 1 and 3
    (before, a symbolic batch left every conv NCHW: MobileNetV3-Large 3.3x onnxruntime)."""
    data = _exported("mobilenetv3", 17)
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    target = cpu_target()
    with target:
        fused = tvm.transform.Sequential(cpu_fusion_passes(target))(lower(imported.graph, target=target).module)
    kernels = [g.name_hint for g, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("conv2d_nchw_blocked" in k for k in kernels) and any("matmul_packed" in k for k in kernels), kernels
    nchw = [k for k in kernels if "conv2d" in k and "blocked" not in k]
    assert len(nchw) <= 1, nchw  # the stem at most: its 8 channels fill half an AVX-512 vector, NCHW by the rule
    exe = kiln.compile(imported, *(a.type for a in imported.graph.functions["forward"].args))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (1, 3):
        xs = _batch("mobilenetv3", n)
        (want,) = session.run(None, dict(zip(_zoo()["mobilenetv3"][2], xs)))
        np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["resnet", "efficientnet"])
def test_dynamic_batch_exports_build_and_match_onnxruntime(name: str):
    """The zoo's CNNs with a lone stem pool or depthwise conv (NCHW plane kernels) beside blocked regions over a
    symbolic batch: they build, and match onnxruntime at batch 1 and 3 (a symbolic batch in the plane kernels once
    broke both builds)."""
    data = _exported(name, 17)
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    exe = kiln.compile(imported, *(a.type for a in imported.graph.functions["forward"].args))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (1, 3):
        xs = _batch(name, n)
        (want,) = session.run(None, dict(zip(_zoo()[name][2], xs)))
        np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=1e-3, atol=1e-4)
