"""nn layers against torch 2.13 with identical weights (torch is the oracle), eager and traced."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kiln
from kiln import nn
from kiln.ir import interpret

RNG = np.random.default_rng(0)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a)


def w(param: kiln.Param) -> np.ndarray:
    return param.val().numpy()


def check(layer: kiln.Module, x: np.ndarray, expected: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Eager forward and the traced graph run by the interpreter both match torch; batch dim traced dynamic."""
    np.testing.assert_allclose(layer(kiln.tensor(x)).numpy(), expected, rtol=rtol, atol=atol)
    dtype = kiln.ir.DType.from_numpy(x.dtype)
    graph = kiln.trace(layer, ((None, *x.shape[1:]), dtype))
    np.testing.assert_allclose(interpret(graph, [x])[0], expected, rtol=rtol, atol=atol)


def test_linear_uses_burn_layout_and_init_bounds():
    layer = nn.Linear(5, 3)
    assert layer.weight.lazy_shape() == (5, 3)
    bound = 1 / math.sqrt(5)
    assert np.abs(w(layer.weight)).max() <= bound and np.abs(w(layer.bias)).max() <= bound
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    expected = torch.nn.functional.linear(t(x), t(w(layer.weight)).T, t(w(layer.bias))).numpy()
    check(layer, x, expected)
    no_bias = nn.Linear(5, 3, bias=False)
    check(no_bias, x, x @ w(no_bias.weight))


def test_embedding():
    layer = nn.Embedding(10, 4)
    idx = RNG.integers(0, 10, (3, 5))
    check(layer, idx, torch.nn.functional.embedding(t(idx), t(w(layer.weight))).numpy())


@pytest.mark.parametrize("cls", [nn.LayerNorm, nn.RMSNorm])
def test_norms(cls):
    layer = cls(6)
    x = (RNG.standard_normal((2, 3, 6)) * 3 + 1).astype(np.float32)
    if cls is nn.LayerNorm:
        expected = torch.nn.functional.layer_norm(t(x), (6,), t(w(layer.gamma)), t(w(layer.beta)), 1e-5)
    else:
        expected = torch.nn.functional.rms_norm(t(x), (6,), t(w(layer.gamma)), 1e-5)
    check(layer, x, expected.numpy())


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"dilation": 2, "groups": 2}])
def test_conv2d(kwargs):
    layer = nn.Conv2d(4, 6, 3, **kwargs)
    x = RNG.standard_normal((2, 4, 9, 9)).astype(np.float32)
    expected = torch.nn.functional.conv2d(t(x), t(w(layer.weight)), t(w(layer.bias)), **kwargs).numpy()
    check(layer, x, expected, atol=1e-4)


def test_conv1d():
    layer = nn.Conv1d(3, 5, 4, stride=2, padding=1)
    x = RNG.standard_normal((2, 3, 11)).astype(np.float32)
    expected = torch.nn.functional.conv1d(t(x), t(w(layer.weight)), t(w(layer.bias)), stride=2, padding=1)
    check(layer, x, expected.numpy(), atol=1e-4)


def test_pools():
    x = RNG.standard_normal((2, 3, 9, 7)).astype(np.float32)
    check(nn.MaxPool2d(3, stride=2, padding=1), x, torch.nn.functional.max_pool2d(t(x), 3, 2, 1).numpy())
    check(nn.AvgPool2d(2, stride=2), x, torch.nn.functional.avg_pool2d(t(x), 2, 2).numpy())
    check(nn.AdaptiveAvgPool2d((4, 3)), x, torch.nn.functional.adaptive_avg_pool2d(t(x), (4, 3)).numpy())
    assert nn.MaxPool2d(2)(kiln.tensor(x)).shape == (2, 3, 8, 6)  # Burn's default stride is 1


def _copy_attention(ours: nn.MultiHeadAttention, theirs: torch.nn.MultiheadAttention) -> None:
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([t(w(lin.weight)).T for lin in (ours.query, ours.key, ours.value)]))
        theirs.in_proj_bias.copy_(torch.cat([t(w(lin.bias)) for lin in (ours.query, ours.key, ours.value)]))
        theirs.out_proj.weight.copy_(t(w(ours.output.weight)).T)
        theirs.out_proj.bias.copy_(t(w(ours.output.bias)))


