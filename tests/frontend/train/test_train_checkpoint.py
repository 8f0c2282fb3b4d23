"""Checkpoints and exact resume (issue 14: "`fit(resume=dir)` continues exactly: an interrupted-and-resumed run
produces the same loss sequence, bit for bit on the same backend, as an uninterrupted one (test it, killing the
process with SIGKILL mid-epoch)"), atomic checkpoint writes, keep-last-K, and damaged checkpoints refused."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import train_script  # beside this file

import kiln
from kiln import nn, optim
from kiln.train import Checkpointing, DataLoader, Learner
from kiln.train import checkpoint as ckpt

SCRIPT = Path(__file__).with_name("train_script.py")
TIMEOUT = 120  # seconds any one training process may take


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT)


def _steps(log: Path) -> list[dict]:
    """The logged records without wall-clock measurements (which no two runs share)."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(("step_time", "samples_per_s"))} for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run's log."""
    folder = tmp_path_factory.mktemp("reference")
    done = _run(folder / "checkpoints", folder / "log.jsonl")
    assert done.returncode == 0, done.stderr
    return _steps(folder / "log.jsonl")


def test_sigkill_mid_epoch_then_resume_repeats_the_loss_sequence(tmp_path, reference):
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "log.jsonl"
    process = subprocess.Popen([sys.executable, SCRIPT, checkpoints, log], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + TIMEOUT
    try:
        # epoch 1 is 7 steps and an epoch line: 9 step lines put the run inside epoch 2
        while not (log.exists() and log.read_text().count('"event": "step"') >= 9):
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(TIMEOUT)
    assert process.returncode == -signal.SIGKILL
    survivor = json.loads((ckpt.checkpoints(checkpoints)[-1] / ckpt.MANIFEST).read_text())["position"]
    assert survivor["epoch"] == 1 and 0 < survivor["batch"] < 7, "the kill did not land mid-epoch"
    resumed = _run(checkpoints, log, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(log) == reference  # losses, accuracies, learning rates: equal floats, not close ones


def test_kill_inside_a_checkpoint_write_leaves_the_previous_one(tmp_path, reference):
    # "a half-written one can't exist because writes are atomic": the 3rd save (step 6) dies after model.bpk
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "log.jsonl"
    died = _run(checkpoints, log, "--die-in-save", "3")
    assert died.returncode == -signal.SIGKILL
    assert [p.name for p in ckpt.checkpoints(checkpoints)] == ["step-000000002", "step-000000004"]
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".step-000000006.")]  # the staged folder
    _, _, state = ckpt.load(checkpoints, train_script.MLP(), optim.AdamW())  # the previous one loads
    assert state["position"]["step"] == 4
    resumed = _run(checkpoints, log, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(log) == reference
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # the orphan went at the re-save


class _Tiny(kiln.Module):
    def __init__(self) -> None:
        self.fc = nn.Linear(4, 3, device=kiln.Device("cpu").autodiff())

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc(x)


def _loss(model: _Tiny, x: kiln.Tensor, y: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
    logits = model(x)
    return nn.cross_entropy(logits, y), logits


def _data() -> DataLoader:
    rng = np.random.default_rng(1)
    return DataLoader((rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)), 8, shuffle=True)


def _fit(folder: Path, keep: int = 2, **fit) -> Learner:
    kiln.seed(3)
    learner = Learner(_Tiny(), optim.Adam(), _loss, optim.ConstantLr(0.01), stream=io.StringIO(),
                      checkpointing=Checkpointing(folder, every_steps=3, keep=keep))
    learner.fit(_data(), epochs=2, **fit)
    return learner


def test_only_the_newest_k_are_kept_and_resume_takes_the_newest(tmp_path):
    # issue 14: "written atomically every N steps or seconds, last K kept"
    learner = _fit(tmp_path, keep=2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000009", "step-000000010"]
    model, optimizer, state = ckpt.load(tmp_path, _Tiny(), optim.Adam())
    assert state["position"]["step"] == 10 and state["position"]["epoch"] == 2
    np.testing.assert_array_equal(model.state_dict()["fc.weight"], learner.trained().state_dict()["fc.weight"])
    assert optimizer.state.keys() == learner.optimizer.state.keys()
    for pid, values in learner.optimizer.state.items():
        for name, array in values.items():
            np.testing.assert_array_equal(optimizer.state[pid][name], array)


@pytest.mark.parametrize("victim", ["model.bpk", "optimizer.bpk", "checkpoint.json"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, victim):
    _fit(tmp_path)
    path = ckpt.checkpoints(tmp_path)[-1] / victim
    data = bytearray(path.read_bytes())
    if victim.endswith(".json"):
        del data[len(data) // 2:]  # a partial manifest
    else:
        data[len(data) // 2] ^= 0x40  # a flipped bit in a record
    path.write_bytes(bytes(data))
    with pytest.raises(kiln.RecordError, match=victim):
        _fit(tmp_path, resume=tmp_path)


def test_a_missing_record_or_no_checkpoint_is_a_record_error(tmp_path):
    with pytest.raises(kiln.RecordError, match="no checkpoint to resume from"):
        _fit(tmp_path / "empty", resume=tmp_path)
    _fit(tmp_path / "run")
    (ckpt.checkpoints(tmp_path / "run")[-1] / "optimizer.bpk").unlink()
    with pytest.raises(kiln.RecordError, match="optimizer.bpk: cannot be read"):
        _fit(tmp_path / "run", resume=tmp_path / "run")


def test_resuming_with_another_shuffle_seed_is_refused(tmp_path):
    _fit(tmp_path)
    kiln.seed(3)
    learner = Learner(_Tiny(), optim.Adam(), _loss, optim.ConstantLr(0.01), stream=io.StringIO())
    rng = np.random.default_rng(1)
    other = DataLoader((rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)), 8, shuffle=True, seed=9)
    with pytest.raises(ValueError, match="seed 0, this DataLoader's seed is 9"):
        learner.fit(other, epochs=3, resume=tmp_path)


def test_checkpoints_by_seconds_and_bad_settings(tmp_path):
    # "written atomically every N steps or seconds": a deadline already passed after every step saves every step
    kiln.seed(3)
    learner = Learner(_Tiny(), optim.SGD(), _loss, optim.ConstantLr(0.01), stream=io.StringIO(),
                      checkpointing=Checkpointing(tmp_path, every_seconds=1e-9, keep=100))
    learner.fit(_data(), epochs=1)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == [f"step-{i:09d}" for i in range(1, 6)]
    with pytest.raises(ValueError, match="every_steps must be positive, got 0"):
        Checkpointing(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
        Checkpointing(tmp_path, keep=0)


def test_resume_inside_an_accumulation_window_with_dropout_and_validation(tmp_path):
    # the summed gradients, the window's learning rate and the dropout seeds come back: same log as without a stop
    def run(log: Path, resume: Path | None = None) -> None:
        kiln.seed(3)
        learner = Learner(train_script.MLP(), optim.Adam(), train_script.loss_fn,
                          optim.LinearWarmupLr(optim.ConstantLr(0.05), 5), accumulation=2, log=log,
                          stream=io.StringIO(), checkpointing=Checkpointing(tmp_path / "ck", every_steps=3, keep=99))
        rng = np.random.default_rng(1)
        x = rng.normal(size=(40, 6)).astype(np.float32)
        valid = DataLoader((x, (x[:, 0] > 0).astype(np.int64)), 20)
        learner.fit(DataLoader((x, rng.integers(0, 3, 40)), 8, shuffle=True), valid, epochs=2, resume=resume)

    run(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_bytes((tmp_path / "a.jsonl").read_bytes())
    state = json.loads((tmp_path / "ck" / "step-000000003" / ckpt.MANIFEST).read_text())
    assert state["position"]["step"] % 2 == 1  # mid-window: one gradient summed, not applied
    run(tmp_path / "b.jsonl", resume=tmp_path / "ck" / "step-000000003")
    assert _steps(tmp_path / "b.jsonl") == _steps(tmp_path / "a.jsonl")
