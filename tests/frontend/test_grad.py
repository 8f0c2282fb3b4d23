"""`kiln.grad(t, grads)`, Burn's `tensor.grad(&grads)`: a parameter's gradient read from what `backward()`
returned, checked against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.ir import KilnError

DEV = kiln.Device("cpu").autodiff()
RNG = np.random.default_rng(5)
X = RNG.standard_normal((4, 3)).astype(np.float32)
W = RNG.standard_normal((3, 2)).astype(np.float32)


def _torch_grad() -> np.ndarray:
    w = torch.tensor(W, requires_grad=True)
    ((torch.tensor(X) @ w) ** 2).mean().backward()
    return w.grad.numpy()


def test_grad_of_a_param_and_of_its_value_match_torch():
    """Burn: "Get the gradients of a tensor if it exist" — found here by the parameter's ParamId, and returned
    on the inner backend: the same device without autodiff."""
    w = kiln.Param.from_data(W, device=DEV)
    value = w.val()
    grads = ((kiln.tensor(X) @ value) ** 2).mean().backward()
    for g in [kiln.grad(w, grads), kiln.grad(value, grads)]:
        np.testing.assert_allclose(g.numpy(), _torch_grad(), rtol=1e-5, atol=1e-6)
        assert g.device == DEV and not g.is_autodiff() and not g.is_require_grad()


def test_a_missing_gradient_is_one_clear_error():
    frozen = kiln.Param.from_data(W, device=DEV, require_grad=False)
    used = kiln.Param.from_data(W, device=DEV)
    grads = ((kiln.tensor(X) @ (used.val() + frozen.val())) ** 2).mean().backward()
    with pytest.raises(KilnError, match=rf"no gradient for parameter {frozen.id} .*requires no gradient"):
        kiln.grad(frozen, grads)
    with pytest.raises(KilnError, match="the result of a 'add' op, not a parameter's value"):
        kiln.grad(used.val() + 1, grads)
    with pytest.raises(TypeError, match="expected a Tensor or a Param, got ndarray"):
        kiln.grad(W, grads)  # type: ignore[arg-type]


def test_gradients_flow_through_indexing_as_in_torch():
    """Indexing is slice, take and reshape ops, each with its gradient rule: d/dw of w[::-1, 1][None] and
    w[-1, ::2] against torch's."""
    w = kiln.Param.from_data(W, device=DEV)
    value = w.val()
    grads = ((value[::-1, 1][None] * 3).sum() + (value[-1, ::2] ** 2).sum()).backward()
    t = torch.tensor(W, requires_grad=True)
    ((t.flip(0)[:, 1][None] * 3).sum() + (t[-1, ::2] ** 2).sum()).backward()
    np.testing.assert_allclose(kiln.grad(w, grads).numpy(), t.grad.numpy(), rtol=1e-6)
