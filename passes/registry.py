"""Pass registry: names map to `module:Class` and are imported only when a pipeline names them."""

from __future__ import annotations

import importlib

from kiln.ir import PassError

from .base import Pass

_PASSES: dict[str, str] = {
    "canonicalize": "kiln.passes.canonicalize:Canonicalize",
    "cse": "kiln.passes.cse:CSE",
    "factor-lora": "kiln.passes.factor_lora:FactorLora",
    "dce": "kiln.passes.dce:DCE",
    "fold-constants": "kiln.passes.fold_constants:FoldConstants",
    "autodiff": "kiln.passes.autodiff:Autodiff",
    "checkpoint": "kiln.passes.checkpoint:Checkpoint",
    "train": "kiln.passes.state:Train",
    "valid": "kiln.passes.state:Valid",
    "set-require-grad": "kiln.passes.state:SetRequireGrad",
    "no-grad": "kiln.passes.state:NoGrad",
    "freeze": "kiln.passes.state:Freeze",
    "unfreeze": "kiln.passes.state:Unfreeze",
    "set-require-grad-group": "kiln.passes.state:SetRequireGradGroup",
    "freeze-group": "kiln.passes.state:FreezeGroup",
    "unfreeze-group": "kiln.passes.state:UnfreezeGroup",
    "to-device": "kiln.passes.state:ToDevice",
    "fork": "kiln.passes.state:Fork",
    "reparameterize": "kiln.passes.reparameterize:Reparameterize",
    "materialize": "kiln.passes.materialize:Materialize",
    "quantize-weights": "kiln.passes.quantize_weights:QuantizeWeights",
    "data-parallel": "kiln.passes.data_parallel:DataParallel",
    "sync-batch-norm": "kiln.passes.data_parallel:SyncBatchNorm",
}


def register_pass(name: str, target: str) -> None:
    """Register a pass class by `module:Class` path without importing it."""
    _PASSES[name] = target


def pass_names() -> list[str]:
    return sorted(_PASSES)


def get_pass(name: str) -> type[Pass]:
    if name not in _PASSES:
        raise PassError(f"unknown pass {name!r} (known: {', '.join(pass_names())})")
    module, cls = _PASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)
