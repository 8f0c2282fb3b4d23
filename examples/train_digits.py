"""Train an MLP and a small CNN on scikit-learn's bundled 8x8 digits (no download) with kiln.train's Learner (the
captured step, a progress bar), then evaluate both in validation mode on a held-out test split; exits with status 1
if the MLP's test accuracy is below 97%.

    .venv/bin/python examples/train_digits.py [--epochs-mlp 30] [--epochs-cnn 12]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from threadpoolctl import threadpool_limits  # installed with scikit-learn

import kiln
from kiln import nn, optim
from kiln.frontend.tensor import apply
from kiln.train import DataLoader, Learner

DEVICE = kiln.Device("cpu").autodiff()
BATCH = 64


def flat_norm(norm: nn.BatchNorm1d, x: kiln.Tensor) -> kiln.Tensor:
    """BatchNorm1d over [batch, features] (as [batch, features, 1])."""
    features = x.shape[1]
    y = norm(apply("reshape", x, shape=(-1, features, 1)))
    return apply("reshape", y, shape=(-1, features))


class MLP(kiln.Module):
    """64 -> 256 -> 128 -> 10 with batch norm, ReLU and dropout."""

    def __init__(self) -> None:
        self.fc1, self.norm1 = nn.Linear(64, 256, device=DEVICE), nn.BatchNorm1d(256, device=DEVICE)
        self.fc2, self.norm2 = nn.Linear(256, 128, device=DEVICE), nn.BatchNorm1d(128, device=DEVICE)
        self.out = nn.Linear(128, 10, device=DEVICE)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        h = self.dropout(flat_norm(self.norm1, self.fc1(x)).relu())
        h = self.dropout(flat_norm(self.norm2, self.fc2(h)).relu())
        return self.out(h)


class CNN(kiln.Module):
    """Two 3x3 conv + batch norm + ReLU blocks on [batch, 1, 8, 8], 2x2 max pooling, a linear classifier."""

    def __init__(self) -> None:
        self.conv1, self.norm1 = nn.Conv2d(1, 16, 3, padding=1, device=DEVICE), nn.BatchNorm2d(16, device=DEVICE)
        self.conv2, self.norm2 = nn.Conv2d(16, 32, 3, padding=1, device=DEVICE), nn.BatchNorm2d(32, device=DEVICE)
        self.pool = nn.MaxPool2d(2, stride=2)
        self.out = nn.Linear(32 * 4 * 4, 10, device=DEVICE)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        h = apply("reshape", x, shape=(-1, 1, 8, 8))
        h = self.norm1(self.conv1(h)).relu()
        h = self.pool(self.norm2(self.conv2(h)).relu())
        return self.out(apply("reshape", h, shape=(-1, 32 * 4 * 4)))


def loss_and_logits(model: kiln.Module, x: kiln.Tensor, y: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
    logits = model(x)
    return nn.cross_entropy(logits, y, label_smoothing=0.05), logits


def train(name: str, model: kiln.Module, data: tuple[np.ndarray, ...], epochs: int, lr: float) -> float:
    """Train with AdamW under a warmup + cosine schedule through kiln.train's Learner; returns the test accuracy."""
    x_train, y_train, x_test, y_test = data
    train_data = DataLoader((x_train, y_train), BATCH, shuffle=True, seed=0)
    steps = len(train_data)
    schedule = optim.LinearWarmupLr(optim.CosineAnnealingLr(lr, max(1, (epochs - 1) * steps)), steps)
    learner = Learner(model, optim.AdamW(weight_decay=1e-4), loss_and_logits, schedule)
    print(f"{name}:")
    start = time.perf_counter()
    learner.fit(train_data, epochs=epochs)
    seconds = time.perf_counter() - start
    accuracy = learner.evaluate(DataLoader((x_test, y_test), len(x_test)))["accuracy"]
    print(f"{name}: test accuracy {accuracy:.2%} ({len(x_test)} digits), trained in {seconds:.1f}s")
    return accuracy


def digits() -> tuple[np.ndarray, ...]:
    """Train/test split (80/20, stratified) of the 1797 digits, features standardized on the training split."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x.astype(np.float32), y.astype(np.int64), test_size=0.2,
                                                        random_state=0, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1.0
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs-mlp", type=int, default=30)
    parser.add_argument("--epochs-cnn", type=int, default=12)
    args = parser.parse_args(argv)
    data = digits()
    runs: list[tuple[str, Callable[[], kiln.Module], int, float]] = [
        ("MLP", MLP, args.epochs_mlp, 3e-3), ("CNN", CNN, args.epochs_cnn, 3e-3)]
    # The interpreter backend runs many small matmuls, for which BLAS threads cost more than they gain.
    with threadpool_limits(limits=1, user_api="blas"):
        results = {name: train(name, make(), data, epochs, lr) for name, make, epochs, lr in runs}
    print("test accuracy: " + ", ".join(f"{name} {acc:.2%}" for name, acc in results.items()))
    if results["MLP"] < 0.97:
        sys.exit(f"the MLP's test accuracy {results['MLP']:.2%} is below 97%")


if __name__ == "__main__":
    main()
