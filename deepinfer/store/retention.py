"""Retention by traffic class: how long a stored prefix stays visible after its last use."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_CLASS_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

DEFAULT_TTLS: dict[str, float] = {"agent": 3 * 86400.0, "chat": 7 * 86400.0}
# The class of a request that names none.
DEFAULT_TRAFFIC_CLASS = "chat"


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '12h', '3d', '1w' -> seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"duration {text!r} is not a number with an optional unit s, m, h, d or w")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds


@dataclass(slots=True, frozen=True)
class RetentionPolicy:
    """TTL in seconds per traffic class; every write names one of these classes."""

    ttls: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TTLS))

    def __post_init__(self) -> None:
        if not self.ttls:
            raise ValueError("retention needs at least one traffic class")
        for name, ttl in self.ttls.items():
            if not _CLASS_NAME.match(name):
                raise ValueError(f"traffic class name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
            if ttl <= 0:
                raise ValueError(f"retention for traffic class {name!r} must be positive, got {ttl}")

    def ttl(self, traffic_class: str) -> float:
        try:
            return self.ttls[traffic_class]
        except KeyError:
            known = ", ".join(sorted(self.ttls))
            raise ValueError(f"traffic_class {traffic_class!r} is not configured (known: {known})") from None


def parse_retention(spec: str) -> RetentionPolicy:
    """'agent=3d,chat=7d,batch=12h' -> RetentionPolicy; classes not named keep their defaults."""
    ttls = dict(DEFAULT_TTLS)
    for item in spec.split(","):
        if not item.strip():
            continue
        name, sep, duration = item.partition("=")
        if not sep:
            raise ValueError(
                f"kv-retention item {item.strip()!r} must look like CLASS=DURATION (e.g. chat=7d)"
            )
        try:
            ttls[name.strip()] = parse_duration(duration)
        except ValueError as exc:
            raise ValueError(f"kv-retention for class {name.strip()!r}: {exc}") from None
    return RetentionPolicy(ttls)
