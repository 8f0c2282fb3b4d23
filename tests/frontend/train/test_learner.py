"""The Learner (issue 14: "`fit(train_data, valid_data, epochs)`: uses `compile_step` for training steps and the
model's `valid()` for evaluation; metrics ... per step and per epoch; a progress bar with ETA that degrades to
plain log lines when stdout is not a terminal; a CSV/JSON-lines metrics log; early stopping on a metric")."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import nn, optim
from kiln.train import DataLoader, EarlyStopping, Learner

DEV = kiln.Device("cpu").autodiff()
RNG = np.random.default_rng(8)
X, Y = RNG.normal(size=(48, 5)).astype(np.float32), RNG.integers(0, 3, 48)


class Net(kiln.Module):
    def __init__(self) -> None:
        self.fc1, self.drop, self.fc2 = nn.Linear(5, 8, device=DEV), nn.Dropout(0.9), nn.Linear(8, 3, device=DEV)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc2(self.drop(self.fc1(x).relu()))


def loss_fn(model: Net, x: kiln.Tensor, y: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
    logits = model(x)
    return nn.cross_entropy(logits, y), logits


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_fit_logs_every_step_and_epoch(tmp_path):
    log = tmp_path / "log.jsonl"
    learner = Learner(Net(), optim.Adam(), loss_fn, optim.ConstantLr(0.01), log=log, stream=io.StringIO())
    learner.fit(DataLoader((X, Y), 16, shuffle=True), DataLoader((X, Y), 24), epochs=2)
    steps = [r for r in records(log) if r["event"] == "step"]
    epochs = [r for r in records(log) if r["event"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["epoch"] for r in epochs] == [1, 2]
    assert set(steps[0]) == {"event", "epoch", "step", "loss", "accuracy", "lr", "step_time", "samples_per_s"}
    assert {"train_loss", "train_accuracy", "train_lr", "valid_loss", "valid_accuracy"} <= set(epochs[0])
    assert epochs[0]["train_loss"] == pytest.approx(np.mean([r["loss"] for r in steps[:3]]))


def test_evaluation_runs_the_valid_model():
    # lr 0 leaves the weights; dropout 0.9 would change the loss in training mode, valid() turns it off
    model = Net()
    learner = Learner(model, optim.SGD(), loss_fn, optim.ConstantLr(0.0), stream=io.StringIO())
    learner.fit(DataLoader((X, Y), 16), epochs=1)
    p = {k: torch.from_numpy(np.array(v)) for k, v in model.state_dict().items()}
    logits = torch.relu(torch.from_numpy(X) @ p["fc1.weight"] + p["fc1.bias"]) @ p["fc2.weight"] + p["fc2.bias"]
    result = learner.evaluate(DataLoader((X, Y), 48))
    assert result["loss"] == pytest.approx(float(F.cross_entropy(logits, torch.from_numpy(Y))), rel=1e-6)
    assert result["accuracy"] == float((logits.argmax(1).numpy() == Y).mean())


def test_early_stopping_waits_patience_epochs(tmp_path):
    # lr 0: the valid loss never improves on epoch 1's, so patience 2 stops after epoch 3 of 10
    log = tmp_path / "log.jsonl"
    learner = Learner(Net(), optim.SGD(), loss_fn, optim.ConstantLr(0.0), log=log, stream=io.StringIO(),
                      early_stopping=EarlyStopping("valid_loss", patience=2))
    learner.fit(DataLoader((X, Y), 24), DataLoader((X, Y), 48), epochs=10)
    assert [r["epoch"] for r in records(log) if r["event"] == "epoch"] == [1, 2, 3]
    with pytest.raises(ValueError, match="monitors 'valid_f1', which no epoch reports"):
        Learner(Net(), optim.SGD(), loss_fn, optim.ConstantLr(0.0), stream=io.StringIO(),
                early_stopping=EarlyStopping("valid_f1")).fit(DataLoader((X, Y), 24), epochs=1)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'up'"):
        EarlyStopping(mode="up")  # type: ignore[arg-type]


def test_progress_redraws_on_a_terminal_and_prints_lines_elsewhere():
    plain, tty = io.StringIO(), Terminal()
    for stream in (plain, tty):
        Learner(Net(), optim.SGD(), loss_fn, optim.ConstantLr(0.01), stream=stream).fit(DataLoader((X, Y), 8),
                                                                                        epochs=2)
    assert "\r" not in plain.getvalue() and "\x1b" not in plain.getvalue()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch 1/2 train_loss")
    assert tty.getvalue().count("\r") > 12 and "ETA 0:0" in tty.getvalue() and "[####" in tty.getvalue()


def test_the_terminal_bar_is_tqdm_and_a_pipe_gets_no_bar():
    """Issue 14's bar through tqdm; not a terminal: no bar at all, only the epoch's closing line."""
    from tqdm import tqdm

    from kiln.frontend.train.progress import ProgressBar

    tty, plain = Terminal(), io.StringIO()
    drawn, quiet = ProgressBar("epoch 1/1", 4, tty), ProgressBar("epoch 1/1", 4, plain)
    for done in (3, 4):  # a resumed epoch starts at batch 3
        drawn.update(done, "loss 1")
        quiet.update(done, "loss 1")
    assert isinstance(drawn.bar, tqdm) and drawn.bar.n == 4 and drawn.bar.initial == 2
    assert "[##################......] 3/4, loss 1 ETA" in tty.getvalue()
    assert quiet.bar is None and plain.getvalue() == ""
    drawn.close("done")
    quiet.close("done")
    assert plain.getvalue().startswith("epoch 1/1 done (") and tty.getvalue().endswith("s)\x1b[K\n")
