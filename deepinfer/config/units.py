"""The one parser for sizes, used by every size option (flags, `LLM(...)` arguments, config files).

Binary units are powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`), decimal units powers of 1000 (`KB`,
`MB`, `GB`, `TB`); a bare letter (`512M`, `2g`) is binary, as in most memory flags. A plain number
is bytes and may be written in scientific notation (`1e9`).
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = " kmgt"


def parse_size(value: str | int | float) -> int:
    """`268435456`, `1e9`, `256MiB`, `256M`, `2GB`, `1.5GiB` -> bytes; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 268435456, 512MiB or 2GB, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        match = _SIZE.match(value)
        if match is None or (match.group(3) and not match.group(2)):
            raise ValueError(f"expected a size such as 268435456, 512MiB or 2GB, got {value!r}")
        number = float(match.group(1))
        letter, binary, byte = match.group(2).lower(), match.group(3), match.group(4)
        if letter:
            # "GB" is decimal; "GiB" and a bare "G" are binary.
            base = 1000 if byte and not binary else 1024
            number *= base ** _POWERS.index(letter)
    if number < 0 or number != number or number == float("inf"):
        raise ValueError(f"expected a non-negative size, got {value!r}")
    return int(number)


def parse_int_list(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16]; every value must be a positive integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def format_size(size: int) -> str:
    """Bytes as a user would type them: the largest binary unit that divides them (`32MiB`), else
    the plain number; parse_size reads it back to the same value."""
    for power in range(len(_POWERS) - 1, 0, -1):
        unit = 1024**power
        if size and size % unit == 0:
            return f"{size // unit}{_POWERS[power].upper()}iB"
    return str(size)
