"""fork and to_device under autodiff (spec/module-trait.txt; Burn: `fork` = `to_device(d).detach()` then
`require_grad()` again, a fresh leaf keeping the ParamId; `to_device` is registered in the autodiff graph).
Gradients are checked against torch autograd on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import nn, optim

AD = kiln.Device("cpu").autodiff()
RNG = np.random.default_rng(5)
X = RNG.standard_normal((6, 4)).astype(np.float32)


class Net(kiln.Module):
    def __init__(self) -> None:
        self.fc = nn.Linear(4, 3, device=AD)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc(x).tanh()


def loss_fn(model: Net, x: kiln.Tensor) -> kiln.Tensor:
    return (model(x) * model(x)).mean()


def torch_grads(model: Net) -> dict[int, np.ndarray]:
    """The oracle: torch autograd of the same loss on the same weights, by ParamId."""
    w = torch.tensor(model.fc.weight.state.get().copy(), requires_grad=True)
    b = torch.tensor(model.fc.bias.state.get().copy(), requires_grad=True)
    y = torch.tanh(torch.from_numpy(X) @ w + b)
    (y * y).mean().backward()
    return {model.fc.weight.id: w.grad.numpy(), model.fc.bias.id: b.grad.numpy()}


def assert_grads(got: kiln.Gradients, want: dict[int, np.ndarray]) -> None:
    assert set(got) == set(want)
    for pid, g in want.items():
        np.testing.assert_allclose(got[pid], g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("initialized", [True, False])
def test_a_fork_has_its_own_autodiff_graph(device: str, initialized: bool) -> None:
    """fork: "it ensures the output module on the new device will have its own autodiff graph": gradients through
    the fork are the fork's only, and the source's the source's only."""
    m = Net()
    if initialized:
        m.fc.weight.val()
    f = m.fork(device)
    assert [p.id for _, p in f.leaves()] == [p.id for _, p in m.leaves()]  # Burn's fork keeps the ParamId
    grads = loss_fn(f, kiln.tensor(X)).backward()
    assert_grads(kiln.GradientsParams.from_grads(grads, f), torch_grads(f))
    assert len(kiln.GradientsParams.from_grads(grads, m)) == 0
    back = loss_fn(m, kiln.tensor(X)).backward()
    assert_grads(kiln.GradientsParams.from_grads(back, m), torch_grads(m))
    assert len(kiln.GradientsParams.from_grads(back, f)) == 0


def test_a_fork_on_the_same_device_copies_nothing_and_a_lazy_parameter_stays_lazy() -> None:
    """fork: the data is moved, not copied, where it already is; "A parameter not initialized yet initializes on
    the destination" (so forking does not initialize it)."""
    m = Net()
    m.fc.weight.val()
    f = m.fork("cpu")
    assert f.fc.weight is not m.fc.weight and f.fc.weight.state is m.fc.weight.state
    assert not f.fc.bias.is_initialized() and not m.fc.bias.is_initialized()


def test_a_loss_through_a_module_and_its_fork_is_refused() -> None:
    """Both leaves carry the same ParamId, so one ParamId-keyed result cannot hold both gradients."""
    m = Net()
    f = m.fork("cpu")
    with pytest.raises(ValueError, match=r"parameter [0-9a-v]{13} is read through two autodiff leaves"):
        (loss_fn(m, kiln.tensor(X)) + loss_fn(f, kiln.tensor(X))).backward()


def test_to_device_keeps_the_graph_gradients_reach_the_original_leaves() -> None:
    """to_device: "For initialized parameters, the operation supports autodiff and is registered when
    activated." """
    m = Net()
    m.fc.weight.val()
    moved = m.to_device("cuda:0")
    grads = loss_fn(moved, kiln.tensor(X)).backward()
    assert_grads(kiln.GradientsParams.from_grads(grads, m), torch_grads(m))


