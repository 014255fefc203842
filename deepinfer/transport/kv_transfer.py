"""Direct KV transfer between engines: a prefill engine leases a finished prompt's KV chunks
(kv_chunks.py, copied off the device into host memory when the prefill finishes) and serves
them, over TCP, to the one decode engine that pulls them.

Pull, with a lease: the prefill engine holds the chunks until its decoder has pulled them or the
lease ends, whichever comes first, so a decoder that never comes (or stalls mid-transfer) cannot
hold them for longer. The decoder asks for the chunks it lacks by key (the prefix hash of a
chunk's last block); the prefiller sends the longest run of them it holds.

Why our own protocol over plain TCP sockets: a peer that dies is seen at once (EOF or a reset on
the open connection, refusal on a new one), where zmq reconnects silently and a pull would
only time out; one request and one reply per transfer need no more than length-prefixed
frames; numpy buffers go out and come in without copies (`sendall` of the array, `recv_into`
it); and nothing new is installed. Mooncake's transfer engine would bring RDMA on machines
that have it, but needs its own metadata service for a TCP-only loopback setup like ours.

Peers first authenticate each other (security/peer_auth.py: HMAC challenge-response with the
cluster key, both ways) before the listener reads a byte of variable size; a listener serves
at most MAX_CONNECTIONS at once (more are closed on accept) and gives each a deadline.

Frames: 4-byte big-endian length, then msgpack. Decoder -> prefiller: PullRequest, naming the
decoder's chunk layout (`ChunkLayout.describe()`: another model, cache layout or chunk size is
refused, status `mismatch`, and the lease ends). Prefiller -> decoder: PullReply, then (status
ok) the chunks' payloads as raw bytes, one after the other, of the sizes the reply lists.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import numpy as np

from deepinfer.security.peer_auth import HANDSHAKE_TIMEOUT_S, PeerAuthError, accept_peer, dial_peer
from deepinfer.sequence import KVSource

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 1 << 20  # a reply lists one size per chunk asked for
# A request is its transfer id, layout and one 32-byte key per chunk: the limit of one is this
# plus REQUEST_BYTES_PER_CHUNK per chunk of the largest lease held (checked before allocating).
REQUEST_BASE_BYTES = 64 << 10
REQUEST_BYTES_PER_CHUNK = 40
MAX_CONNECTIONS = 64  # at once, per listener: decoders pull with a few threads each
REQUEST_TIMEOUT_S = 10.0  # from accept to a whole request read, beyond the handshake
_LENGTH = 4


class PullRequest(msgspec.Struct, array_like=True):
    transfer_id: str
    chunk_keys: list[bytes]  # the chunks the decoder lacks, in order (may be empty: "release it")
    layout: str = ""  # the decoder's ChunkLayout.describe()


class PullReply(msgspec.Struct, array_like=True, omit_defaults=True):
    status: str  # ok | unknown (no such lease: expired, pulled already, or never made) | mismatch
    message: str = ""
    sizes: list[int] = []  # bytes of each chunk that follows


OK = "ok"
UNKNOWN = "unknown"
MISMATCH = "mismatch"

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(PullRequest)
_replies = msgspec.msgpack.Decoder(PullReply)


class TransferError(RuntimeError):
    """A pull that brought no KV: the prefiller is gone, refused it, or it took too long."""


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    sock.sendall(len(data).to_bytes(_LENGTH, "big") + data)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket; EOF is a TransferError, the deadline a TimeoutError."""
    received = 0
    while received < len(view):
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining)
        n = sock.recv_into(view[received:])
        if n == 0:
            raise TransferError(f"the connection closed after {received} of {len(view)} bytes")
        received += n


def recv_frame(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    """One frame of at most `limit` bytes (a larger announcement fails before any allocation)."""
    length = bytearray(_LENGTH)
    recv_into(sock, memoryview(length), deadline)
    size = int.from_bytes(length, "big")
    if size > limit:
        raise TransferError(f"a {size}-byte frame is larger than the {limit} bytes expected here")
    data = bytearray(size)
    recv_into(sock, memoryview(data), deadline)
    return bytes(data)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a KV transfer address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


# -- the prefill side ---------------------------------------------------------------------------


class LeaseState(enum.Enum):
    READY = "ready"  # pinned, waiting for its decoder
    SENDING = "sending"  # a listener thread is sending its chunks
    DONE = "done"  # sent (or failed): the engine may drop it


@dataclass(slots=True)
class Lease:
    transfer_id: str
    chunk_keys: list[bytes]
    payloads: list[np.ndarray]  # each chunk's bytes (uint8), in host memory
    deadline: float  # time.monotonic() by which it is dropped
    state: LeaseState = LeaseState.READY

    @property
    def num_bytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)


