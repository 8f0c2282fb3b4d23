"""The pass interface: a pass is a frozen dataclass with a `name`; its fields are its typed options."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, ClassVar

from kiln.ir import Graph, PassError


@dataclasses.dataclass(frozen=True)
class Pass:
    """Turns a graph into a new graph, never mutating its input. Options double as command-line options."""

    name: ClassVar[str]
    preserves_semantics: ClassVar[bool] = True  # module-state passes change behaviour on purpose

    def apply(self, graph: Graph) -> Graph:
        raise NotImplementedError

    @classmethod
    def from_options(cls, options: dict[str, str]) -> Pass:
        """Build the pass from `key=value` text options, converting each to its field's type."""
        kwargs = dict(cls.option(key, text) for key, text in options.items())
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise PassError(f"pass {cls.name!r}: {e}") from None

    @classmethod
    def option(cls, key: str, text: str) -> tuple[str, Any]:
        """The field a `key=value` text option sets, and its value converted to the field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        field_name = key.replace("-", "_")
        if field_name not in fields:
            known = ", ".join(f.replace("_", "-") for f in fields) or "none"
            raise PassError(f"pass {cls.name!r} has no option {key!r} (options: {known})")
        try:
            return field_name, _convert(cls.name, key, text, typing.get_type_hints(cls)[field_name])
        except _NoTextForm:
            advice = fields[field_name].metadata.get("text")  # what to write instead, e.g. for a Python object
            raise PassError(f"pass {cls.name!r} option {key} has no text form"
                            + (f"; {advice}" if advice else "")) from None

    def pipeline_text(self) -> str:
        """This pass as pipeline text, options included when they differ from the defaults."""
        opts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                opts.append(f"{f.name.replace('_', '-')}={option_text(value)}")
        return self.name + ("{" + " ".join(opts) + "}" if opts else "")


def option_text(value: Any) -> str:
    """An option value as pipeline text (the parser reads it back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    if re.search(r'[\s{}"]', text):  # quoted, as the pipeline parser reads it back
        return '"' + text.replace('"', '\\"') + '"'
    return text


class _NoTextForm(Exception):
    """An option whose type (a Python object, like a ParamGroup) cannot be written in pipeline text."""


def _convert(pass_name: str, key: str, text: str, hint: Any) -> Any:
    """`text` as a value of type `hint` (bool, int, float, str, a Literal, a tuple of those, or optional)."""
    where = f"pass {pass_name!r} option {key}={text!r}"
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:  # an optional option: convert to the type it holds
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        if text not in ("true", "false"):
            raise PassError(f"{where}: expected true or false")
        return text == "true"
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise PassError(f"{where}: expected {'an integer' if hint is int else 'a number'}") from None
    if typing.get_origin(hint) is tuple:  # comma-separated items, each converted to the item type
        return tuple(_convert(pass_name, key, p, typing.get_args(hint)[0]) for p in text.split(",") if p)
    if typing.get_origin(hint) is typing.Literal:
        if text not in typing.get_args(hint):
            raise PassError(f"{where}: expected one of {', '.join(typing.get_args(hint))}")
        return text
    if hint is str:
        return text
    raise _NoTextForm
