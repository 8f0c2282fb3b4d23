"""kiln: a deep-learning framework built as a compiler.

Modules trace into a graph IR (`kiln.ir`), passes transform it (`kiln.passes`), and `kiln.runtime` lowers it
through TVM and stores records; `kiln.frontend` is what users write, re-exported here whole.
"""

from kiln import ir, passes
from kiln.frontend import *  # noqa: F403  (the user-facing API, listed once in kiln.frontend.__all__)
from kiln.frontend import __all__ as _frontend_api

__all__ = [*_frontend_api, "ir", "passes"]
