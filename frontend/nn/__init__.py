"""kiln.nn: layers built on kiln.Module."""

from . import functional
from .attention import MultiHeadAttention, TransformerEncoderLayer
from .basic import GELU, Dropout, ReLU, Sequential, SiLU
from .conv import AdaptiveAvgPool2d, AvgPool2d, Conv1d, Conv2d, MaxPool2d
from .linear import Embedding, Linear
from .loss import bce_with_logits, cross_entropy, mse_loss
from .norm import BatchNorm, BatchNorm1d, BatchNorm2d, LayerNorm, RMSNorm

__all__ = ["GELU", "AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d",
           "Dropout", "Embedding", "LayerNorm", "Linear", "MaxPool2d", "MultiHeadAttention", "RMSNorm", "ReLU",
           "Sequential", "SiLU", "TransformerEncoderLayer", "bce_with_logits", "cross_entropy", "functional",
           "mse_loss"]
