"""ParamGroup: which parameters and flags an operation touches, with Burn's matching rules.

`matches(id, path)` is `matcher and not any(excludes)`. Path matchers (paths, predicates, regexes,
globs) never match a value without a path; `all()` and `from_ids` do. `fuse` ORs two groups and drops
their excludes; `exclude(g)` adds g's matcher and ignores g's own excludes. Globs match a whole path:
`*` stays inside one dot-separated segment, `**` crosses segments.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kiln.ir import ParamGroupError, ParamId

Predicate = Callable[[str | None, Any], bool]  # (path, the parameter or flag: id, type, grad, device)


@dataclass(frozen=True)
class _Matcher:
    kind: str
    items: tuple = ()
    any: bool = False

    def __call__(self, id: int, path: str | None, value: Any = None) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "ids":
            return id in self.items
        if self.kind == "fused":
            return any(m(id, path, value) for m in self.items)
        if self.kind == "fn":
            return bool(self.items[0](path, value))
        if path is None:
            return False
        test = _PATH_TESTS[self.kind]
        hits = (test(item, path) for item in self.items)
        return any(hits) if self.any else all(hits)


    def __str__(self) -> str:
        """The constructor call that builds this matcher, for messages."""
        if self.kind == "all":
            return "all()"
        if self.kind == "fused":
            return ".fuse(".join(map(str, self.items)) + ")" * (len(self.items) - 1)
        if self.kind == "fn":
            return f"from_fn({getattr(self.items[0], '__name__', 'predicate')})"
        if self.kind == "ids":
            return f"from_ids([{', '.join(map(str, self.items))}])"
        any_ = "any_" if self.any and self.kind in ("predicates", "regexes") else ""
        return f"from_{any_}{self.kind}({[getattr(i, 'pattern', i) for i in self.items]})"


_PATH_TESTS: dict[str, Callable[[Any, str], bool]] = {
    "paths": lambda p, path: p == path,
    "predicates": lambda s, path: s in path,
    "regexes": lambda r, path: r.search(path) is not None,
    "globs": lambda g, path: glob_regex(g).fullmatch(path) is not None,
}


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ParamGroupError(f"invalid regex {pattern!r}: {e}") from None


@functools.cache
def glob_regex(glob: str) -> re.Pattern:
    """`*` matches within one path segment, `**` across segments, `?` one character."""
    if not glob:
        raise ParamGroupError("empty glob pattern")
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif glob[i] == "?":
            out.append(r"[^.]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out))


@dataclass(frozen=True)
class ParamGroup:
    """A selection of parameters and flags by id or module path."""

    matcher: _Matcher
    excludes: tuple[_Matcher, ...] = ()

    @staticmethod
    def all() -> ParamGroup:
        return ParamGroup(_Matcher("all"))

    @staticmethod
    def from_ids(ids: Iterable[int]) -> ParamGroup:
        try:
            return ParamGroup(_Matcher("ids", tuple(frozenset(map(ParamId, ids)))))
        except ValueError as e:
            raise ParamGroupError(str(e)) from None

    @staticmethod
    def from_path(path: str) -> ParamGroup:
        return ParamGroup.from_paths([path])

    @staticmethod
    def from_paths(paths: Iterable[str]) -> ParamGroup:
        return ParamGroup(_Matcher("paths", tuple(paths), any=True))

    @staticmethod
    def from_predicate(substring: str) -> ParamGroup:
        return ParamGroup.from_predicates([substring])

    @staticmethod
    def from_predicates(substrings: Iterable[str]) -> ParamGroup:
        """Paths containing every substring."""
        return ParamGroup(_Matcher("predicates", tuple(substrings)))

    @staticmethod
    def from_any_predicates(substrings: Iterable[str]) -> ParamGroup:
        """Paths containing any of the substrings."""
        return ParamGroup(_Matcher("predicates", tuple(substrings), any=True))

    @staticmethod
    def from_regex(pattern: str) -> ParamGroup:
        return ParamGroup.from_regexes([pattern])

    @staticmethod
    def from_regexes(patterns: Iterable[str]) -> ParamGroup:
        """Paths every regex matches somewhere in (unanchored, like Rust's `is_match`)."""
        return ParamGroup(_Matcher("regexes", tuple(_compile(p) for p in patterns)))

    @staticmethod
    def from_any_regexes(patterns: Iterable[str]) -> ParamGroup:
        return ParamGroup(_Matcher("regexes", tuple(_compile(p) for p in patterns), any=True))

    @staticmethod
    def from_glob(glob: str) -> ParamGroup:
        return ParamGroup.from_globs([glob])

    @staticmethod
    def from_globs(globs: Iterable[str]) -> ParamGroup:
        """Paths matching any of the globs."""
        globs = tuple(globs)
        for g in globs:
            glob_regex(g)  # invalid globs fail here, not at the first match
        return ParamGroup(_Matcher("globs", globs, any=True))

    @staticmethod
    def ids_from_module(module: Any) -> ParamGroup:
        """The ids of every parameter and flag of `module` (anything with Burn's `visit`), as an explicit set."""
        ids: list[int] = []

        class _Collect:
            def __getattr__(self, name: str) -> Callable[..., None]:
                if name in ("visit_param", "visit_flag"):
                    return lambda path, value: ids.append(value.id)
                return lambda *args: None

        module.visit(_Collect())
        return ParamGroup.from_ids(ids)

    @staticmethod
    def from_fn(predicate: Predicate) -> ParamGroup:
        """Values for which `predicate(path, value)` is true; `value` has `id`, `type`, `grad` and `device`."""
        return ParamGroup(_Matcher("fn", (predicate,)))

    def exclude(self, other: ParamGroup) -> ParamGroup:
        return ParamGroup(self.matcher, self.excludes + (other.matcher,))

    def fuse(self, other: ParamGroup) -> ParamGroup:
        return ParamGroup(_Matcher("fused", (self.matcher, other.matcher)))

    def __str__(self) -> str:
        return str(self.matcher) + "".join(f".exclude({e})" for e in self.excludes)

    def matches(self, id: int, path: str | None, value: Any = None) -> bool:
        """Whether the parameter or flag with this id and path (and, for predicates, value) is selected."""
        return self.matcher(id, path, value) and not any(e(id, path, value) for e in self.excludes)

    @staticmethod
    def from_option_text(paths: Iterable[str], exclude: Iterable[str] = ()) -> ParamGroup:
        """The group a pass's text options select: globs, `re:REGEX` or `id:` terms (`id:0xHEX` or Burn's form
        `id:83h0200000000`), ORed."""
        groups = [_term(t) for t in paths] or [ParamGroup.all()]
        group = groups[0]
        for g in groups[1:]:
            group = group.fuse(g)
        for t in exclude:
            group = group.exclude(_term(t))
        return group


def _term(text: str) -> ParamGroup:
    if text.startswith("re:"):
        return ParamGroup.from_regex(text[3:])
    if text.startswith("id:"):
        try:
            return ParamGroup.from_ids([ParamId.from_text(text[3:])])
        except ValueError as e:
            raise ParamGroupError(f"group term {text!r}: {e}") from None
    return ParamGroup.from_glob(text)
