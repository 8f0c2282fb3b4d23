"""The autodiff pass on whole models: gradients of every trainable parameter against torch autograd with the same
weights (float64), the forward_backward result convention, frozen and derived (LoRA) parameters, and the
program passes running over the gradient IR afterwards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.ir import Builder, DType, Graph, Interpreter, PassError, verify
from kiln.passes import PassManager
from kiln.passes.autodiff import Autodiff, gradient_name

RNG = np.random.default_rng(7)
F64 = DType.f64


def r(*shape: int, scale: float = 0.5) -> np.ndarray:
    return RNG.standard_normal(shape) * scale


def run_backward(graph: Graph, inputs: list[np.ndarray], pipeline: str = "autodiff") -> tuple[Graph, list]:
    out = PassManager.parse(pipeline, verify_each=True).run(graph)
    return out, list(Interpreter(out).run(inputs, "forward_backward"))


def assert_grads(graph: Graph, results: list[np.ndarray], torch_params: dict[str, torch.Tensor],
                 n_other: int = 0) -> None:
    """forward_backward's gradient results are named and ordered as the trainable params and match torch."""
    fn = graph.functions["forward_backward"]
    trainable = [p.name for p in graph.params.values() if p.grad]
    assert [v.name for v in fn.results[1 + n_other:]] == [gradient_name(p) for p in trainable]
    assert sorted(trainable) == sorted(torch_params)
    for name, got in zip(trainable, results[1 + n_other:]):
        want = torch_params[name].grad
        want = np.zeros(got.shape) if want is None else want.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10, err_msg=name)


