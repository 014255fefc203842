"""Without a cluster key nothing authenticates a peer, so peer-facing listeners stay on loopback."""

from __future__ import annotations

import ipaddress

from deepinfer.security.cluster_key import CLUSTER_KEY_FLAG


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "*") may resolve to anything: not loopback


def require_loopback(host: str, what: str) -> None:
    """ValueError naming --cluster-key-file when a keyless peer listener would bind `host`."""
    if not is_loopback(host):
        raise ValueError(
            f"{what} binds {host!r}, reachable from other machines, but no {CLUSTER_KEY_FLAG} "
            "authenticates its peers: give one, or bind 127.0.0.1"
        )
