"""When a value is a number, in each sense the inputs, the facts and the reports need, defined once.

A parsed JSON or YAML value is a number when it is an int or a float, never a bool (Python counts True as
the int 1; YAML 1.1 reads an unquoted `yes` as true). Text is a number in the sense of whoever reads it:
float() for a number written as text in a config, int() for argparse's type=int and for the variables torch
and NCCL read, and json.loads' hooks for the numbers a node's JSON answer may hold.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

# --- parsed values (JSON, YAML) --------------------------------------------------------------------

def is_int(value: Any) -> bool:
    """An integer, and not a YAML boolean (bool is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, and not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def float_or_none(value: Any) -> Optional[float]:
    """A number as a float; None for anything else, a boolean included."""
    return float(value) if is_number(value) else None


# --- numbers written as text -----------------------------------------------------------------------

# A number as Python's float() reads it (digits may be grouped by single underscores, as int() and pydantic take).
# Written so that each character has one way to match: a long run of digits fails in linear time.
NUMBER_RE = re.compile(r"^[+-]?(D(\.(D)?)?|\.D)([eE][+-]?D)?$".replace("D", r"\d+(_\d+)*"))


def is_numeric_string(value: Any) -> bool:
    """Text that float() reads as a number ('2', ' 5e8 ', '1_000'): a config's number written as text."""
    return isinstance(value, str) and bool(NUMBER_RE.match(value.strip()))


def text_number(value: Any) -> Any:
    """A number written as text ('2', '5e8') as the number it says; any other value as it is."""
    if not is_numeric_string(value):
        return value
    number = float(value)
    return int(number) if number.is_integer() and math.isfinite(number) else number


def reads_as(kind: type, text: str) -> bool:
    """Whether int() (or float()) takes the text, as argparse's type=int (or float) does."""
    try:
        kind(text)
    except ValueError:
        return False
    return True


def int_or_none(value: Any) -> Optional[int]:
    """A variable's text as int() reads it (torch's RANK, MASTER_PORT; NCCL's integer variables), None when it
    is unset or not a whole number."""
    if value is None:  # most unset variables: no exception raised and caught (a census asks 100,000s of times)
        return None
    if type(value) is int:
        return value
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def flag_int(value: Any) -> Any:
    """A flag's text as argparse reads it with type=int; text int() refuses, and any other value, as it is."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value


# --- json.loads hooks: the numbers a node's JSON answer may hold ---------------------------------

def bounded_json_int(text: str) -> int:
    """parse_int: an integer of at most 21 digits."""
    if len(text) > 21:  # past 64 bits: no fact is that big, and float() of it would overflow in a check
        raise ValueError(f"a number of {len(text)} digits")
    return int(text)


def finite_json_float(text: str) -> float:
    """parse_float: a float within a float's range."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is past a float's range")
    return value


def refused_json_constant(text: str):
    """parse_constant: NaN, Infinity and -Infinity are no numbers."""
    raise ValueError(f"{text} is not a number")
