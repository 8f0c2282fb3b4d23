"""The small kiln MLP the ONNX import and command-line tests export and import (one model, so the build cache
compiles it once for both)."""

import kiln
from kiln import nn


class MLP(kiln.Module):
    def __init__(self):
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(nn.functional.relu(self.fc1(x)))
