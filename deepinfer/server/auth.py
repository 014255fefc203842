"""API keys at the edge: which key a request carries and whether it is one of those allowed.

Shared by the API server, the encoder and the router, so each checks a key the same way, and
before it reads a request's body (a keyless client must cost nothing but its headers).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from deepinfer.server.errors import ApiError


def key_of(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: `x-api-key`, else `Authorization: Bearer`."""
    given = headers.get("x-api-key")
    if given is None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    return given or None


def matching_key(keys: Sequence[str], given: str | None) -> str | None:
    """The key of `keys` equal to `given` (compared in constant time), or None."""
    if not given:
        return None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            return key
    return None


def check_api_key(keys: Sequence[str], headers: Mapping[str, str]) -> str | None:
    """The key of `keys` the request carries (None when no key is required); 401 otherwise."""
    if not keys:
        return None
    given = key_of(headers)
    if not given:
        raise ApiError(
            401,
            "missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            code="invalid_api_key",
        )
    key = matching_key(keys, given)
    if key is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return key


def is_admin(api_keys: Sequence[str], admin_keys: Sequence[str], headers: Mapping[str, str]) -> bool:
    """Whether a request may see what is shared by every tenant or names internal addresses:
    anyone on a server without keys, else only the holder of an admin key."""
    if not api_keys and not admin_keys:
        return True
    return matching_key(admin_keys, key_of(headers)) is not None


def check_admin_key(
    api_keys: Sequence[str],
    admin_keys: Sequence[str],
    headers: Mapping[str, str],
    what: str,
    alternative: str = "",
) -> None:
    """An operator route's check: open without keys; with API keys but no admin key configured,
    refused (403: no tenant may use it); otherwise it needs an admin key (401)."""
    if not api_keys and not admin_keys:
        return
    if not admin_keys:
        raise ApiError(
            403,
            f"{what} is shared by every API key: start with --admin-key to use it" + alternative,
            code="admin_key_required",
        )
    if matching_key(admin_keys, key_of(headers)) is None:
        raise ApiError(401, f"{what} needs an admin key (--admin-key)", code="invalid_api_key")