def leaves(values: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------------------
# MLP with cross-entropy


MLP = {"fc1.weight": r(8, 16), "fc1.bias": r(16), "fc2.weight": r(16, 5), "fc2.bias": r(5)}


def mlp(one_hot: bool, frozen: tuple[str, ...] = ()) -> Graph:
    """linear/relu/linear/log_softmax, cross-entropy by gather over the labels or by a one-hot product; the
    logits are a second result."""
    b = Builder("MLP")
    x = b.input("x", ((None, 8), "f64"))
    target = b.input("target", ((None, 5), "f64") if one_hot else ((None, 1), "i64"))
    p = {n: b.param(n, v.shape, F64, data=v, grad=n not in frozen) for n, v in MLP.items()}
    h = b.relu(b.linear(x, p["fc1.weight"], p["fc1.bias"]))
    logits = b.linear(h, p["fc2.weight"], p["fc2.bias"])
    logp = b.log_softmax(logits, axis=-1)
    picked = b.sum(b.mul(logp, target), axes=(1,)) if one_hot else b.gather(logp, target, axis=1)
    b.ret(b.neg(b.mean(picked)), logits)
    return b.build()


def torch_mlp(x: np.ndarray, labels: np.ndarray, params: dict[str, torch.Tensor]) -> torch.Tensor:
    h = torch.relu(torch.from_numpy(x) @ params["fc1.weight"] + params["fc1.bias"])
    logits = h @ params["fc2.weight"] + params["fc2.bias"]
    return F.cross_entropy(logits, torch.from_numpy(labels))


@pytest.mark.parametrize("one_hot", [False, True], ids=["gather", "one-hot"])
def test_mlp_cross_entropy_matches_torch(one_hot: bool) -> None:
    x, labels = r(6, 8, scale=1.0), RNG.integers(0, 5, 6)
    target = np.eye(5)[labels] if one_hot else labels.reshape(-1, 1)
    graph, results = run_backward(mlp(one_hot), [x, target])
    params = leaves(MLP)
    loss = torch_mlp(x, labels, params)
    loss.backward()
    np.testing.assert_allclose(results[0], loss.item(), rtol=1e-12)
    np.testing.assert_array_equal(results[1], Interpreter(graph).run([x, target])[1])  # the logits, unchanged
    assert_grads(graph, results, params, n_other=1)


def _kinds(graph: Graph) -> list[str]:
    return [op.kind for op in graph.functions["forward_backward"].ops]


def test_frozen_params_get_no_gradient_and_cost_nothing() -> None:
    """A frozen weight loses its result and its backward matmul; freezing the whole first layer also drops the
    gradient flowing into it (dh = g @ W2^T)."""
    x, labels = r(4, 8), RNG.integers(0, 5, (4, 1))
    full, _ = run_backward(mlp(False), [x, labels], "autodiff,cse,dce")
    part, results = run_backward(mlp(False, ("fc1.weight",)), [x, labels], "autodiff,cse,dce")
    layer, _ = run_backward(mlp(False, ("fc1.weight", "fc1.bias")), [x, labels], "autodiff,cse,dce")
    names = [v.name for v in part.functions["forward_backward"].results]
    assert names[2:] == ["grad.fc1.bias", "grad.fc2.weight", "grad.fc2.bias"]
    assert _kinds(full).count("matmul") == 3  # d fc2.weight, d h, d fc1.weight
    assert _kinds(part).count("matmul") == 2
    assert _kinds(layer).count("matmul") == 1
    assert len(_kinds(layer)) < len(_kinds(part)) < len(_kinds(full))
    params = leaves(MLP)
    params["fc1.weight"].requires_grad_(False)
    torch_mlp(x, labels.reshape(-1), params).backward()
    assert_grads(part, results, {k: v for k, v in params.items() if k != "fc1.weight"}, n_other=1)


# ---------------------------------------------------------------------------------------------------------------
# transformer block


D, T, HEADS, HIDDEN = 8, 4, 2, 16
BLOCK = {"ln1.gamma": 1 + r(D), "ln1.beta": r(D), "attn.q": r(D, D), "attn.k": r(D, D), "attn.v": r(D, D),
         "attn.out": r(D, D), "attn.out_bias": r(D), "ln2.gamma": 1 + r(D), "ln2.beta": r(D),
         "mlp.fc1": r(D, HIDDEN), "mlp.fc1_bias": r(HIDDEN), "mlp.fc2": r(HIDDEN, D), "mlp.fc2_bias": r(D)}
CAUSAL = np.tril(np.ones((T, T), dtype=bool))


def transformer_block(dtype: DType = F64) -> Graph:
    """Pre-norm attention block (causal mask, 2 heads) and GELU MLP, with residuals; loss = mean(y * y)."""
    b = Builder("Block")
    x = b.input("x", ((None, T, D), dtype))
    p = {n: b.param(n, v.shape, dtype, data=v.astype(dtype.numpy)) for n, v in BLOCK.items()}
    dh = D // HEADS
    scalar = dtype.numpy.type

    def heads(v):
        return b.transpose(b.reshape(v, shape=(-1, T, HEADS, dh)), perm=(0, 2, 1, 3))

    h = b.layer_norm(x, p["ln1.gamma"], p["ln1.beta"])
    q, k, v = (heads(b.linear(h, p[f"attn.{n}"])) for n in "qkv")
    scores = b.mul(b.matmul(q, b.transpose(k, perm=(0, 1, 3, 2))), b.constant(scalar(1 / math.sqrt(dh))))
    scores = b.where(b.constant(CAUSAL), scores, b.constant(scalar(-1e9)))
    att = b.matmul(b.softmax(scores, axis=-1), v)
    merged = b.reshape(b.transpose(att, perm=(0, 2, 1, 3)), shape=(-1, T, D))
    x1 = b.add(x, b.linear(merged, p["attn.out"], p["attn.out_bias"]))
    h2 = b.gelu(b.linear(b.layer_norm(x1, p["ln2.gamma"], p["ln2.beta"]), p["mlp.fc1"], p["mlp.fc1_bias"]))
    y = b.add(x1, b.linear(h2, p["mlp.fc2"], p["mlp.fc2_bias"]))
    b.ret(b.mean(b.mul(y, y)))
    return b.build()


def torch_block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    dh = D // HEADS

    def heads(v):
        return v.reshape(-1, T, HEADS, dh).permute(0, 2, 1, 3)

    h = F.layer_norm(x, (D,), p["ln1.gamma"], p["ln1.beta"])
    q, k, v = (heads(h @ p[f"attn.{n}"]) for n in "qkv")
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
    scores = torch.where(torch.from_numpy(CAUSAL), scores, torch.tensor(-1e9, dtype=x.dtype))
    att = torch.softmax(scores, -1) @ v
    x1 = x + att.permute(0, 2, 1, 3).reshape(-1, T, D) @ p["attn.out"] + p["attn.out_bias"]
    h2 = F.gelu(F.layer_norm(x1, (D,), p["ln2.gamma"], p["ln2.beta"]) @ p["mlp.fc1"] + p["mlp.fc1_bias"])
    y = x1 + h2 @ p["mlp.fc2"] + p["mlp.fc2_bias"]
    return (y * y).mean()


def test_transformer_block_matches_torch() -> None:
    x = r(3, T, D, scale=1.0)
    graph, results = run_backward(transformer_block(), [x])
    params = leaves(BLOCK)
    loss = torch_block(torch.from_numpy(x), params)
    loss.backward()
    np.testing.assert_allclose(results[0], loss.item(), rtol=1e-12)
    assert_grads(graph, results, params)


def test_transformer_block_in_float32() -> None:
    """Constants the rules emit take the gradient's dtype: an f32 model differentiates in f32."""
    x = r(2, T, D, scale=1.0).astype(np.float32)
    graph, results = run_backward(transformer_block(DType.f32), [x])
    params = {k: torch.from_numpy(v.astype(np.float32)).requires_grad_(True) for k, v in BLOCK.items()}
    torch_block(torch.from_numpy(x), params).backward()
    for name, got in zip(BLOCK, results[1:]):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, params[name].grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_program_passes_keep_the_gradients() -> None:
    """cse, fold-constants, canonicalize and dce run over the gradient IR, each checked for equivalence."""
    x = r(2, T, D)
    raw, want = run_backward(transformer_block(), [x])
    manager = PassManager.parse("autodiff,cse,fold-constants,canonicalize,dce", verify_each=True,
                                check_equivalence=True)
    cleaned = manager.run(transformer_block())
    got = Interpreter(cleaned).run([x], "forward_backward")
    assert len(cleaned.functions["forward_backward"].ops) < len(raw.functions["forward_backward"].ops)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# LoRA: gradients flow through the derivation to the factors only


def lora_net() -> Graph:
    b = Builder("Lora")
    x = b.input("x", ((None, 6), "f64"))
    w = b.param("fc.weight", (6, 4), F64, data=r(6, 4), autodiff=True)
    bias = b.param("fc.bias", (4,), F64, data=r(4), autodiff=True)
    b.ret(b.sum(b.tanh(b.linear(x, w, bias))))
    graph = PassManager.parse("reparameterize{rank=2 alpha=4.0}").run(b.build())
    params = dict(graph.params)  # b starts at zeros; give it values so that d a is not trivially zero
    params["fc.weight.lora.b"] = params["fc.weight.lora.b"].replace(data=r(2, 4))
    params["fc.weight.lora.a"] = params["fc.weight.lora.a"].replace(data=r(6, 2))
    return graph.replace(params=params)


def test_lora_gradients_reach_only_the_factors() -> None:
    graph = lora_net()
    assert {n for n, p in graph.params.items() if p.grad} == {"fc.weight.lora.a", "fc.weight.lora.b"}
    x = r(5, 6, scale=1.0)
    out, results = run_backward(graph, [x], "autodiff,cse,dce")
    names = [v.name for v in out.functions["forward_backward"].results[1:]]
    assert names == ["grad.fc.weight.lora.a", "grad.fc.weight.lora.b"]
    data = {n: p.data for n, p in graph.params.items()}
    t = leaves({k: data[k] for k in ("fc.weight.lora.a", "fc.weight.lora.b")})
    base, bias = torch.from_numpy(data["fc.weight.base"]), torch.from_numpy(data["fc.bias"])
    w = base + 2.0 * (t["fc.weight.lora.a"] @ t["fc.weight.lora.b"])
    loss = torch.tanh(torch.from_numpy(x) @ w + bias).sum()
    loss.backward()
    np.testing.assert_allclose(results[0], loss.item(), rtol=1e-12)
    assert_grads(out, results, t)


def test_a_trainable_base_gets_the_derived_gradient() -> None:
    """Unfreezing the base: d base = d weight, alongside the factors'."""
    graph = lora_net()
    params = dict(graph.params)
    params["fc.weight.base"] = params["fc.weight.base"].replace(grad=True)
    graph = graph.replace(params=params)
    x = r(3, 6)
    out, results = run_backward(graph, [x])
    data = {n: p.data for n, p in graph.params.items()}
    t = leaves({k: data[k] for k in ("fc.weight.base", "fc.weight.lora.a", "fc.weight.lora.b")})
    w = t["fc.weight.base"] + 2.0 * (t["fc.weight.lora.a"] @ t["fc.weight.lora.b"])
    torch.tanh(torch.from_numpy(x) @ w + torch.from_numpy(data["fc.bias"])).sum().backward()
    assert_grads(out, results, t)


# ---------------------------------------------------------------------------------------------------------------
# conv net: batch norm statistics, dropout masks, flags read at run time


CONV = {"conv.weight": r(4, 1, 3, 3), "conv.bias": r(4), "bn.gamma": 1 + r(4), "bn.beta": r(4),
        "fc.weight": r(4, 3), "fc.bias": r(3)}
RUNNING = {"bn.mean": r(4), "bn.var": 1 + np.abs(r(4))}


def conv_net() -> Graph:
    """conv2d / batch_norm / relu / max_pool2d / adaptive_avg_pool2d / dropout / linear, one-hot NLL; the updated
    running statistics are extra results."""
    b = Builder("ConvNet")
    x = b.input("x", ((None, 1, 6, 6), "f64"))
    target = b.input("target", ((None, 3), "f64"))
    p = {n: b.param(n, v.shape, F64, data=v, autodiff=True) for n, v in CONV.items()}
    stats = {n: b.param(n, v.shape, F64, data=v, grad=False, autodiff=True) for n, v in RUNNING.items()}
    bn_flag, drop_flag = b.flag("bn.training", True), b.flag("drop.training", True)
    h = b.conv2d(x, p["conv.weight"], p["conv.bias"], padding=(1, 1))
    h, mean, var = b.batch_norm(h, p["bn.gamma"], p["bn.beta"], stats["bn.mean"], stats["bn.var"], bn_flag)
    h = b.max_pool2d(b.relu(h), kernel=(2, 2))
    h = b.reshape(b.adaptive_avg_pool2d(h, output_size=(1, 1)), shape=(-1, 4))
    h = b.dropout(h, drop_flag, p=0.25, seed=3)
    logp = b.log_softmax(b.linear(h, p["fc.weight"], p["fc.bias"]), axis=1)
    b.ret(b.neg(b.mean(b.sum(b.mul(logp, target), axes=(1,)))), mean, var)
    return b.build()


def torch_conv_net(x: np.ndarray, labels: np.ndarray, p: dict[str, torch.Tensor], training: bool) -> torch.Tensor:
    h = F.conv2d(torch.from_numpy(x), p["conv.weight"], p["conv.bias"], padding=1)
    rm, rv = (torch.from_numpy(v.copy()) for v in RUNNING.values())
    h = F.batch_norm(h, rm, rv, p["bn.gamma"], p["bn.beta"], training=training, eps=1e-5)
    h = F.adaptive_avg_pool2d(F.max_pool2d(torch.relu(h), 2), 1).reshape(-1, 4)
    if training:
        keep = np.random.default_rng([3, 0]).random(h.shape) >= 0.25  # kiln's mask for run seed 0
        h = h * torch.from_numpy(keep) / 0.75
    return F.cross_entropy(h @ p["fc.weight"] + p["fc.bias"], torch.from_numpy(labels))


@pytest.mark.parametrize("mode", ["train", "valid-after-autodiff"])
def test_conv_net_matches_torch(mode: str) -> None:
    """Training differentiates through the batch statistics and the dropout mask; running `valid` after autodiff
    turns both off in forward_backward too (flags are read at run time), matching torch in eval mode."""
    x, labels = r(5, 1, 6, 6, scale=1.0), RNG.integers(0, 3, 5)
    pipeline = "autodiff" if mode == "train" else "autodiff,valid"
    out = PassManager.parse(pipeline, verify_each=True).run(conv_net())
    results = list(Interpreter(out).run([x, np.eye(3)[labels]], "forward_backward"))
    params = leaves(CONV)
    loss = torch_conv_net(x, labels, params, training=mode == "train")
    loss.backward()
    np.testing.assert_allclose(results[0], loss.item(), rtol=1e-10)
    fn = out.functions["forward_backward"]
    assert [v.name for v in fn.results[3:]] == [gradient_name(n) for n in CONV]
    for name, got in zip(CONV, results[3:]):
        np.testing.assert_allclose(got, params[name].grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
    forward = Interpreter(out).run([x, np.eye(3)[labels]])
    for a, b in zip(results[:3], forward):  # loss and running statistics as @forward computes them
        np.testing.assert_allclose(a, b, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# the pass itself


def test_options_errors_and_rerunning() -> None:
    graph = mlp(False)
    with pytest.raises(PassError, match="no function @loss"):
        Autodiff(function="loss").apply(graph)
    b = Builder("M")
    w = b.param("w", (3,), F64, data=r(3))
    b.ret(b.tanh(w))
    with pytest.raises(PassError, match="scalar float loss"):
        Autodiff().apply(b.build())
    once = Autodiff().apply(graph)
    twice = Autodiff().apply(once)
    assert str(twice) == str(once)  # forward_backward is rewritten from @forward, not stacked
    named = PassManager.parse("autodiff{function=forward output=train_step}").run(graph)
    assert set(named.functions) == {"forward", "train_step"}
    verify(named)


def test_a_loss_that_ignores_a_trainable_param_gives_zeros() -> None:
    b = Builder("M")
    w = b.param("w", (2, 2), F64, data=r(2, 2))
    b.param("unused", (3,), F64, data=r(3))
    b.ret(b.sum(b.exp(w)))
    out, (loss, gw, gu) = run_backward(b.build(), [])
    np.testing.assert_allclose(gw, np.exp(out.params["w"].data))
    np.testing.assert_array_equal(gu, np.zeros(3))
