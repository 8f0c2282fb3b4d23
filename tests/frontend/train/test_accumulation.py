"""Gradient accumulation (issue 14: "gradient accumulation"; the brief: "check it equals the big-batch gradient"):
k equal micro-batches under a mean loss give the update torch computes from the whole batch at once."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import nn, optim
from kiln.train import DataLoader, Learner

DEV = kiln.Device("cpu").autodiff()


class MLP(kiln.Module):
    def __init__(self) -> None:
        self.fc1, self.fc2 = nn.Linear(6, 10, device=DEV), nn.Linear(10, 4, device=DEV)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc2(self.fc1(x).relu())


def loss_fn(model: MLP, x: kiln.Tensor, y: kiln.Tensor) -> kiln.Tensor:
    return nn.cross_entropy(model(x), y)


def values(model: kiln.Module) -> dict[str, np.ndarray]:
    return {path: np.array(p.state.get()) for path, p in model.leaves() if isinstance(p, kiln.Param)}


def torch_big_batch(start: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, make_optimizer, updates: int
                    ) -> dict[str, np.ndarray]:
    """torch: `updates` steps, each on the whole batch (the oracle)."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    opt = make_optimizer(list(p.values()))
    for _ in range(updates):
        opt.zero_grad()
        h = torch.relu(torch.from_numpy(x) @ p["fc1.weight"] + p["fc1.bias"])
        F.cross_entropy(h @ p["fc2.weight"] + p["fc2.bias"], torch.from_numpy(y)).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in p.items()}


@pytest.mark.parametrize("kiln_opt, torch_opt", [
    (lambda: optim.SGD(momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    (lambda: optim.AdamW(weight_decay=0.01), lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01)),
], ids=["sgd-momentum", "adamw"])
def test_k_micro_batches_take_the_big_batch_step(kiln_opt, torch_opt):
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(24, 6)).astype(np.float32), rng.integers(0, 4, 24)
    model = MLP()
    start = values(model)
    step = kiln.compile_step(model, loss_fn, optim.GradientAccumulation(kiln_opt(), 3), ((None, 6), "f32"),
                             ((None,), "i64"))
    for update in range(2):
        for i in range(3):
            before = values(step.model())
            step(0.1, x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
            if i < 2:  # between updates nothing moves
                for k, v in values(step.model()).items():
                    np.testing.assert_array_equal(v, before[k])
        expected = torch_big_batch(start, x, y, torch_opt, update + 1)
        for k, v in values(step.model()).items():
            np.testing.assert_allclose(v, expected[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        optim.GradientAccumulation(optim.SGD(), 0)


def test_the_learner_advances_the_schedule_once_per_update(tmp_path):
    # the schedule is per optimizer step: k micro-steps share one learning rate
    rng = np.random.default_rng(5)
    data = DataLoader((rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 4, 32)), 4)
    schedule = optim.LinearWarmupLr(optim.ConstantLr(0.1), 4)
    log = tmp_path / "log.jsonl"
    Learner(MLP(), optim.SGD(), loss_fn, schedule, accumulation=2, log=log, stream=io.StringIO()).fit(data)
    rates = [r["lr"] for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "step"]
    expected = [schedule.lr_at(i // 2) for i in range(8)]
    assert rates == expected and rates[0] == rates[1] != rates[2]
