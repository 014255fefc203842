"""Command-line flags from config fields: `--block-size`, `--kv-cache-memory 2GiB`,
`--no-enable-prefix-caching`, `--api-key K` (repeatable). The help text is the field's own.

Flags parse into the same frozen configs `LLM(...)` builds, so every value is validated once,
by the config, before anything loads; a bad value is an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from deepinfer.config.engine import SUB_CONFIGS, EngineConfig
from deepinfer.config.fields import ConfigError
from deepinfer.config.units import format_size, parse_int_list, parse_size


def size_argument(text: str) -> int:
    """argparse type for a size flag (see deepinfer.config.units)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_list_argument(text: str) -> list[int]:
    """argparse type for a comma-separated list of positive integers (`1,4,16`)."""
    try:
        return parse_int_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _unwrap_optional(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The field's flag spellings: its own (`flag=`, a name or several) or `--field-name`."""
    flag = f.metadata.get("flag")
    if flag is None:
        return ("--" + f.name.replace("_", "-"),)
    return (flag,) if isinstance(flag, str) else tuple(flag)


def flag_name(f: dataclasses.Field) -> str:
    return flag_names(f)[0]


def metavar_of(f: dataclasses.Field, kind: Any) -> str:
    """What `--help` calls a flag's value: the field's own word (`KEY`, `NAME`, `JSON`), `SIZE`
    for sizes (which take units), `N` for integers, `SECONDS` for timeouts, else the flag's
    name (`--host HOST`)."""
    if f.metadata.get("metavar"):
        return f.metadata["metavar"]
    if f.metadata.get("size"):
        return "SIZE"
    if kind is int:
        return "N"
    if kind is float and f.metadata["help"].startswith("seconds"):
        return "SECONDS"
    return flag_name(f).lstrip("-").replace("-", "_").upper()


def _leaf_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, type hint) of every option of `cls`, sub-configs flattened."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is EngineConfig and f.name in SUB_CONFIGS:
            yield from _leaf_fields(SUB_CONFIGS[f.name])
        elif "help" in f.metadata:
            yield f, hints[f.name]


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()
) -> None:
    """One flag per option of `cls` (a config dataclass), in an argument group called `title`.
    Defaults are left to the config (argparse sees None), so `--help` shows the config's own."""
    group = parser.add_argument_group(title)
    for f, hint in _leaf_fields(cls):
        if f.name in skip:
            continue
        kind = _unwrap_optional(hint)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.metadata.get("size") and isinstance(default, int):
            default = format_size(default)  # as it would be typed: 32MiB, not 33554432
        shown = (
            f" (default: {default})"
            if default not in (None, (), "") and not isinstance(default, bool)
            else ""
        )
        text = f.metadata["help"] + shown.replace("%", "%%")
        names = flag_names(f)  # the first is the spelling --help and errors use; the rest still work
        metavar = metavar_of(f, kind)
        if f.metadata.get("repeat"):
            group.add_argument(*names, dest=f.name, action="append", default=None, metavar=metavar, help=text)
        elif kind is bool:
            group.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(*names, dest=f.name, choices=typing.get_args(kind), default=None, help=text)
        else:
            # A size takes units; a structured value (a mapping: JSON) is parsed by its config.
            convert = size_argument if f.metadata.get("size") else kind
            if typing.get_origin(kind) is Mapping:
                convert = str
            group.add_argument(*names, dest=f.name, type=convert, default=None, metavar=metavar, help=text)


def given_options(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The options of `cls` set on the command line (flat names -> values)."""
    values = {}
    for f, _ in _leaf_fields(cls):
        if f.name not in skip and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return values


def flag_message(cls: type, exc: ConfigError) -> str:
    """The error with the option's name as the user typed it (`--max-model-len: ...`)."""
    flags = {f.name: flag_name(f) for f, _ in _leaf_fields(cls)}
    message = str(exc)
    return flags[exc.name] + message[len(exc.name) :] if exc.name in flags else message


def build_config(parser: argparse.ArgumentParser, cls: type, values: dict[str, Any]) -> Any:
    """`cls` from flat option values; a ConfigError becomes a usage error naming the flag."""
    try:
        return cls.from_kwargs(**values) if cls is EngineConfig else cls(**values)
    except ConfigError as exc:
        parser.error(flag_message(cls, exc))
    except ValueError as exc:  # checks of a field's own parser, already naming the flag
        parser.error(str(exc))
