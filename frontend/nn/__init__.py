"""kiln.nn: layers built on kiln.Module."""

from . import functional
from .attention import MultiHeadAttention, TransformerEncoderLayer
from .basic import GELU, Dropout, ReLU, Sequential, SiLU
from .linear import Embedding, Linear
from .norm import LayerNorm, RMSNorm

__all__ = ["GELU", "Dropout", "Embedding", "LayerNorm", "Linear", "MultiHeadAttention", "RMSNorm", "ReLU",
           "Sequential", "SiLU", "TransformerEncoderLayer", "functional"]
