"""Strict JSON Schema validation for the tests: formats are checked, date-time and time included."""

from __future__ import annotations

import datetime
import re

import jsonschema

_RFC3339_TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2})(\.\d+)?(?:Z|[+-](\d{2}):(\d{2}))$", re.IGNORECASE)


def _is_rfc3339_time(value: object) -> bool:
    """RFC 3339 `full-time`; second 60 is legal (leap seconds), which Python's parser refuses."""
    m = _RFC3339_TIME.match(value) if isinstance(value, str) else None
    if m is None:
        return False
    hour, minute, second = int(m[1]), int(m[2]), int(m[3])
    offset_ok = m[5] is None or (int(m[5]) <= 23 and int(m[6]) <= 59)
    return hour <= 23 and minute <= 59 and second <= 60 and offset_ok


def _is_rfc3339_date_time(value: object) -> bool:
    if not isinstance(value, str) or not re.match(r"^\d{4}-\d{2}-\d{2}[Tt]", value):
        return False
    datetime.date.fromisoformat(value[:10])
    return _is_rfc3339_time(value[11:])


def strict_validator(schema: dict) -> jsonschema.protocols.Validator:
    """A 2020-12 validator that also checks formats, date-time and time included (jsonschema
    checks those only with an optional package, so they are spelled out here)."""
    checker = jsonschema.FormatChecker()
    checker.checks("date-time", raises=ValueError)(_is_rfc3339_date_time)
    checker.checks("time", raises=ValueError)(_is_rfc3339_time)
    return jsonschema.Draft202012Validator(schema, format_checker=checker)
