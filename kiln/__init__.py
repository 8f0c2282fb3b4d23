"""kiln: a deep-learning framework built as a compiler.

Modules trace into a graph IR (`kiln.ir`), passes transform it (`kiln.passes`), and `kiln.runtime` lowers it
through TVM and stores records; `kiln.frontend` is what users write, re-exported here.
"""

from kiln import ir, passes
from kiln.frontend import (
    Device,
    DTypePolicy,
    Flag,
    Lora,
    Module,
    ModuleMapper,
    ModuleRecord,
    ModuleVisitor,
    Param,
    ParamGroup,
    QLora,
    Quantizer,
    QuantScheme,
    Reparam,
    Reparameterizer,
    Tensor,
    nn,
    tensor,
    trace,
)

__all__ = ["DTypePolicy", "Device", "Flag", "Lora", "Module", "ModuleMapper", "ModuleRecord", "ModuleVisitor",
           "Param", "ParamGroup", "QLora", "QuantScheme", "Quantizer", "Reparam", "Reparameterizer", "Tensor", "ir",
           "nn", "passes", "tensor", "trace"]
