"""MNIST with weights trained by Rust Burn: a kiln model of the same architecture loads Burn's burnpack file
(`examples/mnist-inference-web/model.bpk`, a copy is in shared/fixtures) and classifies synthetic digits.

Architecture: two conv blocks (3x3 conv without padding -> BatchNorm2d -> ReLU -> 2x2 max pool, stride 2)
take [batch, 1, 28, 28] to [batch, 64, 5, 5]; then Linear 1600 -> 128 -> 128 -> 10 with GELU between.

Layout mapping, Burn -> kiln: none is needed, so the file loads as it is.
- Names are module paths joined by dots in both: `conv1.conv.weight`, `conv1.norm.gamma`, `fc1.bias`.
  Parameterless layers (ReLU, GELU, pooling, dropout) own no tensors and appear in no name.
- Conv2d weights are [out, in, kh, kw] in both.
- Linear weights are [in, out] in both (y = x @ W + b), unlike PyTorch's [out, in].
- BatchNorm's `gamma`, `beta`, `running_mean`, `running_var` have Burn's names; kiln's training Flag is not
  recorded, so `valid()` switches the loaded model to the running statistics.
- ParamIds come from the file.

Run: `python examples/mnist_burn.py [path/to/mnist-model.bpk]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import kiln
from kiln import Module, Tensor, nn

FIXTURE = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "burn" / "mnist-model.bpk"
MEAN, STD = 0.1307, 0.3081  # the normalization Burn's example applies to pixels scaled to [0, 1]


class ConvBlock(Module):
    """3x3 valid convolution, batch norm, ReLU, 2x2 max pooling with stride 2."""

    def __init__(self, channels_in: int, channels_out: int):
        self.conv = nn.Conv2d(channels_in, channels_out, 3)
        self.norm = nn.BatchNorm2d(channels_out)
        self.activation = nn.ReLU()
        self.pool = nn.MaxPool2d(2, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.activation(self.norm(self.conv(x))))


class MnistModel(Module):
    """Images [batch, 28, 28] to class logits [batch, 10]."""

    def __init__(self):
        self.conv1 = ConvBlock(1, 64)  # -> [batch, 64, 13, 13]
        self.conv2 = ConvBlock(64, 64)  # -> [batch, 64, 5, 5]
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 10)
        self.activation = nn.GELU()

    def forward(self, images: Tensor) -> Tensor:
        x = self.conv2(self.conv1(images.reshape(shape=(-1, 1, 28, 28))))
        x = self.dropout(x.reshape(shape=(-1, 64 * 5 * 5)))
        x = self.dropout(self.activation(self.fc1(x)))
        x = self.dropout(self.activation(self.fc2(x)))
        return self.fc3(x)


def load(path: Path = FIXTURE) -> MnistModel:
    """The model with Burn's weights, in validation mode (running statistics, no dropout)."""
    return MnistModel().load_file(path).valid()


def normalize(pixels: np.ndarray) -> np.ndarray:
    """Pixels in [0, 255] as the model's f32 input, normalized as Burn's example does."""
    return ((pixels.astype(np.float32) / 255) - MEAN) / STD


def synthetic_digits() -> dict[str, np.ndarray]:
    """A blank image and a few strokes drawn with numpy, as [28, 28] pixels in [0, 255]."""
    blank = np.zeros((28, 28), np.float32)
    one = blank.copy()
    one[4:24, 13:16] = 255
    seven = blank.copy()
    seven[5:8, 7:22] = 255
    for row in range(8, 24):
        column = 21 - (row - 8) * 10 // 16
        seven[row, column - 1 : column + 2] = 255
    rows, columns = np.mgrid[:28, :28]
    radius = np.hypot(rows - 14, (columns - 14) * 1.4)
    zero = np.where((radius > 7) & (radius < 10), 255, 0).astype(np.float32)
    return {"blank": blank, "one": one, "seven": seven, "zero": zero}


def classify(model: MnistModel, images: np.ndarray) -> np.ndarray:
    """Class probabilities [batch, 10] of [batch, 28, 28] pixel images."""
    logits = model(kiln.tensor(normalize(images))).numpy()
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    if not path.exists():
        sys.exit(f"no Burn MNIST model at {path}; pass the path of mnist-model.bpk")
    model = load(path)
    digits = synthetic_digits()
    probabilities = classify(model, np.stack(list(digits.values())))
    for name, p in zip(digits, probabilities):
        print(f"{name:>6}: class {int(p.argmax())} (p = {p.max():.2f})")


if __name__ == "__main__":
    main()
