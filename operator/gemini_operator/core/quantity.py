"""Kubernetes resource quantities ("512Mi", "2", "1e9") as exact numbers, with no client library."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
_PATTERN = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message names the value."""


def parse_quantity(value: str | int) -> Decimal:
    """The exact value of a quantity: parse_quantity("1Ki") == 1024."""
    if isinstance(value, int):
        return Decimal(value)
    match = _PATTERN.match(value.strip())
    if match is None:
        raise QuantityError(f"{value!r} is not a Kubernetes quantity (e.g. 512Mi, 2Gi, 500m)")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        base = Decimal(number)
    except InvalidOperation as err:  # pragma: no cover - the pattern admits only decimals
        raise QuantityError(f"{value!r} is not a Kubernetes quantity") from err
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    if suffix in _DECIMAL:
        return base * _DECIMAL[suffix]
    return base * (Decimal(10) ** int(suffix[1:]))


def parse_bytes(value: str | int) -> int:
    """A quantity of memory as whole bytes; refuses negative or fractional byte counts."""
    amount = parse_quantity(value)
    if amount < 0 or amount != amount.to_integral_value():
        raise QuantityError(f"{value!r} is not a whole, non-negative number of bytes")
    return int(amount)
