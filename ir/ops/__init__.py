"""The built-in op kinds; importing this package registers them."""

from . import collective, elementwise, linalg, nn, quant, random, reduction, shape, source, spatial  # noqa: F401
