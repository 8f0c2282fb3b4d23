"""A small transformer classifier: trace it, print its IR, switch to validation, print again, count params, and
compile it through TVM."""

from __future__ import annotations

import numpy as np

import kiln
from kiln import nn
from kiln.ir import interpret, print_graph
from kiln.passes import PassManager


class Classifier(kiln.Module):
    def __init__(self, vocab: int = 100, d_model: int = 32, n_heads: int = 4, n_classes: int = 3, device=None):
        self.embedding = nn.Embedding(vocab, d_model, device=device)
        self.encoder = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1, device=device)
        self.head = nn.Linear(d_model, n_classes, device=device)

    def forward(self, tokens):
        h = self.encoder(self.embedding(tokens))
        return nn.functional.log_softmax(self.head(h.mean(axes=[1])))


def main() -> None:
    model = Classifier(device=kiln.Device("cpu").autodiff()).train()
    spec = ((None, 16), "i64")  # any batch size, 16 tokens
    print(f"parameters: {model.num_params():,} (none initialized yet: lazy)")
    print(print_graph(kiln.trace(model, spec)))
    inference = PassManager.parse("canonicalize,cse,dce").run(kiln.trace(model.valid(), spec))
    print(print_graph(inference))
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    (log_probs,) = interpret(inference, [tokens])
    print("class log-probabilities:", np.round(log_probs, 3).tolist())
    exe = kiln.compile(model.valid(), spec)
    batch = kiln.aligned(tokens)  # on a 64-byte boundary: the executable hands it to TVM's kernels without a copy
    print("compiled through TVM, same result:", bool(np.allclose(exe(batch), log_probs, atol=1e-4)))


if __name__ == "__main__":
    main()
