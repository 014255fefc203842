"""A directory on a shared POSIX file system (3FS, NFS, CephFS mount, or a local directory).

Layout: ROOT/ab/cd/<key hex>.kv, fanned out so no directory grows huge. The object's two
timestamps live in the inode: mtime is the expiry deadline (set in the future), atime the
last access. A lookup is then one stat() per chunk and a refresh one utime(), never a rewrite.
Both are set explicitly with utime(), so atime mount options (noatime, relatime) do not matter.

Writes go to a hidden temporary name in the destination directory, are fsynced, get their
timestamps, and are renamed over the final name with os.replace, which is atomic on POSIX:
readers see the old object or the new one, and concurrent writers of one key leave exactly
one whole object (the last rename wins). The fsync orders the data before the rename so a
crash cannot expose a renamed file with missing data on file systems that reorder; the
directory is not fsynced because losing a fresh entry in a crash is only a cache miss.

Private to the engine's user whatever its umask: directories 0700 and objects 0600 (set with
chmod, which the umask does not filter), and at start the store's root loses any group or other
bits, so a store written before this rule is closed too. The KV of a prompt is the prompt: layer 0's
values depend on the token alone, so a readable chunk gives its text away.

A temporary's name carries a tag of its host and its writer's pid: at start, a temporary of this
host whose writer is gone (kill -9, a crash) is removed at once; others, possibly another
machine's write in progress, once older than `tmp_max_age_s`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from deepinfer.store.backend import ObjectInfo, ObjectParts, StoreUnavailable

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_PRIVATE_DIR = 0o700
_PRIVATE_FILE = 0o600
# A short tag of this host for temporaries' names, not the host name itself.
_HOST_TAG = hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()
_TMP_WRITER = re.compile(r"^\.[0-9a-f]+\.kv\.([0-9a-f]{8})-(\d+)\.")


def _make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 (chmod after mkdir: mkdir's mode goes
    through the umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(_PRIVATE_DIR)
        except FileExistsError:
            continue  # another writer made it a moment ago, private too
        os.chmod(directory, _PRIVATE_DIR)


def _writer_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


class FileBackend:
    name = "file"

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, tmp_max_age_s: float = 3600.0):
        self.root = Path(root)
        self.fsync = fsync
        self.tmp_max_age_s = tmp_max_age_s
        # A missing or read-only root is not fatal here: writes will fail softly and be counted.
        with contextlib.suppress(OSError):
            _make_private_dirs(self.root)
            # A root made before this rule is closed to others too; its owner's bits stay (an
            # operator may have made the store read-only).
            mode = stat.S_IMODE(os.stat(self.root).st_mode)
            if mode & 0o077:
                os.chmod(self.root, mode & _PRIVATE_DIR)

    def path_for(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name[2:4] / (name + _SUFFIX)

    def put(self, key: bytes, parts: ObjectParts, expires_at: float, now: float) -> None:
        path = self.path_for(key)
        tmp = path.with_name(
            f".{path.name}.{_HOST_TAG}-{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        )
        try:
            if not path.parent.is_dir():
                _make_private_dirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _PRIVATE_FILE)
            os.fchmod(fd, _PRIVATE_FILE)  # the mode whatever the umask
        except OSError as exc:
            raise StoreUnavailable(f"cannot create {tmp}: {exc}") from exc
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    out.write(part)
                out.flush()
                if self.fsync:
                    os.fsync(out.fileno())
                os.utime(out.fileno(), (now, expires_at))
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StoreUnavailable(f"cannot write {path}: {exc}") from exc

    def get(self, key: bytes, now: float) -> bytearray | None:
        path = self.path_for(key)
        try:
            with open(path, "rb", buffering=0) as src:
                st = os.fstat(src.fileno())
                if st.st_mtime_ns / 1e9 <= now:
                    return None
                # Read what is there; a short file is caught by the object's own length check.
                buf = bytearray(st.st_size)
                view = memoryview(buf)
                filled = 0
                while filled < len(buf):
                    n = src.readinto(view[filled:])
                    if not n:
                        break
                    filled += n
                return buf if filled == len(buf) else buf[:filled]
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {path}: {exc}") from exc

    def touch(self, key: bytes, expires_at: float, now: float) -> None:
        try:
            os.utime(self.path_for(key), (now, expires_at))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(f"cannot refresh {key.hex()}: {exc}") from exc

    def count_present(self, keys: Sequence[bytes], now: float) -> int:
        count = 0
        for key in keys:
            try:
                st = os.stat(self.path_for(key))
            except FileNotFoundError:
                break
            except OSError as exc:
                raise StoreUnavailable(f"cannot stat {key.hex()}: {exc}") from exc
            if st.st_mtime_ns / 1e9 <= now:
                break
            count += 1
        return count

    def delete(self, key: bytes) -> None:
        try:
            os.unlink(self.path_for(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(f"cannot delete {key.hex()}: {exc}") from exc

    def _leaf_entries(self) -> Iterator[os.DirEntry[str]]:
        try:
            for top in os.scandir(self.root):
                if not top.is_dir(follow_symlinks=False):
                    continue
                for mid in os.scandir(top.path):
                    if mid.is_dir(follow_symlinks=False):
                        yield from os.scandir(mid.path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreUnavailable(f"cannot scan {self.root}: {exc}") from exc

    def scan(self) -> Iterator[ObjectInfo]:
        for entry in self._leaf_entries():
            name = entry.name
            if name.startswith(".") or not name.endswith(_SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[: -len(_SUFFIX)])
                st = entry.stat(follow_symlinks=False)
            except (ValueError, OSError):
                continue
            yield ObjectInfo(key, st.st_size, st.st_atime_ns / 1e9, st.st_mtime_ns / 1e9)

    def sweep_temporaries(self) -> int:
        # Age by ctime against the real clock: a writer sets mtime to the expiry deadline just
        # before its rename, while ctime always records the last real change.
        cutoff = time.time() - self.tmp_max_age_s
        removed = 0
        for entry in self._leaf_entries():
            if not (entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX)):
                continue
            writer = _TMP_WRITER.match(entry.name)
            try:
                dead = writer is not None and writer[1] == _HOST_TAG and _writer_gone(int(writer[2]))
                if dead or entry.stat(follow_symlinks=False).st_ctime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue
        return removed

    def ping(self) -> None:
        try:
            os.stat(self.root)
        except OSError as exc:
            raise StoreUnavailable(f"store directory {self.root} is unavailable: {exc}") from exc

    def close(self) -> None:
        pass