def test_multi_head_attention_matches_torch():
    ours = nn.MultiHeadAttention(16, 4).valid()
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    _copy_attention(ours, theirs)
    x = RNG.standard_normal((2, 5, 16)).astype(np.float32)
    expected = theirs(t(x), t(x), t(x), need_weights=False)[0].detach().numpy()
    check(ours, x, expected)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_matches_torch(norm_first):
    ours = nn.TransformerEncoderLayer(16, 4, 32, norm_first=norm_first).valid()
    theirs = torch.nn.TransformerEncoderLayer(16, 4, 32, activation="gelu", batch_first=True,
                                              norm_first=norm_first).eval()
    _copy_attention(ours.attention, theirs.self_attn)
    with torch.no_grad():
        for src, dst in ((ours.ff_in, theirs.linear1), (ours.ff_out, theirs.linear2)):
            dst.weight.copy_(t(w(src.weight)).T)
            dst.bias.copy_(t(w(src.bias)))
    x = RNG.standard_normal((3, 5, 16)).astype(np.float32)
    check(ours, x, theirs(t(x)).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_dropout_is_active_in_training_and_identity_after_valid():
    layer = nn.Dropout(0.5)
    x = np.ones((64, 64), np.float32)
    out = layer(kiln.tensor(x)).numpy()
    assert set(np.unique(out)) <= {0.0, 2.0} and 0.4 < (out == 0).mean() < 0.6
    np.testing.assert_array_equal(layer.valid()(kiln.tensor(x)).numpy(), x)
    with pytest.raises(ValueError, match="probability"):
        nn.Dropout(1.0)


def test_sequential_paths_and_forward():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert [p for p, _ in model.leaves()] == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    l0, l2 = model.layers[0], model.layers[2]
    expected = np.maximum(x @ w(l0.weight) + w(l0.bias), 0) @ w(l2.weight) + w(l2.bias)
    check(model, x, expected)


def test_batch_norm_training_updates_running_stats_like_torch_and_valid_uses_them():
    ours = nn.BatchNorm2d(3)
    theirs = torch.nn.BatchNorm2d(3)
    x = (RNG.standard_normal((4, 3, 5, 5)) * 2 + 1).astype(np.float32)
    np.testing.assert_allclose(ours(kiln.tensor(x)).numpy(), theirs(t(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w(ours.running_mean), theirs.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(w(ours.running_var), theirs.running_var.numpy(), rtol=1e-5)
    x2 = RNG.standard_normal((2, 3, 5, 5)).astype(np.float32)
    check(ours.valid(), x2, theirs.eval()(t(x2)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_batch_norm_stats_are_buffers_that_never_require_grad():
    bn = nn.BatchNorm1d(4, device=kiln.Device("cpu").autodiff()).unfreeze().set_require_grad(True)
    assert bn.gamma.grad and not bn.running_mean.grad and not bn.running_var.grad
    assert bn.num_params() == 16
    with pytest.raises(kiln.ir.ShapeError, match="rank-3"):
        bn(kiln.tensor(np.zeros((2, 4), np.float32)))


def test_no_grad_keeps_batch_norm_updating_and_freeze_stops_it():
    """no_grad: "batch-normalization running statistics retain their current behavior"; freeze stops them."""
    x = RNG.standard_normal((4, 2, 3)).astype(np.float32) + 5
    kept = nn.BatchNorm1d(2).no_grad()
    kept(kiln.tensor(x))
    assert np.all(w(kept.running_mean) > 0.1)
    frozen = nn.BatchNorm1d(2).freeze()
    frozen(kiln.tensor(x))
    np.testing.assert_array_equal(w(frozen.running_mean), np.zeros(2, np.float32))


def test_valid_turns_batch_norm_into_an_affine_op_after_canonicalize():
    from kiln.passes import PassManager
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    graph = PassManager.parse("canonicalize,dce").run(kiln.trace(model.valid(), ((None, 3, 8, 8), "f32")))
    kinds = [op.kind for op in graph.functions["forward"].ops]
    assert "batch_norm" not in kinds and "mul" in kinds and "conv2d" in kinds
    x = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(interpret(graph, [x])[0], model.valid()(kiln.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)
