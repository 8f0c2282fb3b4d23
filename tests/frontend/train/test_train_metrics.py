"""The Learner's metrics (issue 14: "loss, accuracy, top-k, learning rate, step time, samples/s per step and per
epoch"), top-k against torch.topk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.train import Accuracy, LearningRate, Loss, SamplesPerSecond, StepOutput, StepTime, TopK


def out(predictions=None, targets=None, loss=1.0, lr=0.1, size=4, seconds=0.5) -> StepOutput:
    return StepOutput(loss, predictions, targets, lr, size, seconds)


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_agrees_with_torch(k):
    rng = np.random.default_rng(2)
    scores, targets = rng.normal(size=(64, 7)).astype(np.float32), rng.integers(0, 7, 64)
    top = torch.topk(torch.from_numpy(scores), k).indices.numpy()
    expected = float((top == targets[:, None]).any(axis=1).mean())
    metric = Accuracy() if k == 1 else TopK(k)
    assert metric.measure(out(scores, targets)) == expected
    assert metric.name == ("accuracy" if k == 1 else "top3_accuracy")


def test_epoch_summaries():
    # a weighted mean of the loss, the last learning rate, the mean step time, all samples over all seconds
    assert Loss().summarize([1.0, 4.0], [3, 1]) == pytest.approx(1.75)
    assert LearningRate().summarize([0.1, 0.2], [3, 1]) == 0.2
    assert StepTime().summarize([0.5, 1.5], [3, 1]) == 1.0
    steps = [out(size=30, seconds=1.0), out(size=10, seconds=3.0)]
    rate = SamplesPerSecond()
    assert rate.summarize([rate.measure(s) for s in steps], [30, 10]) == pytest.approx(10.0)


def test_unmeasured_values_are_none():
    assert Accuracy().measure(out()) is None and LearningRate().measure(out(lr=None)) is None
    with pytest.raises(ValueError, match="k >= 1, got 0"):
        TopK(0)
