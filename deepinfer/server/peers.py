"""What a server asks of a peer (a router, a prefill engine) before acting for it.

- `/v1/engine_info` and `/v1/pd/prefill` name internal addresses and run work under ids the
  router chooses: with a cluster key they need a peer token (security/signing.py, header
  x-deepinfer-peer) or, for engine_info, an admin key; without one (a loopback-only deployment)
  they need what any other route needs (an API key, when the server has keys).
- `x-deepinfer-kv-transfer` makes a decode engine connect to an address and install what comes
  back into the shared prefix cache: it is acted on only with the router's signature over the
  transfer id, address, error and expiry; an unsigned or forged one is refused (403) rather than
  ignored, so a router without the key is seen at once instead of silently recomputing.
- Tokens and signatures are single-use: one seen before (a replay of what crossed the network)
  is refused with 403, whichever route it was for.
"""

from __future__ import annotations

from fastapi import Request

from deepinfer.security import CLUSTER_KEY_FLAG
from deepinfer.security.signing import HANDOFF_PURPOSE, PEER_HEADER, TokenCheck, check, check_peer
from deepinfer.server.errors import ApiError

_REPLAYED = "was used before (a peer signs each request anew)"


def check_handoff_signature(key: bytes | None, signature: str | None, fields: tuple[str, ...]) -> None:
    """403 unless a holder of this engine's cluster key signed exactly these handoff fields, for
    this one request."""
    header = "x-deepinfer-kv-transfer"
    if key is None:
        raise ApiError(
            403,
            f"{header}: this decode engine has no {CLUSTER_KEY_FLAG}, so it cannot tell a router's "
            "handoff from a client's; start it (and the router) with one",
            param=header,
            code="peer_auth_failed",
        )
    verdict = TokenCheck.INVALID if signature is None else check(key, signature, HANDOFF_PURPOSE, *fields)
    if verdict is TokenCheck.SPENT:
        raise ApiError(403, f"{header}: its signature {_REPLAYED}", param=header, code="peer_auth_failed")
    if verdict is not TokenCheck.VALID:
        raise ApiError(
            403,
            f"{header}: not signed with this deployment's cluster key (or expired); only the router "
            "sets this header",
            param=header,
            code="peer_auth_failed",
        )


def require_peer(key: bytes | None, request: Request, what: str) -> None:
    """401 unless the request carries a valid peer token (the caller checked key is not None);
    403 for a token already used."""
    verdict = check_peer(key, request.headers.get(PEER_HEADER), request.method, request.url.path)
    if verdict is TokenCheck.SPENT:
        raise ApiError(403, f"{what}: the {PEER_HEADER} token {_REPLAYED}", code="peer_auth_failed")
    if verdict is not TokenCheck.VALID:
        raise ApiError(
            401,
            f"{what} is for the deployment's peers: it needs a {PEER_HEADER} token signed with the "
            f"{CLUSTER_KEY_FLAG} key",
            code="peer_auth_failed",
        )
