"""kiln.passes: the pass manager, pipelines from strings, and the passes (imported lazily by name)."""

from .base import Pass
from .manager import PassCrash, PassManager
from .pipeline import parse_pipeline, pipeline_text
from .registry import get_pass, pass_names, register_pass

__all__ = [
    "Pass", "PassCrash", "PassManager", "get_pass", "parse_pipeline", "pass_names", "pipeline_text", "register_pass",
]
