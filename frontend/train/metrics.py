"""What the Learner measures: a Metric reads one step's output (loss, predictions, targets, learning rate, batch
size, seconds) and summarizes an epoch from the per-step values, so a resumed epoch summarizes what it logged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepOutput:
    """One batch through the model: `predictions` is loss_fn's second result, `targets` the batch's last array;
    `lr` is None in evaluation."""

    loss: float
    predictions: np.ndarray | None
    targets: np.ndarray | None
    lr: float | None
    batch_size: int
    seconds: float


class Metric:
    """A per-step value (None: not measured for this step) and its epoch summary, by default the mean weighted by
    batch size."""

    name = "metric"

    def measure(self, out: StepOutput) -> float | None:
        raise NotImplementedError

    def summarize(self, values: Sequence[float], sizes: Sequence[int]) -> float:
        return float(np.dot(values, sizes) / np.sum(sizes))


class Loss(Metric):
    name = "loss"

    def measure(self, out: StepOutput) -> float | None:
        return out.loss


class TopK(Metric):
    """The fraction of samples whose target is among the k highest-scoring classes (ties: the lower index wins)."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"top-k needs k >= 1, got {k}")
        self.k = k
        self.name = "accuracy" if k == 1 else f"top{k}_accuracy"

    def measure(self, out: StepOutput) -> float | None:
        if out.predictions is None or out.targets is None:
            return None
        scores = np.asarray(out.predictions)
        top = np.argsort(-scores, axis=-1, kind="stable")[..., :self.k]
        return float((top == np.asarray(out.targets)[..., None]).any(axis=-1).mean())


class Accuracy(TopK):
    """Top-1 accuracy: the arg-max prediction equals the target."""

    def __init__(self) -> None:
        super().__init__(1)


class LearningRate(Metric):
    """The step's learning rate; an epoch reports its last."""

    name = "lr"

    def measure(self, out: StepOutput) -> float | None:
        return out.lr

    def summarize(self, values: Sequence[float], sizes: Sequence[int]) -> float:
        return values[-1]


class StepTime(Metric):
    """Seconds per step (data loading excluded); an epoch reports the mean."""

    name = "step_time"

    def measure(self, out: StepOutput) -> float | None:
        return out.seconds

    def summarize(self, values: Sequence[float], sizes: Sequence[int]) -> float:
        return float(np.mean(values))


class SamplesPerSecond(Metric):
    """Throughput; an epoch reports all its samples over all its step seconds."""

    name = "samples_per_s"

    def measure(self, out: StepOutput) -> float | None:
        return out.batch_size / out.seconds if out.seconds > 0 else None

    def summarize(self, values: Sequence[float], sizes: Sequence[int]) -> float:
        return float(np.sum(sizes) / sum(n / v for n, v in zip(sizes, values)))


def measure(metrics: Sequence[Metric], out: StepOutput, values: dict[str, list[float]],
            sizes: dict[str, list[int]]) -> dict[str, float]:
    """Each metric's value for `out` (those it measures), also appended to the running `values` and `sizes`."""
    measured = {}
    for metric in metrics:
        value = metric.measure(out)
        if value is not None:
            measured[metric.name] = value
            values.setdefault(metric.name, []).append(value)
            sizes.setdefault(metric.name, []).append(out.batch_size)
    return measured


def summarize(metrics: Sequence[Metric], values: dict[str, list[float]], sizes: dict[str, list[int]]
              ) -> dict[str, float]:
    """The summary of every metric that measured something."""
    return {m.name: m.summarize(values[m.name], sizes[m.name]) for m in metrics if values.get(m.name)}


def default_metrics() -> tuple[Metric, ...]:
    return (Loss(), Accuracy(), LearningRate(), StepTime(), SamplesPerSecond())
