"""The `.kir` text parser. Every malformed input raises IRParseError with line:column and the token."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import init as initializers
from .builder import FunctionBuilder
from .devices import checkpointing_name, device_name
from .dtypes import DType
from .errors import IRParseError, KilnError, ShapeError
from .gcpause import gc_paused
from .graph import FlagNode, Graph, Init, Node, Operand, ParamNode, ReparamNode, SymRef, Value, untied_id_claims
from .layout import Layout
from .location import FileLoc, FusedLoc, Location, NameLoc
from .param_id import ParamId
from .registry import infer
from .types import TensorType

_DIM_SPLIT = re.compile(r"x(?![^{]*\})")  # the `x` between dims, not one inside a dim name `?{...}`
_NAME = r'(?:[A-Za-z0-9_][A-Za-z0-9_.$\-]*|"(?:[^"\\\n]|\\.)*")'
_TOKEN = re.compile(rf"""
    (?P<nl>\n) | (?P<ws>[ \t\r]+) | (?P<comment>//[^\n]*)
  | (?P<type>tensor<[^<>\n]*>)
  | (?P<sym>@{_NAME}) | (?P<val>%{_NAME})
  | (?P<num>-?(?:inf\b|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?))
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<arrow>->) | (?P<punct>[{{}}()\[\]<>,=:])
  | (?P<error>.)""", re.VERBOSE)
_MAX_DEPTH = 32

Token = tuple[str, str, int, int]  # kind, text, line, column


def tokenize(text: str, source: str) -> Iterator[Token]:
    """The tokens of `text`, ending with eof; lazily, as a list of them takes more memory than the graph."""
    line, line_start = 1, 0
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "nl":
            line, line_start = line + 1, m.end()
        elif kind == "error":
            raise IRParseError("unexpected character", line, m.start() - line_start + 1, m.group(), source)
        elif kind not in ("ws", "comment"):
            yield (kind, m.group(), line, m.start() - line_start + 1)  # type: ignore[misc]
    yield ("eof", "", line, len(text) - line_start + 1)


class Parser:
    """Recursive descent over the tokens with one token of lookahead, building through FunctionBuilder so
    inference runs once."""

    def __init__(self, text: str, source: str = "<kir>"):
        self.source = source
        self.tokens = tokenize(text, source)
        self.tok = next(self.tokens)
        self.symbols: dict[str, Node] = {}

    # -- token helpers ------------------------------------------------------------------------------
    def peek(self) -> Token:
        return self.tok

    def next(self) -> Token:
        tok = self.tok
        if tok[0] != "eof":
            self.tok = next(self.tokens)
        return tok

    def error(self, message: str, tok: Token | None = None) -> IRParseError:
        tok = tok or self.peek()
        return IRParseError(message, tok[2], tok[3], tok[1] or "end of input", self.source)

    def expect(self, text: str) -> Token:
        tok = self.next()
        if tok[1] != text or tok[0] in ("str", "sym", "val"):
            raise self.error(f"expected {text!r}", tok)
        return tok

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok[1] == text and tok[0] in ("punct", "arrow", "ident"):
            self.next()
            return True
        return False

    def expect_kind(self, kind: str, what: str) -> Token:
        tok = self.next()
        if tok[0] != kind:
            raise self.error(f"expected {what}", tok)
        return tok

    def name_of(self, tok: Token) -> str:
        body = tok[1][1:]
        if body.startswith('"'):
            try:
                return json.loads(body)
            except ValueError:
                raise self.error("malformed quoted name", tok) from None
        return body

    # -- grammar -------------------------------------------------------------------------------------
    def parse_module(self) -> Graph:
        self.expect("module")
        name = self.name_of(self.expect_kind("sym", "a module name like @MLP"))
        self.expect("{")
        params: dict[str, ParamNode] = {}
        flags: dict[str, FlagNode] = {}
        reparams: dict[str, ReparamNode] = {}
        functions = {}
        declared: dict[str, Token] = {}  # param name -> its declaration, where an id clash is reported
        while not self.accept("}"):
            tok = self.peek()
            if tok[1] == "param":
                node: Node = self.parse_param()
                params[node.name], declared[node.name] = node, tok
            elif tok[1] == "flag":
                node = self.parse_flag()
                flags[node.name] = node
            elif tok[1] == "reparam":
                node = self.parse_reparam()
                reparams[node.name] = node
            elif tok[1] == "func":
                fn = self.parse_function()
                if fn.name in functions:
                    raise self.error(f"function @{fn.name} is defined twice", tok)
                functions[fn.name] = fn
                continue
            else:
                raise self.error("expected 'param', 'flag', 'reparam', 'func' or '}'", tok)
            if node.name in self.symbols:
                raise self.error(f"symbol @{node.name} is declared twice", tok)
            self.symbols[node.name] = node
        for first, node in untied_id_claims(params.values()):
            raise self.error(f"param @{node.name} has ParamId {ParamId(node.id)}, as @{first.name} does, but the "
                             "two differ (one id is one parameter)", declared[node.name])
        self.expect_kind("eof", "end of input after the module")
        return Graph(name, params, flags, reparams, functions)

    def parse_type(self) -> TensorType:
        tok = self.expect_kind("type", "a tensor type like tensor<2x3xf32>")
        *dims, dtype = _DIM_SPLIT.split(tok[1][len("tensor<"):-1])
        if dtype not in DType.__members__:
            raise self.error(f"unknown dtype {dtype!r}", tok)
        axes: list[int | str | None] = []
        for d in dims:
            if d == "?":
                axes.append(None)
            elif d.startswith("?{") and d.endswith("}") and len(d) > 3:
                axes.append(d[2:-1])
            elif d.isascii() and d.isdigit() and len(d) < 19:
                axes.append(int(d))
            else:
                raise self.error(f"bad dimension {d!r}", tok)
        try:
            return TensorType.of(axes, DType[dtype])
        except ShapeError as e:
            raise self.error(str(e), tok) from None

    def parse_attr_dict(self, parse_value=None) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        if not self.accept("{"):
            return attrs
        if self.accept("}"):
            return attrs
        while True:
            key_tok = self.expect_kind("ident", "an attribute name")
            self.expect("=")
            if key_tok[1] in attrs:
                raise self.error(f"attribute {key_tok[1]!r} is given twice", key_tok)
            attrs[key_tok[1]] = (parse_value or self.parse_attr_value)(key_tok[1])
            if self.accept("}"):
                return attrs
            self.expect(",")

    def parse_attr_value(self, key: str = "", depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.error(f"attribute nested deeper than {_MAX_DEPTH} levels")
        if self.peek()[0] == "type":
            return self.parse_type()
        tok = self.next()
        kind, text = tok[0], tok[1]
        if kind == "num":
            return self.number(tok)
        if kind == "str":
            try:
                return json.loads(text)
            except ValueError:
                raise self.error("malformed string", tok) from None
        if kind == "ident":
            if text in ("true", "false"):
                return text == "true"
            if text in ("inf", "nan"):
                return float(text)
            if text in DType.__members__:
                return DType[text]
            if text == "dense":
                return self.parse_dense()
        if text == "[" and kind == "punct":
            items = []
            if self.accept("]"):
                return tuple(items)
            while True:
                items.append(self.parse_attr_value(key, depth + 1))
                if self.accept("]"):
                    return tuple(items)
                self.expect(",")
        raise self.error("expected an attribute value", tok)

    def number(self, tok: Token) -> int | float:
        text = tok[1]
        try:
            return float(text) if any(c in text for c in ".eEin") else int(text)
        except ValueError:  # an integer longer than Python converts
            raise self.error("number too long", tok) from None

    def parse_dense(self, codes: bool = False) -> np.ndarray:
        """`dense<type, elements>`; `codes` also admits i4/u4 quantization codes (parameter data only)."""
        self.expect("<")
        type_tok = self.peek()
        t = self.parse_type()
        if not t.is_static or (t.dtype.is_packed and not (codes and t.dtype.is_int_code)):
            raise self.error("dense data needs a static, unpacked type" + (" or i4/u4 codes" if codes else ""),
                             type_tok)
        self.expect(",")
        if self.accept("["):
            values = []
            if not self.accept("]"):
                while True:
                    values.append(self.parse_element(t.dtype))
                    if self.accept("]"):
                        break
                    self.expect(",")
            if len(values) != t.numel():
                raise self.error(f"dense data has {len(values)} elements but {t} needs {t.numel()}", type_tok)
            with np.errstate(over="ignore"):  # a float beyond f16/bf16/f32 range rounds to inf
                arr = np.array(values, dtype=object).astype(t.dtype.numpy) if values else np.zeros(0, t.dtype.numpy)
            arr = arr.reshape(t.shape)
        else:
            value = self.parse_element(t.dtype)
            try:
                with np.errstate(over="ignore"):
                    arr = np.full(t.shape, value, dtype=t.dtype.numpy)
            except (MemoryError, ValueError):
                raise self.error(f"dense data of type {t} is too large", type_tok) from None
        self.expect(">")
        return arr

    def parse_element(self, dtype: DType) -> Any:
        """One dense element, checked against the element type so that no value is silently changed."""
        tok = self.next()
        if tok[0] == "num":
            value = self.number(tok)
        elif tok[0] == "ident" and tok[1] in ("true", "false", "nan", "inf"):
            value = tok[1] == "true" if tok[1] in ("true", "false") else float(tok[1])
        else:
            raise self.error("expected a number or boolean", tok)
        if (dtype is DType.bool) != isinstance(value, bool):
            raise self.error(f"expected {'true or false' if dtype is DType.bool else 'a number'} for {dtype.value}",
                             tok)
        if dtype.is_int or dtype.is_int_code:
            low, high = dtype.int_range
            if not isinstance(value, int):
                raise self.error(f"{dtype.value} element is not an integer", tok)
            if not low <= value <= high:
                raise self.error(f"{value} is out of range for {dtype.value}", tok)
        elif dtype.is_float:
            try:
                value = float(value)
            except OverflowError:
                raise self.error(f"{dtype.value} element is out of range", tok) from None
        return value

    def parse_param(self) -> ParamNode:
        self.expect("param")
        tok = self.expect_kind("sym", "a parameter name")
        self.expect(":")
        t = self.parse_type()
        attrs = self.parse_attr_dict(self.parse_param_attr)
        if "id" not in attrs:
            raise self.error(f"param @{self.name_of(tok)} has no id", tok)
        grad = attrs.get("grad", False)
        known = {"id", "init", "data", "grad", "configured_grad", "device", "autodiff", "checkpointing", "buffer",
                 "layout"}
        extra = set(attrs) - known
        if extra:
            raise self.error(f"unknown param attribute {sorted(extra)[0]!r}", tok)
        data = attrs.get("data")
        if data is not None and (data.shape != t.shape or DType.from_numpy(data.dtype) is not t.dtype):
            raise self.error(f"param data does not have type {t}", tok)
        layout = attrs.get("layout")
        if layout is not None:
            try:
                layout[0].check(t.shape)
            except ShapeError as e:
                raise self.error(f"param @{self.name_of(tok)}: {e}", layout[1]) from None
        return ParamNode(self.name_of(tok), t, attrs["id"], attrs.get("init"), data, grad,
                         attrs.get("configured_grad", grad), attrs.get("device", "cpu"), attrs.get("autodiff", False),
                         attrs.get("checkpointing"), attrs.get("buffer", False), layout and layout[0])

    def parse_param_attr(self, key: str) -> Any:
        tok = self.peek()
        if key == "init":
            return self.parse_init()
        if key == "layout":
            return self.parse_layout(), tok
        if key == "data" and tok[1] == "elided":
            self.next()
            return None
        if key == "data" and tok[:2] == ("ident", "dense"):
            self.next()
            return self.parse_dense(codes=True)
        value = self.parse_attr_value(key)
        want = {"id": str, "grad": bool, "configured_grad": bool, "device": str, "data": np.ndarray,
                "autodiff": bool, "checkpointing": str, "buffer": bool}.get(key)
        if want is not None and not isinstance(value, want):
            raise self.error(f"param attribute {key!r} has the wrong kind of value", tok)
        if key == "id":
            return self.param_id(value, tok)
        if key in ("device", "checkpointing"):
            try:
                return (device_name if key == "device" else checkpointing_name)(value)
            except ValueError as e:
                raise self.error(str(e), tok) from None
        return value

    def param_id(self, text: str, tok: Token) -> ParamId:
        try:
            return ParamId.from_text(text)
        except ValueError as e:
            raise self.error(str(e), tok) from None

    def parse_layout(self) -> Layout:
        """`permute[1, 0]`, `reshape[6]` or `permute[1, 0] reshape[6]`: a parameter's file form."""
        first = self.peek()
        dims: dict[str, tuple[int, ...]] = {}
        while self.peek()[:2] in (("ident", "permute"), ("ident", "reshape")) and self.peek()[1] not in dims:
            word = self.next()[1]
            value = self.parse_attr_value(word)
            if not isinstance(value, tuple) or not all(type(d) is int for d in value):
                raise self.error(f"layout {word} needs a list of integers like {word}[1, 0]", first)
            dims[word] = value
        if not dims:
            raise self.error("expected a layout like permute[1, 0] or reshape[6]", first)
        try:
            return Layout(dims.get("permute"), dims.get("reshape"))
        except ShapeError as e:
            raise self.error(str(e), first) from None

    def parse_init(self) -> Init:
        tok = self.expect_kind("ident", "an initializer like kaiming_uniform(a = 2.0)")
        if tok[1] == initializers.PYTHON:
            raise self.error("a Python initializer (init = python) cannot be read from text: it exists only in "
                             "the process that made it", tok)
        if tok[1] not in initializers.INITIALIZERS:
            raise self.error(f"unknown initializer {tok[1]!r}", tok)
        args: list[tuple[str, Any]] = []
        if self.accept("("):
            if not self.accept(")"):
                while True:
                    key = self.expect_kind("ident", "an initializer argument name")[1]
                    self.expect("=")
                    args.append((key, self.parse_attr_value(key)))
                    if self.accept(")"):
                        break
                    self.expect(",")
        try:
            return initializers.check(Init(tok[1], tuple(args)))
        except KilnError as e:
            raise self.error(str(e), tok) from None

    def parse_flag(self) -> FlagNode:
        self.expect("flag")
        tok = self.expect_kind("sym", "a flag name")
        self.expect("=")
        value = self.parse_attr_value()
        if not isinstance(value, bool):
            raise self.error("a flag's value is true or false", tok)
        attrs = self.parse_attr_dict()
        if set(attrs) - {"id", "configured"} or "id" not in attrs or not isinstance(attrs["id"], str):
            raise self.error("a flag takes {id = \"0x...\"} and optionally configured = true|false", tok)
        configured = attrs.get("configured", value)
        if not isinstance(configured, bool):
            raise self.error("configured is true or false", tok)
        return FlagNode(self.name_of(tok), self.param_id(attrs["id"], tok), value, configured)

    def parse_reparam(self) -> ReparamNode:
        self.expect("reparam")
        tok = self.expect_kind("sym", "a derived parameter name")
        self.expect(":")
        t = self.parse_type()
        self.expect("=")
        kind_tok = self.expect_kind("ident", "a derivation op like lora")
        self.expect("(")
        names: list[str] = []
        if not self.accept(")"):
            while True:
                sym_tok = self.expect_kind("sym", "a parameter operand")
                sym = self.name_of(sym_tok)
                if sym not in self.symbols:
                    raise self.error(f"@{sym} is not declared before this derivation", sym_tok)
                names.append(sym)
                if self.accept(")"):
                    break
                self.expect(",")
        attrs = self.parse_attr_dict()
        try:
            full, (result,) = infer(kind_tok[1], [self.symbols[n].type for n in names], attrs)
        except (KilnError, ValueError) as e:
            raise self.error(str(e), kind_tok) from None
        if result != t:
            raise self.error(f"derivation gives {result} but @{self.name_of(tok)} is declared {t}", tok)
        return ReparamNode(self.name_of(tok), t, kind_tok[1], tuple(names), full)

    def parse_function(self):
        self.expect("func")
        fb = FunctionBuilder(self.name_of(self.expect_kind("sym", "a function name")), self.symbols.get)
        env: dict[str, Value] = {}
        self.expect("(")
        if not self.accept(")"):
            while True:
                tok = self.expect_kind("val", "an argument like %x")
                self.expect(":")
                self.define(env, tok, fb.input(self.name_of(tok), self.parse_type()))
                if self.accept(")"):
                    break
                self.expect(",")
        self.expect("->")
        declared = self.parse_type_list()
        self.expect("{")
        while self.peek()[1] != "return" or self.peek()[0] != "ident":
            self.parse_op(fb, env)
        ret_tok = self.next()
        results = self.parse_operands(env) if self.peek()[0] in ("val", "sym") else []
        self.expect("}")
        got = [r.type for r in results]
        if got != declared:
            raise self.error(f"returns ({', '.join(map(str, got))}) but the signature says "
                             f"({', '.join(map(str, declared))})", ret_tok)
        return fb.finish(results)

    def parse_type_list(self) -> list[TensorType]:
        self.expect("(")
        types: list[TensorType] = []
        if self.accept(")"):
            return types
        while True:
            types.append(self.parse_type())
            if self.accept(")"):
                return types
            self.expect(",")

    def define(self, env: dict[str, Value], tok: Token, value: Value) -> None:
        if value.name in env:
            raise self.error(f"%{value.name} is defined twice", tok)
        env[value.name] = value

    def parse_operands(self, env: dict[str, Value]) -> list[Operand]:
        out: list[Operand] = []
        while True:
            tok = self.next()
            name = self.name_of(tok) if tok[0] in ("val", "sym") else ""
            if tok[0] == "val":
                if name not in env:
                    raise self.error(f"%{name} is used before it is defined", tok)
                out.append(env[name])
            elif tok[0] == "sym":
                node = self.symbols.get(name)
                if node is None:
                    raise self.error(f"@{name} is not a declared parameter, flag or derived parameter", tok)
                out.append(SymRef(name, node.type))
            else:
                raise self.error("expected an operand like %x or @param", tok)
            if not self.accept(","):
                return out

    def parse_op(self, fb: FunctionBuilder, env: dict[str, Value]) -> None:
        result_toks = [self.expect_kind("val", "a result like %0 or 'return'")]
        while self.accept(","):
            result_toks.append(self.expect_kind("val", "a result name"))
        self.expect("=")
        kind_tok = self.expect_kind("ident", "an op name")
        operands = self.parse_operands(env) if self.peek()[0] in ("val", "sym") else []
        attrs = self.parse_attr_dict()
        self.expect(":")
        types = [self.parse_type()]
        while self.accept(","):
            types.append(self.parse_type())
        loc = self.parse_loc() if self.peek()[:2] == ("ident", "loc") else None
        try:
            results = fb.append(kind_tok[1], tuple(operands), attrs, [self.name_of(t) for t in result_toks])
        except (KilnError, ValueError) as e:
            raise self.error(str(e), kind_tok) from None
        head = result_toks[0]
        results[0].owner.loc = loc if loc is not None else FileLoc(self.source, head[2], head[3])  # type: ignore[union-attr]
        if len(results) != len(result_toks) or [r.type for r in results] != types:
            raise self.error(f"{kind_tok[1]} gives ({', '.join(str(r.type) for r in results)}) but the text "
                             f"declares ({', '.join(map(str, types))})", kind_tok)
        for tok, r in zip(result_toks, results):
            self.define(env, tok, r)


    def parse_loc(self) -> Location:
        """`loc(...)` as the printer writes it: a file position, a name (over a child), or `fused[...]`."""
        self.next()
        self.expect("(")
        if self.peek()[:2] == ("ident", "fused"):
            self.next()
            self.expect("[")
            parts = [self.parse_single_loc()]
            while self.accept(","):
                parts.append(self.parse_single_loc())
            self.expect("]")
            loc: Location = FusedLoc(tuple(parts))
        else:
            loc = self.parse_single_loc()
        self.expect(")")
        return loc

    def parse_single_loc(self) -> FileLoc | NameLoc:
        tok = self.expect_kind("str", "a quoted file or name in a location")
        try:
            text = json.loads(tok[1])
        except ValueError:
            raise self.error("malformed string escape", tok) from None
        if self.accept(":"):
            line = self.parse_loc_number()
            return FileLoc(text, line, self.parse_loc_number() if self.accept(":") else None)
        if self.accept("("):
            child = self.parse_single_loc()
            self.expect(")")
            return NameLoc(text, child)
        return NameLoc(text)

    def parse_loc_number(self) -> int:
        tok = self.expect_kind("num", "a line or column number")
        if not tok[1].isdigit():
            raise self.error("expected a non-negative integer line or column", tok)
        return int(tok[1])


def parse(text: str, source: str = "<kir>") -> Graph:
    """Parse `.kir` text into a Graph; `source` names the file in error messages."""
    try:
        with gc_paused():
            return Parser(text, source).parse_module()
    except RecursionError:
        raise IRParseError("input nested too deeply", 1, 1, "", source) from None


def parse_file(path: str) -> Graph:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise _utf8_error(path) from None
    return parse(text, path)


def _utf8_error(path: str) -> IRParseError:
    """The line and column (in characters, as text mode counts lines) of a file's first byte that is not UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[:e.start].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        column = len(before) - before.rfind("\n")
        return IRParseError(f"not UTF-8 text ({e.reason})", before.count("\n") + 1, column,
                            f"0x{data[e.start]:02x}", path)
    return IRParseError("not UTF-8 text", 1, 1, "", path)
