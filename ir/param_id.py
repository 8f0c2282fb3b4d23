"""ParamId: Burn's 64-bit parameter id, shown to users as Burn displays it, and the one generator of fresh ids.

An `int` subclass, so it compares and hashes as the plain int it is (`ParamId(5) == 5`, one dict key for both).
`str` is Burn's `Display` (`crates/burn-std/src/id.rs`): base32hex (RFC 4648 "extended hex", `0-9a-v`), lower
case, unpadded, of the 8 little-endian bytes. Fresh ids are random, or reproducible after `seed_param_ids(n)`;
lazy initializers are seeded by the ParamId, so seeding ids also makes initial weights reproducible.
"""

from __future__ import annotations

import base64
import operator
import random
import re
import secrets
from typing import SupportsIndex

_BURN_TEXT = re.compile(r"[0-9a-v]{13}")
_HEX_TEXT = re.compile(r"0x[0-9a-fA-F]{1,16}")


class ParamId(int):
    """A u64 parameter id: equal to and hashed as its int, displayed in Burn's base32hex form."""

    __slots__ = ()

    def __new__(cls, value: SupportsIndex) -> ParamId:
        try:
            number = None if isinstance(value, bool) else operator.index(value)  # numpy ints too, not bool
        except TypeError:
            number = None
        if number is None or not 0 <= number < 2**64:
            raise ValueError(f"ParamId {value!r} is not a u64 (an int in [0, 2**64))")
        return super().__new__(cls, number)

    def __str__(self) -> str:
        return base64.b32hexencode(int(self).to_bytes(8, "little")).decode().lower().rstrip("=")

    def __repr__(self) -> str:
        return f"ParamId.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> ParamId:
        """The id whose Burn display is `text`; anything else is a ValueError naming the text."""
        pid = _from_burn_text(text)
        if pid is None:
            raise ValueError(f"invalid ParamId {text!r}: Burn's form is 13 characters of 0-9a-v, like 83h0200000000")
        return pid

    @classmethod
    def from_text(cls, text: str) -> ParamId:
        """An id as a user may write one: Burn's form (`83h0200000000`) or `0x` and up to 16 hex digits."""
        pid = cls(int(text, 16)) if isinstance(text, str) and _HEX_TEXT.fullmatch(text) else _from_burn_text(text)
        if pid is None:
            raise ValueError(f"invalid ParamId {text!r}: a ParamId is written 0x and up to 16 hex digits, "
                             "or in Burn's form like 83h0200000000")
        return pid


def _from_burn_text(text: object) -> ParamId | None:
    """The id Burn displays as `text` (base32hex of its 8 little-endian bytes), or None if it displays no id."""
    if not isinstance(text, str) or not _BURN_TEXT.fullmatch(text):
        return None
    pid = ParamId(int.from_bytes(base64.b32hexdecode(text.upper() + "==="), "little"))
    return pid if str(pid) == text else None  # a set padding bit decodes, but is not how Burn writes the id


_seeded: random.Random | None = None


def seed_param_ids(seed: int) -> None:
    """Make every later fresh ParamId (and so every lazy initial value) follow from `seed`: reproducible runs."""
    global _seeded
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed {seed!r} is not a non-negative int")
    _seeded = random.Random(seed)


def new_param_id() -> ParamId:
    """A fresh 64-bit ParamId: random as Burn makes them, or the next of the seeded sequence."""
    return ParamId(secrets.randbits(64) if _seeded is None else _seeded.getrandbits(64))
