"""The Learner's CSV metrics log and seeded random transforms (issue 14, "The Learner": "a CSV/JSON-lines metrics
log"; resume is exact, so a random data transform must draw the same on resume)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln import nn, optim
from kiln.train import Checkpointing, DataLoader, Learner

RNG = np.random.default_rng(4)
X, Y = RNG.normal(size=(40, 4)).astype(np.float32), RNG.integers(0, 3, 40)
TIMING = ("step_time", "samples_per_s")  # wall-clock columns, never equal between runs


class Tiny(kiln.Module):
    def __init__(self) -> None:
        self.fc = nn.Linear(4, 3, device=kiln.Device("cpu").autodiff())

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc(x)


def loss_fn(model: Tiny, x: kiln.Tensor, y: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
    logits = model(x)
    return nn.cross_entropy(logits, y), logits


def jitter(sample, rng):
    """A random augmentation: noise on the features."""
    x, y = sample
    return (x + rng.normal(scale=0.5, size=x.shape).astype(np.float32), y)


def fit(log: Path, folder: Path | None = None, epochs: int = 2, resume: Path | None = None, **options) -> Learner:
    kiln.seed(3)
    learner = Learner(Tiny(), optim.Adam(), loss_fn, optim.ConstantLr(0.05), log=log, stream=io.StringIO(),
                      checkpointing=Checkpointing(folder, every_steps=3, keep=10) if folder else None, **options)
    learner.fit(DataLoader((X, Y), 8, shuffle=True, seed=5, transform=jitter), epochs=epochs, resume=resume)
    return learner


def rows(log: Path) -> list[dict[str, str]]:
    with open(log, newline="") as f:
        return [{k: v for k, v in row.items() if not k.endswith(TIMING)} for row in csv.DictReader(f)]


def test_a_csv_log_has_a_header_of_the_metric_names_and_the_json_log_values(tmp_path):
    fit(tmp_path / "m.csv")
    fit(tmp_path / "m.jsonl")
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    names = ["loss", "accuracy", "lr", "step_time", "samples_per_s"]
    assert header == ["event", "epoch", "step", *names, *(f"train_{n}" for n in names),
                      *(f"valid_{n}" for n in names)]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows(tmp_path / "m.csv")) == len(records) == 12  # 5 steps and an epoch, twice
    for row, record in zip(rows(tmp_path / "m.csv"), records):
        assert {k: v for k, v in row.items() if v != ""} == {k: str(v) for k, v in record.items()
                                                             if not k.endswith(TIMING)}
    fit(tmp_path / "m.log", log_format="csv")
    assert rows(tmp_path / "m.log") == rows(tmp_path / "m.csv")
    with pytest.raises(ValueError, match="log_format must be 'jsonl' or 'csv', got 'tsv'"):
        fit(tmp_path / "m.tsv", log_format="tsv")


def test_resume_appends_to_the_csv_without_a_second_header_and_repeats_the_random_transform(tmp_path):
    """Resuming at step 3 (mid-epoch 1) cuts the log back to that checkpoint and appends: the rows, augmentation
    included, equal an uninterrupted run's."""
    fit(tmp_path / "full.csv")
    fit(tmp_path / "cut.csv", tmp_path / "ckpt", epochs=1)
    fit(tmp_path / "cut.csv", tmp_path / "ckpt", resume=tmp_path / "ckpt" / "step-000000003")
    text = (tmp_path / "cut.csv").read_text()
    assert text.count("event,epoch,step") == 1 and text.endswith("\n")
    assert rows(tmp_path / "cut.csv") == rows(tmp_path / "full.csv")


def test_a_run_killed_mid_epoch_leaves_complete_csv_lines(tmp_path):
    calls = []

    def dying(sample):
        calls.append(1)
        if len(calls) > 24:  # three batches of 8 train, then the run dies making the fourth
            raise KeyboardInterrupt
        return sample

    with pytest.raises(KeyboardInterrupt):
        Learner(Tiny(), optim.SGD(), loss_fn, optim.ConstantLr(0.1), log=tmp_path / "k.csv",
                stream=io.StringIO()).fit(DataLoader((X, Y), 8, transform=dying, prefetch=0), epochs=1)
    lines = (tmp_path / "k.csv").read_text().splitlines(keepends=True)
    assert len(lines) == 4 and all(line.endswith("\n") and line.count(",") == lines[0].count(",") for line in lines)


def test_a_random_transform_draws_from_seed_epoch_and_index():
    """`rng` is `default_rng([seed, epoch, index])`: the same sample gets the same draw in any order or batch."""
    seen: dict[tuple[int, int], float] = {}

    def record(sample, rng):
        return (sample[0], np.asarray(rng.random(), np.float64), sample[1])

    data = (np.arange(6, dtype=np.float32), np.arange(6))
    for batch_size, shuffle in ((2, True), (3, False)):
        loader = DataLoader(data, batch_size, shuffle=shuffle, seed=9, transform=record, prefetch=0)
        for epoch in (0, 1):
            for x, draw, _ in loader.batches(epoch):
                for i, d in zip(x.astype(int), draw):
                    assert seen.setdefault((epoch, int(i)), d) == d
                    assert d == np.random.default_rng([9, epoch, int(i)]).random()
    assert seen[(0, 1)] != seen[(1, 1)]
    plain = DataLoader(data, 2, transform=lambda s: (s[0] * 2, s[1]), prefetch=0)
    np.testing.assert_array_equal(next(plain.batches())[0], [0, 2])
