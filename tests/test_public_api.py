"""The public names a Burn or PyTorch user reaches for: `kiln.nn` and `kiln.optim` as importable modules, and
every error and warning type kiln raises, at the top level."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kiln
from kiln.ir import errors


@pytest.mark.parametrize("name", ["kiln.nn", "kiln.nn.functional", "kiln.optim", "kiln.train"])
def test_public_subpackages_import_as_modules(name):
    # issue 11: "`import kiln.nn`, `from kiln.nn import Linear`, `from kiln.optim import AdamW`" must work
    module = importlib.import_module(name)
    assert module is importlib.import_module(name.replace("kiln.", "kiln.frontend.", 1))


def test_from_imports_in_a_fresh_interpreter():
    # the statements a user writes, run before anything else has imported kiln
    code = ("import kiln.nn.functional as F\nfrom kiln.nn import Linear\nfrom kiln.optim import AdamW\nimport kiln\n"
            "assert kiln.nn.Linear is Linear and kiln.optim.AdamW is AdamW and kiln.nn.functional is F")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_error_and_warning_type_is_exported():
    # issue 11: "Export `kiln.RecordError` and every error/warning type users catch"
    public = {name for name, value in vars(errors).items()
              if isinstance(value, type) and issubclass(value, Exception | Warning)}
    assert public == {"KilnError", "IRParseError", "ShapeError", "VerifyError", "RecordError", "PassError",
                      "ParamGroupError", "ParamGroupWarning", "TrainingStateWarning", "AutodiffWarning",
                      "DistributedError", "PrecisionWarning"}
    for name in public:
        assert getattr(kiln, name) is getattr(errors, name)
        assert name in kiln.__all__
