"""A BERT-style encoder exported by torch with dynamic batch AND sequence (issue 12: "Dynamic dims stay symbolic (a
`batch`/`height`/`width` dim becomes a `?` dim and a TVM symbolic shape)"): its attention reshapes
[b, s, 3d] -> [b, s, 3, heads, d/heads] keep two run-time dims and its positions are `arange(seq)`. One import and
one TVM build serve two (batch, seq) pairs, matching onnxruntime on the same file (and it torch). The build takes
~20 s even for one encoder layer, so, as in `test_onnx_ecosystem`, it runs with `KILN_ECOSYSTEM_COMPILE=1`
(`tests/runtime/test_reshape_copy.py` builds a two-symbolic-dim reshape on every run). A GPT-2-style decoder with
the same dynamic dims builds in bf16 on every run (a few seconds) where the host has AVX512-BF16."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch_zoo

import kiln

NAMES = ["input_ids", "attention_mask"]
SIZES = ((1, 5), (3, 8))  # (batch, seq); 8 is the position table's length


def _inputs(b: int, s: int) -> list[np.ndarray]:
    rng = np.random.default_rng(b * 10 + s)
    mask = np.ones((b, s), np.int64)
    mask[-1, s // 2:] = 0
    return [rng.integers(0, 50, (b, s)), mask]


@pytest.fixture(scope="module")
def bert() -> tuple[torch.nn.Module, bytes]:
    torch.manual_seed(0)
    model = torch_zoo.Bert(depth=1).eval()
    f = io.BytesIO()
    axes = {n: {0: "batch", 1: "seq"} for n in NAMES} | {"out": {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(torch.from_numpy(x) for x in _inputs(2, 8)), f, opset_version=17,
                          input_names=NAMES, output_names=["out"], dynamic_axes=axes, dynamo=False)
    return model, f.getvalue()


def test_bert_with_dynamic_batch_and_sequence_compiles_once_and_matches_onnxruntime(bert):
    model, data = bert
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    args = imported.graph.functions["forward"].args
    # both inputs carry ONNX's dim_params `batch` and `seq`: one named dim each, shared by the two inputs
    assert [str(a.type) for a in args] == ["tensor<?{batch}x?{seq}xi64>", "tensor<?{batch}x?{seq}xi64>"]
    compile_too = os.environ.get("KILN_ECOSYSTEM_COMPILE") == "1"
    exe = kiln.compile(imported, *(a.type for a in args)) if compile_too else None
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for b, s in SIZES:
        xs = _inputs(b, s)
        (want,) = session.run(None, dict(zip(NAMES, xs)))
        with torch.no_grad():
            np.testing.assert_allclose(want, model(*map(torch.from_numpy, xs)).numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(imported(*xs).numpy(), want, rtol=1e-4, atol=1e-5)
        if exe is not None:
            np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(os.environ.get("KILN_ECOSYSTEM_COMPILE") != "1", reason="a ~20 s build: KILN_ECOSYSTEM_COMPILE=1")
def test_bert_with_dynamic_batch_only_builds():
    """With the sequence static, reshapes infer the batch as -1; the build must see `b * 384 // 384` as `b` so the
    scores' batch unifies with the mask's (before: "add: Relax cannot infer the result shape")."""
    model, example, names = torch_zoo.zoo()["bert"]
    data = torch_zoo.export(model, example, names, 17)
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    exe = kiln.compile(imported, *(a.type for a in imported.graph.functions["forward"].args))
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for b in (1, 3):
        xs = [np.resize(t.numpy(), (b, *t.shape[1:])) for t in example]
        (want,) = session.run(None, dict(zip(names, xs)))
        np.testing.assert_allclose(np.asarray(exe(*xs)), want, rtol=1e-3, atol=1e-4)


def _has_dot() -> bool:
    from kiln.runtime.tvm.cpu import cpu_model
    from kiln.runtime.tvm.dot_bf16 import has_dot
    from kiln.runtime.tvm.target import cpu_target

    return has_dot(cpu_model(cpu_target()))


@pytest.mark.skipif(not _has_dot(), reason="the host CPU has no AVX512-BF16: the vdpbf16ps kernels cannot run")
def test_a_decoder_over_a_dynamic_batch_and_sequence_runs_bf16_products() -> None:
    """The zoo's GPT-2-style decoder (batch and sequence dynamic) built once in bf16, whose products' M = batch x
    seq is symbolic (unpadded: rows past M repeat M's last in a register tile taller than M, as at 1 x 3), run at
    (1, 3), (2, 5) and (3, 11) against onnxruntime's f32: a relative L2 distance of bf16's order (its operands
    rounded to 2^-8), not f32's."""
    model, example, names = torch_zoo.zoo()["gpt2"]
    data = torch_zoo.export(model, example, names, 17, torch_zoo.DYNAMIC_AXES["gpt2"])
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    exe = kiln.compile(imported, *(a.type for a in imported.graph.functions["forward"].args), precision="bf16!")
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for b, s in ((1, 3), (2, 5), (3, 11)):
        ids = np.random.default_rng(b * s).integers(0, 50, (b, s))
        (want,) = session.run(None, {names[0]: ids})
        distance = np.linalg.norm(np.asarray(exe(ids)) - want) / np.linalg.norm(want)
        assert 1e-4 < distance < 2e-2, (b, s, distance)
