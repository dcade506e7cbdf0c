"""Argument checks shared by every constructor: one wording for every "what was given, what would work" error.

Contract: each check returns nothing and raises ``ValueError`` naming the argument, what it must be and the value
given. Booleans are not integers here (``True`` is not a size); :func:`positive_seconds` also returns the checked
duration as a ``timedelta``. No Lightning imports.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable, Union


def check_int(name: str, value: Any, minimum: int = 1, *, allowed: tuple[Any, ...] = (), note: str = "") -> None:
    """``value`` is an ``int`` >= ``minimum``, or one of ``allowed`` (e.g. ``None``, ``"auto"``).

    ``note`` (e.g. ``"optimizer steps"``) is added in parentheses after the requirement.
    """
    if not isinstance(value, (bool, int)) and any(value is a or value == a for a in allowed):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        alternatives = "".join(f" or {a!r}" for a in allowed)
        raise ValueError(f"{name} must be an integer >= {minimum}{alternatives}{f' ({note})' if note else ''}, got {value!r}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}.")


def positive_seconds(name: str, value: Union[float, timedelta]) -> timedelta:
    """``value`` (seconds, or a ``timedelta``) is positive; returned as a ``timedelta``."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}.")
    return timedelta(seconds=seconds)