class KVTransferServer:
    """The prefill engine's listener and its leases.

    Threads: `lease` and `reap` run on the engine's thread; an accept thread and one thread per
    connection send leased chunks (host memory no one writes). A lease is claimed (READY ->
    SENDING) by at most one pull, under the lock, and `reap` drops only READY leases past their
    deadline and DONE ones. A send is bounded by the lease's deadline: a decoder that stops
    reading loses the connection when the lease ends. `layout` is the engine's chunk layout
    (`ChunkLayout.describe()`): a decoder of another one is refused. `key`: the cluster key
    every puller must prove it holds (None: no check, which config allows on loopback only).
    """

    def __init__(
        self,
        layout: str,
        host: str,
        port: int,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        key: bytes | None = None,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.layout = layout
        self.lease_s = lease_s
        self.clock = clock
        self._key = key
        self._handshake_timeout_s = handshake_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.25)  # the accept loop notices close() within this
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._closed = threading.Event()
        self.num_sent = 0  # pulls answered, releases (pulls of nothing) included
        self.num_released = 0  # pulls that asked for nothing: the puller had it all
        self.num_failed = 0
        self.num_expired = 0
        self.num_unknown = 0
        self.num_refused = 0  # connections closed unread: over the limit, or not a key holder
        self._accept_thread = threading.Thread(target=self._accept, name="kv-transfer-accept", daemon=True)
        self._accept_thread.start()

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def num_bytes(self) -> int:
        """Host memory the leased chunks hold."""
        with self._lock:
            return sum(lease.num_bytes for lease in self._leases.values())

    def lease(self, transfer_id: str, chunk_keys: list[bytes], payloads: list[np.ndarray]) -> bool:
        """Hold chunks (keys and payloads, in order) for one pull; False if the id is taken."""
        assert len(chunk_keys) == len(payloads)
        with self._lock:
            if transfer_id in self._leases:
                return False
            deadline = self.clock() + self.lease_s
            self._leases[transfer_id] = Lease(transfer_id, list(chunk_keys), list(payloads), deadline)
            return True

    def reap(self) -> list[Lease]:
        """Leases that end now (dropped): pulled, failed, or expired unclaimed."""
        now = self.clock()
        done = []
        with self._lock:
            for transfer_id, lease in list(self._leases.items()):
                expired = lease.state is LeaseState.READY and lease.deadline <= now
                if lease.state is LeaseState.DONE or expired:
                    if expired:
                        self.num_expired += 1
                        log.warning("KV lease %s expired before a decoder pulled it", transfer_id)
                    done.append(self._leases.pop(transfer_id))
        return done

    def _claim(self, transfer_id: str) -> Lease | None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.state is not LeaseState.READY or lease.deadline <= self.clock():
                return None
            lease.state = LeaseState.SENDING
            return lease

    def _done(self, lease: Lease, sent: bool) -> None:
        with self._lock:
            lease.state = LeaseState.DONE
            if sent:
                self.num_sent += 1
            else:
                self.num_failed += 1

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                with self._lock:
                    self.num_refused += 1
                _reset_on_close(conn)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer-send", daemon=True).start()

    def _request_limit(self) -> int:
        with self._lock:
            most = max((len(lease.chunk_keys) for lease in self._leases.values()), default=0)
        return REQUEST_BASE_BYTES + REQUEST_BYTES_PER_CHUNK * most

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve_authenticated(conn)
        finally:
            self._slots.release()

    def _serve_authenticated(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            accept_peer(conn, self._key, self._handshake_timeout_s)
        except (OSError, PeerAuthError) as error:
            with self._lock:
                self.num_refused += 1
            log.debug("a KV transfer peer was refused: %s", error)  # counted: num_refused
            _reset_on_close(conn)
            return
        deadline = time.monotonic() + min(REQUEST_TIMEOUT_S, self.lease_s)
        try:
            request = _requests.decode(recv_frame(conn, self._request_limit(), deadline))
        except (OSError, TransferError, msgspec.DecodeError) as error:
            log.debug("a KV pull request was not read: %s", error)
            return
        lease = self._claim(request.transfer_id)
        if lease is None:
            with self._lock:
                self.num_unknown += 1
            self._reply_quietly(conn, PullReply(UNKNOWN, f"no KV is leased under {request.transfer_id!r}"))
            return
        sent = False
        try:
            if request.layout == self.layout:
                sent = self._send(conn, lease, request.chunk_keys)
            else:  # the lease was for this decoder: it ends
                conn.settimeout(max(lease.deadline - self.clock(), 0.001))
                send_frame(conn, PullReply(MISMATCH, self._mismatch(request.layout)))
        except (OSError, TransferError) as error:
            log.warning("KV transfer %s failed or stalled past its lease: %s", lease.transfer_id, error)
            _reset_on_close(conn)
        finally:
            self._done(lease, sent)

    def _send(self, conn: socket.socket, lease: Lease, wanted: list[bytes]) -> bool:
        keys = lease.chunk_keys
        position = {h: i for i, h in enumerate(keys)}
        first = position.get(wanted[0]) if wanted else None
        count = 0
        if first is not None:
            while count < len(wanted) and first + count < len(keys) and keys[first + count] == wanted[count]:
                count += 1
        conn.settimeout(max(lease.deadline - self.clock(), 0.001))  # sendall: a total bound
        if count == 0:
            send_frame(conn, PullReply(OK))
            with self._lock:
                self.num_released += 1
            return True
        assert first is not None
        payloads = lease.payloads[first : first + count]
        send_frame(conn, PullReply(OK, sizes=[p.nbytes for p in payloads]))
        for payload in payloads:
            conn.settimeout(max(lease.deadline - self.clock(), 0.001))  # all of them by the deadline
            conn.sendall(memoryview(np.ascontiguousarray(payload)).cast("B"))
        return True

    def _mismatch(self, layout: str) -> str:
        return (
            f"the decoder's KV chunks ({layout}) are not the prefiller's ({self.layout}): both need the "
            "same model, cache layout and kv_chunk_blocks"
        )

    @staticmethod
    def _reply_quietly(conn: socket.socket, reply: PullReply) -> None:
        try:
            conn.settimeout(5.0)
            send_frame(conn, reply)
        except OSError:
            pass

    def close(self) -> None:
        """Stop accepting pulls (those in flight finish or fail on their own deadlines)."""
        self._closed.set()
        self._listener.close()
        self._accept_thread.join(1.0)


def _reset_on_close(conn: socket.socket) -> None:
    """Make closing `conn` a reset: what a stalled decoder left unread in this socket's send
    buffer (megabytes) is dropped at once instead of trickling out at the decoder's pace."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- the decode side ----------------------------------------------------------------------------


class KVPuller:
    """The decode engine's side: pulls run on a small thread pool, each bounded by `timeout_s`
    from connection to the last byte. `key`: the cluster key the prefiller must prove it holds
    (and this side proves to it) before a byte of KV is read: a stranger's "KV" never lands."""

    def __init__(self, timeout_s: float, threads: int = 2, *, key: bytes | None = None) -> None:
        self.timeout_s = timeout_s
        self._key = key
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-transfer-pull")

    def pull(self, source: KVSource, chunk_keys: list[bytes], layout: str) -> Future[list[np.ndarray]]:
        """The payloads (uint8) of the longest leading run of `chunk_keys` the prefiller holds,
        chunks of `layout` (ChunkLayout.describe()); [] for none. Fails with TransferError or
        TimeoutError."""
        return self._pool.submit(self._pull, source, list(chunk_keys), layout)

    def _pull(self, source: KVSource, chunk_keys: list[bytes], layout: str) -> list[np.ndarray]:
        deadline = time.monotonic() + self.timeout_s
        host, port = split_address(source.address)
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                dial_peer(sock, self._key, max(deadline - time.monotonic(), 0.001))
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                send_frame(sock, PullRequest(source.transfer_id, chunk_keys, layout))
                reply = _replies.decode(recv_frame(sock, MAX_REPLY_BYTES, deadline))
                if reply.status != OK:
                    raise TransferError(
                        f"the prefill engine at {source.address} answered {reply.status}: {reply.message}"
                    )
                if len(reply.sizes) > len(chunk_keys) or any(size < 0 for size in reply.sizes):
                    raise TransferError(f"the prefill engine at {source.address} sent chunks not asked for")
                data = np.empty(sum(reply.sizes), dtype=np.uint8)
                recv_into(sock, memoryview(data), deadline)
                offsets = itertools.accumulate(reply.sizes, initial=0)
                return [data[start:end] for start, end in itertools.pairwise(offsets)]
        except TimeoutError:
            raise TimeoutError(
                f"the KV transfer from {source.address} took longer than {self.timeout_s:g} s"
            ) from None
        except PeerAuthError as error:
            raise TransferError(f"the peer at {source.address} was refused: {error}") from None
        except ConnectionError as error:
            raise TransferError(f"the prefill engine at {source.address} is unreachable: {error}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
