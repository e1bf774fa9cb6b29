"""Strict reading of the control API's JSON: what every message's ``from_json`` and the
client build on.

Reading is strict: a missing required key or a value of the wrong type raises ValueError
naming the field (the servers answer it with 400). Keys a reader does not know are ignored,
so a newer sender can add a field without breaking an older receiver during an upgrade.
``parse_json`` refuses (ValueError) anything but plain JSON with finite numbers, nested at
most MAX_JSON_DEPTH deep.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_JSON_DEPTH = 32  # real answers nest 4 deep
Holder = int | str  # a rank (its address from the placement) or "host:port"
_MISSING: Any = object()


# -- reading JSON strictly -------------------------------------------------------------------

def shown(value: object) -> str:
    """The offending value for a message: short enough for a log line and an API answer."""
    text = repr(value)
    text = text if len(text) <= 120 else text[:117] + "..."
    return "null" if value is None else f"{text} ({type(value).__name__})"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit alone takes "²", which int() refuses


def is_address(value: object) -> bool:
    if not isinstance(value, str):
        return False
    host, sep, port = value.strip().rpartition(":")
    return bool(sep and host and is_digits(port) and 0 < int(port) < 65536)


class Fields:
    """Typed reads of one JSON object; every refusal names the body and the field's path."""

    def __init__(self, doc: object, where: str, path: str = "") -> None:
        if not isinstance(doc, dict):
            what = f"'{path.rstrip('.')}'" if path else "the body"
            raise ValueError(f"{where}: {what} must be a JSON object, got {shown(doc)}")
        self._doc: dict[str, Any] = doc
        self.where, self.path = where, path

    def fail(self, key: str, must: str, value: object) -> ValueError:
        return ValueError(f"{self.where}: '{self.path}{key}' must be {must}, got {shown(value)}")

    def _get(self, key: str, required: bool) -> Any:
        value = self._doc.get(key, _MISSING)
        if value is _MISSING and required:
            raise ValueError(f"{self.where}: '{self.path}{key}' is required")
        return value

    def _checked(self, key: str, ok: Callable[[Any], bool], must: str, required: bool) -> Any:
        value = self._get(key, required)
        if value is not _MISSING and not ok(value):
            raise self.fail(key, must, value)
        return value

    def integer(self, key: str, minimum: int | None = None) -> int:
        must = "an integer" if minimum is None else f"an integer >= {minimum}"
        return int(self._checked(
            key, lambda v: is_int(v) and (minimum is None or v >= minimum), must, True))

    def opt_integer(self, key: str, minimum: int | None = None) -> int | None:
        """Missing or null: None."""
        must = "an integer or null" if minimum is None else f"an integer >= {minimum} or null"
        value = self._checked(
            key, lambda v: v is None or (is_int(v) and (minimum is None or v >= minimum)),
            must, False)
        return None if value is _MISSING or value is None else int(value)

    def number(self, key: str) -> float:
        return float(self._checked(key, is_number, "a number", True))

    def opt_number(self, key: str) -> float | None:
        value = self._checked(key, lambda v: v is None or is_number(v), "a number or null",
                              False)
        return None if value is _MISSING or value is None else float(value)

    def boolean(self, key: str) -> bool:
        return bool(self._checked(key, lambda v: isinstance(v, bool), "true or false", True))

    def string(self, key: str) -> str:
        return str(self._checked(key, lambda v: isinstance(v, str), "a string", True))

    def opt_string(self, key: str) -> str | None:
        value = self._checked(key, lambda v: v is None or isinstance(v, str),
                              "a string or null", False)
        return None if value is _MISSING or value is None else str(value)

    def ranks(self, key: str, required: bool = False, what: str = "ranks") -> tuple[int, ...]:
        """A list of non-negative integers (ranks, steps); missing (when optional): empty."""
        value = self._checked(key, lambda v: isinstance(v, list) and all(
            is_int(r) and r >= 0 for r in v), f"a list of {what} (integers >= 0)", required)
        return () if value is _MISSING else tuple(value)

    def strings(self, key: str) -> tuple[str, ...]:
        return tuple(self._checked(key, lambda v: isinstance(v, list) and all(
            isinstance(s, str) for s in v), "a list of strings", True))

    def holders(self, key: str) -> tuple[Holder, ...]:
        """A list of holders, each a rank or "host:port"; missing: empty."""
        value = self._get(key, False)
        return () if value is _MISSING else self.holders_of(key, value)

    def holders_of(self, name: str, value: object) -> tuple[Holder, ...]:
        if not isinstance(value, list) or not all(
                (is_int(h) and h >= 0) or is_address(h) for h in value):
            raise self.fail(name, 'a list of holders (ranks or "host:port")', value)
        return tuple(value)

    def obj(self, key: str) -> Fields:
        return Fields(self._get(key, True), self.where, f"{self.path}{key}.")

    def opt_obj(self, key: str) -> Fields | None:
        value = self._get(key, False)
        if value is _MISSING or value is None:
            return None
        return Fields(value, self.where, f"{self.path}{key}.")

    def objects(self, key: str) -> list[Fields]:
        value = self._checked(key, lambda v: isinstance(v, list), "a list of objects", True)
        return [Fields(item, self.where, f"{self.path}{key}[{i}].")
                for i, item in enumerate(value)]

    def by_rank(self, key: str, required: bool = True) -> dict[int, Any]:
        """An object keyed by rank ("0", "1", ...): rank -> value, in the sender's order."""
        value = self._checked(key, lambda v: isinstance(v, dict) and all(
            isinstance(r, str) and is_digits(r) for r in v),
            'an object keyed by rank ("0", "1", ...)', required)
        return {} if value is _MISSING else {int(r): v for r, v in value.items()}

    def raw(self, key: str) -> Any:
        """The value as sent (None when missing): for fields of several shapes."""
        value = self._get(key, False)
        return None if value is _MISSING else value


def parse_json(raw: str | bytes | bytearray) -> object:
    """Strict JSON: ValueError (never RecursionError or a non-finite float) for anything but
    plain JSON with finite numbers, nested at most MAX_JSON_DEPTH deep."""
    try:
        doc = json.loads(raw, parse_float=_finite, parse_constant=_not_a_number)
    except RecursionError as err:  # the C scanner's own depth limit
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}") from err
    if _deeper_than(doc, MAX_JSON_DEPTH):
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
    return doc


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _not_a_number(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _deeper_than(doc: object, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep (walked without recursion, so
    the walk itself cannot overflow)."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        children = (value.values() if isinstance(value, dict)
                    else value if isinstance(value, list) else None)
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
