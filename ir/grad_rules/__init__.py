"""The built-in gradient rules, one module per op family; importing this package registers them.

Imported lazily by `kiln.ir.gradients.load_rules` (through `rule_for`), never by `import kiln.ir`.
"""

from . import elementwise, linalg, nn, quant, random, reduction, shape, source  # noqa: F401
