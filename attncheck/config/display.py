"""How a config value is quoted in a message or spelled in a case name.

YAML spellings for true, false and null, and a bounded length, so that a 5,000-digit integer or
a long string in a file gives a message of one readable line.
"""

from __future__ import annotations

import reprlib
from typing import Any

from attncheck.errors import QUOTE_LIMIT


class _ShortRepr(reprlib.Repr):
    """reprlib that also survives integers too long for str()."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_short_repr = _ShortRepr()
_short_repr.maxstring = 60
_short_repr.maxother = 60
_short_repr.maxlevel = 3  # nested aliases (a "billion laughs" file) stay a few characters deep


def show(value: Any) -> str:
    """A value as a message quotes it: YAML spellings for true, false and null, bounded in size."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = _short_repr.repr(value)
    if len(text) <= QUOTE_LIMIT:
        return text
    size = f"{len(value):,} items" if hasattr(value, "__len__") else f"{len(text):,} characters"
    return f"{text[: QUOTE_LIMIT - 1]}… ({size})"


def plain(value: Any) -> str:
    """A value as a case name spells it: like show, without quotes around strings."""
    return value if isinstance(value, str) else show(value)


def type_name(value: Any) -> str:
    """The Python type of a value read from YAML, as a message names it: int, str, list, ..."""
    return type(value).__name__
