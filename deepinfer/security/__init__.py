"""The cluster secret and what peers prove with it (see docs/security.md).

`cluster_key`: reading the key file. `loopback`: where keyless peer listeners may bind.
`peer_auth`: HMAC challenge-response on peer TCP sockets. `signing`: the router's signed handoff
headers and peer tokens. `curve`: ZeroMQ CURVE keys derived from the key.
"""

from __future__ import annotations

from deepinfer.security.cluster_key import CLUSTER_KEY_FLAG, ClusterKeyError, read_cluster_key

__all__ = ["CLUSTER_KEY_FLAG", "ClusterKeyError", "read_cluster_key"]
