"""Pipeline text: `"canonicalize,cse,freeze-group{paths=encoder.*,decoder.* value=false}"`.

Passes are separated by commas at the top level; options sit in braces, separated by spaces (or by
a comma before the next `key=`), as `key=value`; a value may be double-quoted to hold spaces or braces.
"""

from __future__ import annotations

import re

from kiln.ir import PassError

from .base import Pass
from .registry import get_pass

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")
_KEY = r"[A-Za-z][A-Za-z0-9_\-]*"
_OPTION = re.compile(rf'\s*({_KEY})=("(?:[^"\\]|\\.)*"|(?:[^\s{{}}",]|,(?!\s*{_KEY}=))*)\s*,?\s*')


def parse_pipeline(text: str) -> list[Pass]:
    """Parse pipeline text into pass instances; errors name the column and what was expected."""
    passes: list[Pass] = []
    text = text.rstrip()
    pos = len(text) - len(text.lstrip())  # columns count from the text as given
    while pos < len(text):
        m = _NAME.match(text, pos)
        if not m:
            raise PassError(f"pipeline column {pos + 1}: expected a pass name in {text!r}")
        name, column, pos = m.group(), pos + 1, m.end()
        options: dict[str, tuple[str, int]] = {}
        if pos < len(text) and text[pos] == "{":
            end = _closing_brace(text, pos)
            options = _parse_options(text[pos + 1:end], pos + 2, text)
            pos = end + 1
        passes.append(_make_pass(name, column, options))
        if pos < len(text):
            if text[pos] != ",":
                raise PassError(f"pipeline column {pos + 1}: expected ',' after pass {name!r} in {text!r}")
            comma = pos
            pos += 1
            while pos < len(text) and text[pos] == " ":
                pos += 1
            if pos == len(text):
                raise PassError(f"pipeline column {comma + 1}: {text!r} ends with ','")
    return passes


def _make_pass(name: str, column: int, options: dict[str, tuple[str, int]]) -> Pass:
    """The named pass with its options; an unknown pass or option, or a bad value, is reported at its column."""
    try:
        cls = get_pass(name)
    except PassError as e:
        raise PassError(f"pipeline column {column}: {e}") from None
    for key, (value, at) in options.items():
        try:
            cls.option(key, value)
        except PassError as e:
            raise PassError(f"pipeline column {at}: {e}") from None
    return cls.from_options({key: value for key, (value, _) in options.items()})


def _closing_brace(text: str, start: int) -> int:
    quoted = False
    for i in range(start + 1, len(text)):
        c = text[i]
        if c == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif c == "}" and not quoted:
            return i
    raise PassError(f"pipeline column {start + 1}: '{{' is never closed in {text!r}")


def _parse_options(body: str, column: int, text: str) -> dict[str, tuple[str, int]]:
    """Each option's value and the column of its key."""
    options: dict[str, tuple[str, int]] = {}
    pos = 0
    while pos < len(body) and body[pos:].strip():
        m = _OPTION.match(body, pos)
        if not m:
            raise PassError(f"pipeline column {column + pos}: expected key=value options in {text!r}")
        key, value, at = m.group(1), m.group(2), column + m.start(1)
        if value.startswith('"'):
            value = value[1:-1].replace('\\"', '"')
        if key in options:
            raise PassError(f"pipeline column {at}: option {key!r} given twice")
        options[key] = (value, at)
        pos = m.end()
    return options


def pipeline_text(passes: list[Pass]) -> str:
    return ",".join(p.pipeline_text() for p in passes)
