"""Pipeline text: `"canonicalize,cse,freeze-group{paths=encoder.*,decoder.* value=false}"`.

Passes are separated by commas at the top level; options sit in braces, separated by spaces, as
`key=value`; a value may be double-quoted to hold spaces or braces.
"""

from __future__ import annotations

import re

from kiln.ir import PassError

from .base import Pass
from .registry import get_pass

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")
_OPTION = re.compile(r'\s*([A-Za-z][A-Za-z0-9_\-]*)=("(?:[^"\\]|\\.)*"|[^\s{}"]*)\s*')


def parse_pipeline(text: str) -> list[Pass]:
    """Parse pipeline text into pass instances; errors name the column and what was expected."""
    passes: list[Pass] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _NAME.match(text, pos)
        if not m:
            raise PassError(f"pipeline column {pos + 1}: expected a pass name in {text!r}")
        name, pos = m.group(), m.end()
        options: dict[str, str] = {}
        if pos < len(text) and text[pos] == "{":
            end = _closing_brace(text, pos)
            options = _parse_options(text[pos + 1:end], pos + 2, text)
            pos = end + 1
        passes.append(get_pass(name).from_options(options))
        if pos < len(text):
            if text[pos] != ",":
                raise PassError(f"pipeline column {pos + 1}: expected ',' after pass {name!r} in {text!r}")
            pos += 1
            while pos < len(text) and text[pos] == " ":
                pos += 1
            if pos == len(text):
                raise PassError(f"pipeline {text!r} ends with ','")
    return passes


def _closing_brace(text: str, start: int) -> int:
    quoted = False
    for i in range(start + 1, len(text)):
        c = text[i]
        if c == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif c == "}" and not quoted:
            return i
    raise PassError(f"pipeline column {start + 1}: '{{' is never closed in {text!r}")


def _parse_options(body: str, column: int, text: str) -> dict[str, str]:
    options: dict[str, str] = {}
    pos = 0
    while pos < len(body) and body[pos:].strip():
        m = _OPTION.match(body, pos)
        if not m:
            raise PassError(f"pipeline column {column + pos}: expected key=value options in {text!r}")
        key, value = m.group(1), m.group(2)
        if value.startswith('"'):
            value = value[1:-1].replace('\\"', '"')
        if key in options:
            raise PassError(f"pipeline column {column + pos}: option {key!r} given twice")
        options[key] = value
        pos = m.end()
    return options


def pipeline_text(passes: list[Pass]) -> str:
    return ",".join(p.pipeline_text() for p in passes)
