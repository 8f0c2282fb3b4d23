"""Wrapper that turns a failing schedule rule into "not applicable" so the next rule gets a chance."""

import logging
import os

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.target import Target

DEBUG_ENV = "KILN_DEBUG_SCHEDULES"

_log = logging.getLogger(__name__)


class Safe(dl.ScheduleRule):
    """Run `rule`, returning None instead of raising; set KILN_DEBUG_SCHEDULES=1 to re-raise."""

    def __init__(self, rule: dl.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        try:
            return self.rule.apply(func, target, tunable)
        except Exception:
            if os.environ.get(DEBUG_ENV) == "1":
                raise
            _log.info(
                "schedule rule %s failed; trying the next rule", type(self.rule).__name__, exc_info=True
            )
            return None

    def __repr__(self) -> str:
        return f"Safe({self.rule!r})"
