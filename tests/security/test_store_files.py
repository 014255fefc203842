"""Issue 30, finding 6, on the store itself: chunk files readable by every local user, and a chunk
replaced with noise under a recomputed CRC served as KV. Also the stale temporaries a killed
writer leaves (finding 11). The same on a real server: test_store_forgery.py."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deepinfer.store import FileBackend, TieredKVStore, encode_object
from deepinfer.store.objects import FIXED_SIZE
from deepinfer.store.seal import EXTRA_BYTES, ChunkSeal
from tests.server.server_process import wait_until

NS = b"model:A|salt:s1"
CLUSTER_KEY = b"k" * 32
REPO = Path(__file__).resolve().parents[2]


def _key(i: int) -> bytes:
    return hashlib.sha256(b"secure-%d" % i).digest()


def _chunk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 2, 16, 2, 8)).astype(np.float16)


def _store(root: Path, seal: ChunkSeal) -> TieredKVStore:
    return TieredKVStore(backend=FileBackend(root), seal=seal, blocks_per_chunk=2, lookup_timeout_s=5.0)


def _rewrite(path: Path, forge) -> None:
    """Replace an object's bytes as an attacker would, keeping its times (its mtime is its
    expiry deadline)."""
    times = path.stat()
    path.write_bytes(forge(path.read_bytes()))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def _load(store: TieredKVStore, keys: list[bytes]) -> list[np.ndarray]:
    return store.load(keys, NS).result(timeout=30)


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0)  # the worst a service manager could hand the engine
    try:
        yield
    finally:
        os.umask(previous)


def test_chunks_and_directories_are_private_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "kv" / "v1"
    with _store(root, ChunkSeal()) as store:
        for i in range(3):
            assert store.save(_key(i), NS, _chunk(i), num_tokens=16, traffic_class="chat")
        assert store.flush(timeout=30)
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    dirs = [tmp_path / "kv", *(p for p in (tmp_path / "kv").rglob("*") if p.is_dir())]
    assert len(files) == 3 and len(dirs) >= 4
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    assert {stat.S_IMODE(p.stat().st_mode) for p in dirs} == {0o700}


def test_a_store_made_before_the_rule_is_closed_without_undoing_read_only(tmp_path: Path) -> None:
    legacy, read_only = tmp_path / "legacy", tmp_path / "read-only"
    legacy.mkdir(0o755)
    read_only.mkdir()
    os.chmod(legacy, 0o755)
    os.chmod(read_only, 0o555)
    FileBackend(legacy)
    FileBackend(read_only)
    assert stat.S_IMODE(legacy.stat().st_mode) == 0o700
    assert stat.S_IMODE(read_only.stat().st_mode) == 0o500  # the owner's bits as the operator set them


def _forge_noise(data: bytes) -> bytes:
    """What the finding did: the payload replaced with noise of its size, the CRC recomputed."""
    _, version, header_len, body_len, _ = struct.unpack_from("<4sHIQI", data)
    kept = FIXED_SIZE + EXTRA_BYTES[version] + header_len  # the extra bytes and the header stay
    body = os.urandom(body_len)
    crc = zlib.crc32(body, zlib.crc32(data[FIXED_SIZE:kept]))
    return data[: FIXED_SIZE - 4] + struct.pack("<I", crc) + data[FIXED_SIZE:kept] + body


def _forge_unsealed(data: bytes) -> bytes:
    """A well-formed keyless object (CRC only) holding noise, as anyone can write one."""
    return b"".join(bytes(p) for p in encode_object(_key(0), NS, "chat", 16, _chunk(99)))


@pytest.mark.parametrize("forge", [_forge_noise, _forge_unsealed], ids=["noise", "unsealed"])
def test_a_forged_chunk_is_a_counted_logged_miss(
    tmp_path: Path, forge, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    seal = ChunkSeal(CLUSTER_KEY)
    with _store(root, seal) as store:
        assert store.save(_key(0), NS, _chunk(0), num_tokens=16, traffic_class="chat")
        assert store.flush(timeout=30)
    path = FileBackend(root).path_for(_key(0))
    _rewrite(path, forge)
    with _store(root, seal) as store, caplog.at_level(logging.WARNING, logger="deepinfer.store.tiered"):
        assert _load(store, [_key(0)]) == []
        assert store.metrics.forged_objects == 1 and store.metrics.corrupt_objects == 0
        assert not path.exists()  # deleted: the next writer of this chunk replaces it
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


def test_without_a_key_the_crc_alone_cannot_tell_noise_from_kv(tmp_path: Path) -> None:
    # What docs/security.md says: a keyless store is only as safe as who can write to it.
    root = tmp_path / "kv"
    with _store(root, ChunkSeal()) as store:
        assert store.save(_key(0), NS, _chunk(0), num_tokens=16, traffic_class="chat")
        assert store.flush(timeout=30)
    path = FileBackend(root).path_for(_key(0))
    _rewrite(path, _forge_noise)
    with _store(root, ChunkSeal()) as store:
        [served] = _load(store, [_key(0)])
    assert not np.array_equal(served, _chunk(0))


def test_encrypted_chunks_keep_no_plaintext_and_need_the_key(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    chunk = _chunk(0)
    with _store(root, ChunkSeal(CLUSTER_KEY, encrypt=True)) as store:
        assert store.save(_key(0), NS, chunk, num_tokens=16, traffic_class="chat")
        assert store.flush(timeout=30)
    data = FileBackend(root).path_for(_key(0)).read_bytes()
    plain = chunk.tobytes()
    assert all(plain[i : i + 32] not in data for i in range(0, len(plain) - 32, 32))
    with _store(root, ChunkSeal()) as keyless:  # another deployment's object to it
        assert _load(keyless, [_key(0)]) == []
        assert keyless.metrics.foreign_objects == 1
    with _store(root, ChunkSeal(CLUSTER_KEY)) as peer:  # a peer that only authenticates reads it
        [loaded] = _load(peer, [_key(0)])
        assert np.array_equal(loaded, chunk)
    with _store(root, ChunkSeal(b"x" * 32)) as stranger:
        assert _load(stranger, [_key(0)]) == []
        assert stranger.metrics.forged_objects == 1


_HANGING_WRITER = """
import sys, time
from deepinfer.store import FileBackend

class Stalls:
    def __iter__(self):
        yield b"first part of the object"
        print("writing", flush=True)
        time.sleep(600)

FileBackend(sys.argv[1]).put(bytes(32), Stalls(), time.time() + 3600, time.time())
"""


def test_a_temporary_left_by_kill_9_is_removed_at_start(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    writer = subprocess.Popen(
        [sys.executable, "-c", _HANGING_WRITER, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait(30)
    [left] = list(root.rglob("*.tmp"))
    foreign = left.with_name(".00ab.kv.00000000-1.1.ffff.tmp")  # another host's write in progress
    foreign.write_bytes(b"partial")
    with _store(root, ChunkSeal()) as store:
        assert wait_until(lambda: store.metrics.temporaries_removed == 1, 60)
    assert not left.exists() and foreign.exists()
