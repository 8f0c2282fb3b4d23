"""factor-lora before autodiff: gradients of the LoRA factors equal torch's through the dense `W + s * A @ B`, and
neither the forward nor the backward forms a value of the weight's shape (issue 11: the QLoRA rewrite "in the
forward and the backward ... gradients for A and B must be exact")."""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import Graph, Interpreter, SymRef, parse
from kiln.passes import PassManager

D0, D1, RANK, SCALE = 6, 5, 2, 1.5

SOURCE = f"""module @M {{
  param @w.codes : tensor<{D0}x{D1}xi8> {{id = "0x1", data = dense<tensor<{D0}x{D1}xi8>, [{", ".join(
    str(v) for v in (np.arange(D0 * D1) % 11 - 5))}]>, grad = false}}
  param @w.scales : tensor<1xf32> {{id = "0x2", data = dense<tensor<1xf32>, 0.125>, grad = false}}
  param @w.lora.a : tensor<{D0}x{RANK}xf32> {{id = "0x3", init = normal(std = 0.5), grad = true}}
  param @w.lora.b : tensor<{RANK}x{D1}xf32> {{id = "0x4", init = normal(std = 0.5), grad = true}}
  param @bias : tensor<{D1}xf32> {{id = "0x5", init = normal(std = 0.5), grad = true}}
  reparam @w.base : tensor<{D0}x{D1}xf32> = dequantize(@w.codes, @w.scales) {{value = "q8s"}}
  reparam @w : tensor<{D0}x{D1}xf32> = lora(@w.base, @w.lora.a, @w.lora.b) {{scale = {SCALE}}}
  func @forward(%x: tensor<3x{D0}xf32>) -> (tensor<f32>) {{
    %h = linear %x, @w, @bias : tensor<3x{D1}xf32>
    %t = tanh %h : tensor<3x{D1}xf32>
    %l = sum %t : tensor<f32>
    return %l
  }}
}}"""


def _backward(pipeline: str) -> tuple[Graph, list[np.ndarray]]:
    graph = PassManager.parse(pipeline, verify_each=True).run(parse(SOURCE))
    x = np.random.default_rng(0).standard_normal((3, D0))
    return graph, list(Interpreter(graph).run([x.astype(np.float32)], "forward_backward"))


def _weight_shaped(graph: Graph) -> list[str]:
    fn = graph.functions["forward_backward"]
    return [op.kind for op in fn.ops for r in op.results if set(r.type.shape) == {D0, D1} and r.type.rank == 2]


def test_factor_gradients_match_torch_through_the_dense_weight() -> None:
    """d a = s * x^T (g @ b^T) and d b = s * (x a)^T g: torch autograd on tanh(x @ (W + s a b) + bias)."""
    graph, (loss, *grads) = _backward("factor-lora,autodiff")
    values = Interpreter(graph)
    leaves = {n: torch.tensor(values.symbol(n), dtype=torch.float64, requires_grad=True)
              for n in ("w.lora.a", "w.lora.b", "bias")}
    base = torch.tensor(values.symbol("w.base"), dtype=torch.float64)
    x = torch.tensor(np.random.default_rng(0).standard_normal((3, D0)).astype(np.float32), dtype=torch.float64)
    want = torch.tanh(x @ (base + SCALE * leaves["w.lora.a"] @ leaves["w.lora.b"]) + leaves["bias"]).sum()
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    trainable = [p.name for p in graph.params.values() if p.grad]
    for name, got in zip(trainable, grads):
        np.testing.assert_allclose(got, leaves[name].grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def _reads(graph: Graph) -> set[str]:
    return {o.name for op in graph.functions["forward_backward"].ops for o in op.operands if isinstance(o, SymRef)}


def test_no_value_of_the_weights_shape_is_formed_forward_or_backward() -> None:
    """Without factoring, the forward reads the adapted weight @w (formed as base + s a b) and the backward forms its
    [d0, d1] gradient x^T g; with it, the function reads the base and the factors and forms nothing of that shape."""
    plain, _ = _backward("autodiff")
    factored, _ = _backward("factor-lora,autodiff")
    assert "w" in _reads(plain) and "matmul" in _weight_shaped(plain)
    assert _reads(factored) == {"w.base", "w.lora.a", "w.lora.b", "bias"}
    assert _weight_shaped(factored) == []
