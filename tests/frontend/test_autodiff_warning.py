"""Training a model built on a device without autodiff trains nothing (no gradient, a flat loss): it warns once
per process, naming the device and how to enable autodiff, for eager `backward()` and for `compile_step`."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import kiln
from kiln import nn, optim
from kiln.ir import AutodiffWarning

X = np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)
MESSAGE = (r"no parameter gets a gradient: they are on cpu, a device without autodiff, so training changes nothing; "
           r"build the model on Device\('cpu'\)\.autodiff\(\), or call \.train\(\)")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a new process would: nothing warned yet."""
    monkeypatch.setattr("kiln.frontend.warn_once.warned", set())


def _loss(model: nn.Linear, x: kiln.Tensor) -> kiln.Tensor:
    return (model(x) ** 2).mean()


def test_eager_backward_off_autodiff_warns_once_at_the_callers_line():
    model = nn.Linear(4, 3, device=kiln.Device("cpu"))
    with pytest.warns(AutodiffWarning, match=MESSAGE) as record:
        grads = _loss(model, kiln.tensor(X)).backward()
    assert len(grads) == 0 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(model, kiln.tensor(X)).backward()  # once per process


def test_compile_step_off_autodiff_warns_and_the_loss_stays_flat():
    step = kiln.compile_step(nn.Linear(4, 3, device=kiln.Device("cpu")), _loss, optim.SGD(), ((6, 4), "f32"))
    with pytest.warns(AutodiffWarning, match=MESSAGE) as record:
        first = step(0.1, X)
    assert record[0].filename == __file__
    assert step(0.1, X) == first


def test_autodiff_models_and_frozen_ones_on_autodiff_do_not_warn():
    """Frozen parameters on an autodiff device are a choice (`freeze`), not a missing device feature."""
    device = kiln.Device("cpu").autodiff()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _loss(nn.Linear(4, 3, device=device), kiln.tensor(X)).backward()
        _loss(nn.Linear(4, 3, device=device).freeze(), kiln.tensor(X)).backward()
        kiln.compile_step(nn.Linear(4, 3, device=device), _loss, optim.SGD(), ((6, 4), "f32"))(0.1, X)
