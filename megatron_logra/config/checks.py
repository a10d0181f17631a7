"""Field checks shared by the config sections. Every message names the field by its full dotted
path and shows the offending value, so a typo in a 300-key run is found from the message alone."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_finite(name: str, value: float) -> None:
    # NaN compares false with everything, so "value < 0" alone would let it through.
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    check_finite(name, value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} must be {bound}")


def check_fraction(name: str, value: float, *, closed: str) -> None:
    """``closed="low"``: value in [0, 1); ``closed="high"``: value in (0, 1]."""
    check_finite(name, value)
    if closed == "low":
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1)")
    elif not 0.0 < value <= 1.0:
        raise ValueError(f"{name}={value} must be in (0, 1]")


def check_list_of_names(name: str, values: list[str], choices: tuple[str, ...]) -> None:
    if not values:
        raise ValueError(f"{name} is empty; choose from {list(choices)}")
    for value in values:
        if value not in choices:
            raise ValueError(f"{name} contains {value!r}; valid targets are {list(choices)}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has duplicates: {values}")


def validate_subsections(section: Any, path: str) -> None:
    """Call ``validate(path.child)`` on every nested section of ``section``."""
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if dataclasses.is_dataclass(value):
            value.validate(f"{path}.{item.name}")
