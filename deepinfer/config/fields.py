"""Config fields that carry their own help text: one source for `deepinfer --help`, the docs and
the errors. `option(...)` is `dataclasses.field(...)` plus metadata read by `deepinfer.config.flags`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deepinfer.config.units import parse_size


class ConfigError(ValueError):
    """A bad option value; the message starts with the option's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    size: bool = False,
    flag: str | None = None,
    repeat: bool = False,
    metavar: str | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field. `size`: parsed with `parse_size` (flags and Python values alike);
    `flag`: the command-line spelling when it is not `--field-name`; `repeat`: a list given
    by repeating the flag; `metavar`: what `--help` calls the value (see flags.metavar_of)."""
    metadata = {"help": help, "size": size, "flag": flag, "repeat": repeat, "metavar": metavar}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def normalize_sizes(config: Any) -> None:
    """Parse every `size` field of a frozen dataclass in place (`"2GiB"` -> 2147483648)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("size") and value is not None and not isinstance(value, int):
            try:
                object.__setattr__(config, f.name, parse_size(value))
            except ValueError as exc:
                raise ConfigError(f.name, str(exc)) from None


def check_positive(name: str, value: int | float | None, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(name, f"must be a positive number, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"expected one of {list(choices)}, got {value!r}")
