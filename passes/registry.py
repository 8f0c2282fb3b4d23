"""Pass registry: names map to `module:Class` and are imported only when a pipeline names them."""

from __future__ import annotations

import importlib

from kiln.ir import PassError

from .base import Pass

_PASSES: dict[str, str] = {
    "canonicalize": "kiln.passes.canonicalize:Canonicalize",
    "cse": "kiln.passes.cse:CSE",
    "dce": "kiln.passes.dce:DCE",
    "fold-constants": "kiln.passes.fold_constants:FoldConstants",
    "autodiff": "kiln.passes.autodiff:Autodiff",
    "checkpoint": "kiln.passes.checkpoint:Checkpoint",
    "train": "kiln.passes.train:Train",
    "valid": "kiln.passes.valid:Valid",
    "set-require-grad": "kiln.passes.set_require_grad:SetRequireGrad",
    "no-grad": "kiln.passes.no_grad:NoGrad",
    "freeze": "kiln.passes.freeze:Freeze",
    "unfreeze": "kiln.passes.unfreeze:Unfreeze",
    "set-require-grad-group": "kiln.passes.set_require_grad_group:SetRequireGradGroup",
    "freeze-group": "kiln.passes.freeze_group:FreezeGroup",
    "unfreeze-group": "kiln.passes.unfreeze_group:UnfreezeGroup",
    "to-device": "kiln.passes.to_device:ToDevice",
    "fork": "kiln.passes.fork:Fork",
    "reparameterize": "kiln.passes.reparameterize:Reparameterize",
    "materialize": "kiln.passes.materialize:Materialize",
    "quantize-weights": "kiln.passes.quantize_weights:QuantizeWeights",
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
