"""Data-parallel execution on torch.distributed: the engine collectives run through, and the start-up check that the
ranks hold the same model. torch is imported only when an engine is made (`pip install 'kiln[distributed]'`)."""

from .agreement import check_same_model
from .engine import TorchEngine

__all__ = ["TorchEngine", "check_same_model"]
