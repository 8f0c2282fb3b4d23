"""Multi-head self-attention and the transformer encoder layer built from it."""

from __future__ import annotations

import math

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.tensor import Tensor, apply

from . import functional as F
from . import sizes
from .basic import Dropout
from .linear import Linear
from .norm import LayerNorm


class MultiHeadAttention(Module):
    """softmax(q k^T / sqrt(d_head)) v per head over inputs [batch, seq, d_model]; dropout on the weights."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, device: Device | str | None = None):
        sizes.positive(self, d_model=d_model, n_heads=n_heads)
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.query = Linear(d_model, d_model, device=device)
        self.key = Linear(d_model, d_model, device=device)
        self.value = Linear(d_model, d_model, device=device)
        self.output = Linear(d_model, d_model, device=device)
        self.dropout = Dropout(dropout)
        self.n_heads, self.d_head = n_heads, d_model // n_heads

    def _heads(self, x: Tensor) -> Tensor:
        """[batch, seq, d_model] -> [batch, heads, seq, d_head]."""
        split = apply("reshape", x, shape=(-1, x.shape[1], self.n_heads, self.d_head))
        return apply("transpose", split, perm=(0, 2, 1, 3))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = apply("matmul", q, apply("transpose", k, perm=(0, 1, 3, 2))) * (1.0 / math.sqrt(self.d_head))
        weights = self.dropout(F.softmax(scores, axis=-1))
        context = apply("transpose", apply("matmul", weights, v), perm=(0, 2, 1, 3))
        d_model = self.n_heads * self.d_head
        return self.output(apply("reshape", context, shape=(-1, x.shape[1], d_model)))


class TransformerEncoderLayer(Module):
    """Self-attention and a GELU feed-forward block, each with residual, dropout and layer norm."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1, norm_first: bool = False,
                 device: Device | str | None = None):
        sizes.positive(self, d_ff=d_ff)
        self.attention = MultiHeadAttention(d_model, n_heads, dropout, device)
        self.norm1 = LayerNorm(d_model, device=device)
        self.ff_in = Linear(d_model, d_ff, device=device)
        self.ff_out = Linear(d_ff, d_model, device=device)
        self.norm2 = LayerNorm(d_model, device=device)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.norm_first = norm_first

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.ff_out(F.gelu(self.ff_in(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.norm_first:
            x = x + self.dropout1(self.attention(self.norm1(x)))
            return x + self.dropout2(self._feed_forward(self.norm2(x)))
        x = self.norm1(x + self.dropout1(self.attention(x)))
        return self.norm2(x + self.dropout2(self._feed_forward(x)))
