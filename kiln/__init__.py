"""kiln: a deep-learning framework built as a compiler.

Modules trace into a graph IR (`kiln.ir`), passes transform it (`kiln.passes`), and `kiln.runtime` lowers it
through TVM and stores records; `kiln.frontend` is what users write.
"""

from kiln import ir, passes

__all__ = ["ir", "passes"]
