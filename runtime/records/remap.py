"""Renaming and selecting record keys: Burn's KeyRemapper (regex rules applied in order, each to the name the
previous one produced) and prefix filters. Renaming only: tensors and their data are untouched."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from kiln.ir import RecordError

__all__ = ["remap_names", "under_prefix"]

_DOLLAR = re.compile(r"\$(?:\$|(\d+)|\{(\w+)\})")


def _python_replacement(replacement: str) -> str:
    """A replacement in Burn's (Rust regex) syntax, `$1`, `${name}`, `$$`, as Python's `re` writes it."""
    escaped = replacement.replace("\\", "\\\\")
    return _DOLLAR.sub(lambda m: "$" if m[0] == "$$" else f"\\g<{m[1] or m[2]}>", escaped)


def _compile(rules: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern[str], str]]:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and all(isinstance(r, str) for r in rule)):
            raise RecordError(f"remap rule {rule!r} is not a (regex, replacement) pair of strings")
        try:
            compiled.append((re.compile(rule[0]), _python_replacement(rule[1])))
        except re.error as error:
            raise RecordError(f"remap rule {rule[0]!r} is not a regex: {error}") from None
    return compiled


def remap_names(names: Iterable[str], rules: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each name's new name, the rules applied in order (every match of a rule replaced); two names that end up
    the same are a RecordError naming both, as are rules that are not regexes or refer to a missing group."""
    compiled = _compile(rules)
    renamed: dict[str, str] = {}
    taken: dict[str, str] = {}
    for name in names:
        new = name
        for pattern, replacement in compiled:
            try:
                new = pattern.sub(replacement, new)
            except (re.error, IndexError) as error:
                raise RecordError(f"remap rule {pattern.pattern!r} on {name!r}: {error}") from None
        if new in taken:
            raise RecordError(f"remap sends both {taken[new]!r} and {name!r} to {new!r}")
        taken[new], renamed[name] = name, new
    return renamed


def under_prefix(name: str, prefixes: Sequence[str]) -> bool:
    """Whether `name` is one of `prefixes` or a path below one (`encoder` selects `encoder.fc.weight`, not
    `encoder2.weight`); a prefix ending in `.` selects only paths below it."""
    return any(name == p or name.startswith(p if p.endswith(".") else p + ".") for p in prefixes)
