"""Argument checks shared by the engine's options and the request's parameters: each raises a
``ValueError`` naming the argument, the value and the limit."""
import math
from numbers import Integral, Real


def is_integer(value) -> bool:
    """An int (or numpy integer), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_bool(name: str, value):
    """ValueError naming ``name`` and ``value`` unless it is True or False (not 0, 1 or "no")."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_count_or_auto(name: str, value, low: int = 1):
    """ValueError naming ``name``, ``value`` and the limit unless ``value`` is -1 (sized
    automatically) or an integer >= ``low``."""
    if not (is_integer(value) and (value == -1 or value >= low)):
        raise ValueError(f"{name} must be -1 (sized automatically) or an integer >= {low}, got {value!r}")


def check_range(name: str, value, low, high=None, low_inclusive=True, integer=True):
    """ValueError naming ``name``, ``value`` and the limit unless low <= value (<= high) (low < value
    when not ``low_inclusive``), and ``value`` is an integer (``integer``) or a finite number."""
    if integer and not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not integer and (isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    ok_low = value >= low if low_inclusive else value > low
    if not ok_low or (high is not None and value > high):
        if high is None:
            bound = f">= {low}" if low_inclusive else f"> {low}"
        else:
            bound = f"in [{low}, {high}]" if low_inclusive else f"in ({low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
