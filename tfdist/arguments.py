"""Argument checks of the public constructors: each refuses a bad value with a ValueError that
names the argument, what it must be, and the value received (Keras' style)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"`{name}` must be {rule}. Received: {name}={_shown(value)}")


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int if it is an integer in [minimum, maximum]."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, np.integer))
          and value >= minimum and (maximum is None or value <= maximum))
    if not ok:
        rule = (f"an integer >= {minimum}" if maximum is None
                else f"an integer in [{minimum}, {maximum}]")
        raise _fail(name, rule, value)
    return int(value)


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a float if it is a finite number within the bounds (open or closed)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and math.isfinite(value)
          and (low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        if low is not None and high is not None:
            rule = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            rule = f"a finite number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            rule = f"a finite number {'<' if high_open else '<='} {high:g}"
        else:
            rule = "a finite number"
        raise _fail(name, rule, value)
    return float(value)


def check_ratio(value: Any, name: str = "ratio") -> float:
    """`value` as a float if it is a share in (0, 1] (a sparsifier's ratio)."""
    return check_number(name, value, 0, 1, low_open=True)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(name, "True or False", value)
    return bool(value)


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    try:
        ok = value in choices
    except TypeError:  # an unhashable or incomparable value
        ok = False
    if not ok:
        raise _fail(name, f"one of {choices}", value)
    return value
