"""Every error (and warning) kiln raises on bad input, in one place so each layer can raise and catch them."""

from __future__ import annotations

__all__ = ["AutodiffWarning", "DistributedError", "IRParseError", "KilnError", "ParamGroupError", "ParamGroupWarning",
           "PassError", "PrecisionWarning", "RecordError", "ShapeError", "TrainingStateWarning",
           "VerifyError"]  # what kiln raises or warns with


class KilnError(Exception):
    """Base class of kiln's own errors: bad input, never a bug."""


class IRParseError(KilnError):
    """Malformed `.kir` text; carries the file, line, column and offending token."""

    def __init__(self, message: str, line: int, column: int, token: str = "", source: str = "<kir>"):
        self.message, self.line, self.column, self.token, self.source = message, line, column, token, source
        at = f" at {token!r}" if token else ""
        super().__init__(f"{source}:{line}:{column}: {message}{at}")


class ShapeError(KilnError):
    """An op's operands or attributes do not fit its type rules; names the op and operand at fault."""


class VerifyError(KilnError):
    """A graph breaks an IR invariant (SSA, dangling symbol, type mismatch, malformed derivation)."""


class RecordError(KilnError):
    """A record or record file is unusable; names the file or path and the reason."""


class DistributedError(KilnError):
    """The ranks of a data-parallel group cannot train together (no engine, disagreeing models, a lost peer)."""


class PrecisionWarning(UserWarning):
    """A precision mode this CPU cannot run natively was replaced by f32 (once per process and CPU)."""


class PassError(KilnError):
    """A pipeline string, pass name or pass option is invalid, or a pass failed its checks."""


class ParamGroupError(KilnError):
    """A parameter-group pattern (regex, glob, id) is invalid."""


class ParamGroupWarning(UserWarning):
    """A pass's parameter group (or one of its `paths` terms) selects no parameter or flag: likely a typo."""


class TrainingStateWarning(UserWarning):
    """A module is compiled with training flags on: dropout and batch-norm statistics keep training behaviour."""


class AutodiffWarning(UserWarning):
    """A training computation whose parameters all live off autodiff: no gradient, so training changes nothing."""
