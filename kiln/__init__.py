"""kiln: a deep-learning framework built as a compiler.

Modules trace into a graph IR (`kiln.ir`), passes transform it (`kiln.passes`), and `kiln.runtime` lowers it
through TVM and stores records; `kiln.frontend` is what users write, re-exported here whole, with the error and
warning types users catch.
"""

import sys

from kiln import ir, passes
from kiln.frontend import *  # noqa: F403  (the user-facing API, listed once in kiln.frontend.__all__)
from kiln.frontend import __all__ as _frontend_api
from kiln.ir.errors import *  # noqa: F403  (every error and warning type, listed once in kiln.ir.errors)
from kiln.ir.errors import __all__ as _error_types

# `import kiln.nn`, `import kiln.nn.functional as F`, `from kiln.optim import AdamW`, `from kiln.train import Learner`:
# the frontend packages under their public names, the same module objects `kiln.nn`, `kiln.optim`, `kiln.train` are.
for _name, _module in list(sys.modules.items()):
    if _name.startswith(("kiln.frontend.nn", "kiln.frontend.optim", "kiln.frontend.train")):
        sys.modules["kiln." + _name.removeprefix("kiln.frontend.")] = _module

__all__ = [*_frontend_api, *_error_types, "ir", "passes"]
