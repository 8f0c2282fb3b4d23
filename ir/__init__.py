"""kiln.ir: the graph IR, its text form, verifier, interpreter and rewrite machinery.

This layer imports nothing from the rest of kiln, nor TVM, onnx or torch. Importing it registers the built-in op
kinds (`ops`), so the registry never imports them back.
"""

from . import ops  # noqa: F401  (registers the built-in op kinds)
from .builder import Builder, FunctionBuilder
from .dtypes import DType
from .errors import (
    AutodiffWarning,
    DistributedError,
    IRParseError,
    KilnError,
    ParamGroupError,
    ParamGroupWarning,
    PassError,
    PrecisionWarning,
    RecordError,
    ShapeError,
    TrainingStateWarning,
    VerifyError,
)
from .graph import FlagNode, Function, Graph, Init, Op, Operand, ParamNode, ReparamNode, SymRef, Value
from .hashing import structural_hash
from .interpreter import Interpreter, evaluate_op, interpret
from .layout import Layout
from .location import FileLoc, FusedLoc, Location, NameLoc, fuse, located
from .nx import to_dot, to_networkx
from .param_id import ParamId, new_param_id, seed_param_ids
from .parser import parse, parse_file
from .printer import print_graph
from .registry import OpDef, lookup, ops_with, registered
from .rewrite import Rewriter, prune, rewrite
from .structural import assert_structurally_equal, canonical_text, structurally_equal
from .traits import Trait
from .types import TensorType
from .verifier import verify

__all__ = [
    "AutodiffWarning", "Builder", "DType", "DistributedError", "FlagNode", "Function", "FunctionBuilder", "Graph",
    "IRParseError", "Init", "Interpreter", "KilnError", "Layout", "Op", "OpDef", "Operand", "ParamGroupError",
    "ParamGroupWarning",
    "ParamId", "ParamNode", "PassError", "PrecisionWarning", "RecordError", "ReparamNode",
    "Rewriter", "ShapeError", "SymRef", "TensorType", "Trait", "TrainingStateWarning", "Value", "VerifyError",
    "evaluate_op", "interpret",
    "lookup", "new_param_id", "ops_with", "parse", "parse_file", "print_graph", "prune", "registered", "rewrite",
    "seed_param_ids", "structural_hash", "to_dot", "to_networkx", "verify",
    "assert_structurally_equal", "canonical_text", "structurally_equal",
    "FileLoc", "FusedLoc", "Location", "NameLoc", "fuse", "located",
]