def test_an_optimizer_step_on_a_to_device_output_is_refused_eagerly() -> None:
    """to_device: "The output model will be an intermediary model, meaning that you can't optimize it with
    gradient descent. If you want to optimize the output network on the target device, use fork instead." """
    m = Net()
    m.fc.weight.val()
    moved = m.to_device("cuda:0")
    grads = kiln.GradientsParams.from_grads(loss_fn(moved, kiln.tensor(X)).backward(), moved)
    with pytest.raises(ValueError, match=r"parameter 'fc.weight' is not a leaf: its module came from to_device.*"
                                         r"use fork to train on another device"):
        optim.SGD().step(0.1, moved, grads)


def test_an_optimizer_step_on_a_fork_trains_the_fork_only() -> None:
    """fork: "the output module on the new device will have its own autodiff graph": its parameters are leaves
    gradient descent optimizes (even forked from an intermediary); the source is untouched."""
    m = Net()
    m.fc.weight.val()
    f = m.to_device("cuda:0").fork("cuda:0")
    assert all(p.leaf for _, p in f.leaves())  # a fork of an intermediary is a fresh leaf again
    before = {p.id: p.state.get().copy() for _, p in m.leaves()}
    grads = kiln.GradientsParams.from_grads(loss_fn(f, kiln.tensor(X)).backward(), f)
    trained = optim.SGD().step(0.1, f, grads)
    want = torch_grads(f)
    for _, p in trained.leaves():
        np.testing.assert_allclose(p.state.get(), before[p.id] - 0.1 * want[p.id], rtol=1e-5, atol=1e-7)
    for _, p in m.leaves():
        np.testing.assert_array_equal(p.state.get(), before[p.id])


def test_the_captured_step_refuses_a_to_device_output_and_trains_a_fork() -> None:
    """to_device: "you can't optimize it with gradient descent. If you want to optimize the output network on the
    target device, use fork instead." """
    m = Net()
    m.fc.weight.val()
    moved = m.to_device("cuda:0")
    with pytest.raises(ValueError, match=r"parameter 'fc.weight' is not a leaf: its module came from to_device"):
        kiln.compile_step(moved, loss_fn, optim.SGD(), ((6, 4), "f32"))
    f = m.fork("cuda:0")
    step = kiln.compile_step(f, loss_fn, optim.SGD(), ((6, 4), "f32"))
    step(0.1, X)
    want, before = torch_grads(f), {p.id: p.state.get() for _, p in f.leaves()}
    for _, p in step.model().leaves():
        np.testing.assert_allclose(p.state.get(), before[p.id] - 0.1 * want[p.id], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"parameter 'fc.weight' is not a leaf: its module came from to_device"):
        step.load_model(moved)


def test_from_grads_keeps_a_plain_mapping_by_param_id() -> None:
    """Burn's GradientsParams is keyed by ParamId: gradients given as a plain mapping, with no autodiff leaf
    recorded, are taken by id, so the source and its fork both take them."""
    m = Net()
    f = m.fork("cpu")
    plain = {m.fc.weight.id: np.ones((4, 3), np.float32)}
    assert set(kiln.GradientsParams.from_grads(plain, m)) == set(kiln.GradientsParams.from_grads(plain, f)) == \
        {m.fc.weight.id}


def test_an_optimizer_step_returns_fresh_leaves() -> None:
    """Burn's optimizer returns each updated tensor as a new leaf (`from_inner(..).require_grad()`) with its
    ParamId: gradients of the old values are not the new module's, and one loss reading both is refused instead
    of silently taking one value for both."""
    m = Net()
    grads = kiln.GradientsParams.from_grads(loss_fn(m, kiln.tensor(X)).backward(), m)
    stepped = optim.SGD().step(0.1, m, grads)
    assert [p.id for _, p in stepped.leaves()] == [p.id for _, p in m.leaves()]
    assert len(kiln.GradientsParams.from_grads(grads, stepped)) == 0
    with pytest.raises(ValueError, match="values before and after an optimizer step"):
        (loss_fn(m, kiln.tensor(X)) + loss_fn(stepped, kiln.tensor(X))).backward()
