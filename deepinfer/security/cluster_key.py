"""Read the cluster secret shared by every engine, router and encoder of one deployment.

The file holds at least 32 bytes (raw or text: what it holds is the key, byte for byte, less a
trailing newline). Readable by its owner only: a key another local user can read lets that user
impersonate a peer, so a file with any group/other permission bit is refused rather than trusted.
"""

from __future__ import annotations

import os
import stat

CLUSTER_KEY_FLAG = "--cluster-key-file"
MIN_KEY_BYTES = 32


class ClusterKeyError(ValueError):
    """A cluster key file that cannot be used; the message names --cluster-key-file."""


def read_cluster_key(path: str | os.PathLike[str]) -> bytes:
    """The key in `path`; ClusterKeyError when it is missing, too short, or not private."""
    try:
        # O_NOFOLLOW-free on purpose: a symlink to a private file (a mounted secret) is fine, the
        # mode checked is the target's, from the same open file we read.
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise ClusterKeyError(f"{CLUSTER_KEY_FLAG} {path}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ClusterKeyError(f"{CLUSTER_KEY_FLAG} {path}: not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterKeyError(
                f"{CLUSTER_KEY_FLAG} {path}: mode {stat.S_IMODE(info.st_mode):04o} lets other users "
                "read or change the key; chmod 600 it"
            )
        with os.fdopen(fd, "rb", closefd=False) as file:
            key = file.read(1 << 16)
    finally:
        os.close(fd)
    key = key.rstrip(b"\r\n")
    if len(key) < MIN_KEY_BYTES:
        raise ClusterKeyError(
            f"{CLUSTER_KEY_FLAG} {path}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed "
            "(e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
        )
    return key


def cluster_key_of(path: str | os.PathLike[str] | None) -> bytes | None:
    """The key of an optional --cluster-key-file (None: a keyless, loopback-only deployment)."""
    return None if path is None else read_cluster_key(path)
