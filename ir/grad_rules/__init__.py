"""The built-in gradient rules, one module per op family; importing this package registers them.

`rule_for` lives here, not in `kiln.ir.gradients`, so that the rules import their vocabulary from `gradients` and
nothing imports back: the autodiff pass imports this package, `import kiln.ir` never does.
"""

from __future__ import annotations

from .. import registry
from ..gradients import GradientRule
from . import collective, elementwise, linalg, nn, quant, random, reduction, shape, source, spatial  # noqa: F401  (register the rules)


def rule_for(kind: str) -> GradientRule | None:
    """The gradient rule of `kind`, or None when it has none."""
    return registry.lookup(kind).rules.get("grad")
