"""`kiln opt --list-passes` / `--help-pass`: every pass with its one-line description and its options (name,
type, default, doc), read from the pass dataclasses: a field's doc is the string literal written under it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any

from .base import Pass, option_text
from .registry import get_pass, pass_names


def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's attribute docstring (the string statement right after it), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a class made at run time): no docs
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, following in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[stmt.target.id] = " ".join(following.value.value.split())
    return docs


def _type_text(hint: Any) -> str:
    """A field's type as the user writes it: `int`, `bool`, `one of a|b`, `list of int`, `str (optional)`."""
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        return _type_text(next(a for a in args if a is not type(None))) + " (optional)"
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + "|".join(map(str, args))
    if typing.get_origin(hint) is tuple:
        return "list of " + _type_text(args[0])
    return getattr(hint, "__name__", str(hint))


def describe(cls: type[Pass]) -> str:
    """One pass: `name  description`, then one indented line per option that has a text form."""
    paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    summary = re.match(r"(.*?\.)(?:\s|$)", paragraph)
    lines = [f"{cls.name}  {summary.group(1) if summary else paragraph}".rstrip()]
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if "text" in f.metadata:  # a Python-only option (a ParamGroup object): not on the command line
            continue
        if f.default is dataclasses.MISSING:
            default = "required"
        else:
            default = "default " + ("none" if f.default is None else option_text(f.default) or "empty")
        key = f.name.replace("_", "-")
        lines.append(f"    {key}: {_type_text(hints[f.name])}, {default}" + (f"  {docs[f.name]}" if f.name in docs
                                                                               else ""))
    return "\n".join(lines) + "\n"


def list_passes() -> str:
    """Every registered pass, sorted by name."""
    return "".join(describe(get_pass(name)) for name in pass_names())
