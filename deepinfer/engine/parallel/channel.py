"""How rank 0 hands each step to the other ranks, and how they answer.

`publish` goes from rank 0 to every other rank, in order; `reply` from a rank to rank 0, which
`collect`s one reply per rank. Two implementations:

- ShmChannel, on one machine (rank 0 spawned the others): messages are written into a ring of
  slots in shared memory, and a byte on a pipe wakes each reader (a blocked reader costs no CPU,
  and a woken one reads the message where it lies). The writer reuses a slot only after every
  reader has marked it read. A message larger than a slot travels on the pipe itself.
- ProcessGroupChannel, across machines: broadcast and gather of the pickled message over a
  torch.distributed (gloo) group of its own.

Both detect a dead peer: the pipe's end (or the process sentinel) closes, or the collective fails;
a dead peer raises PeerLost rather than hanging.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.distributed.topology import Topology

NUM_SLOTS = 8
SLOT_BYTES = 1 << 20
_HEADER = struct.Struct("<QQ")  # sequence number, payload length
_COUNTER = struct.Struct("<q")  # the last message a reader has read
POLL_S = 1.0


class PeerLost(RuntimeError):
    """A rank on the other end of a channel is gone."""


class ShmRing:
    """One writer, `num_readers` readers. Layout: an int64 read counter per reader, then
    NUM_SLOTS slots of [seq, length, payload]."""

    def __init__(self, memory: shared_memory.SharedMemory, num_readers: int, owner: bool) -> None:
        self.memory = memory
        self.num_readers = num_readers
        self.owner = owner
        self.buf = memory.buf
        self.slots_at = 8 * num_readers

    @classmethod
    def create(cls, num_readers: int) -> ShmRing:
        size = 8 * num_readers + NUM_SLOTS * (_HEADER.size + SLOT_BYTES)
        memory = shared_memory.SharedMemory(create=True, size=size)
        memory.buf[:size] = bytes(size)
        return cls(memory, num_readers, owner=True)

    @classmethod
    def attach(cls, name: str, num_readers: int) -> ShmRing:
        # The owner unlinks the segment. Spawned ranks share rank 0's resource tracker, so their
        # registration of the name (Python < 3.13 always registers) is the owner's own.
        try:
            memory = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:
            memory = shared_memory.SharedMemory(name=name)
        return cls(memory, num_readers, owner=False)

    def _slot(self, seq: int) -> int:
        return self.slots_at + (seq % NUM_SLOTS) * (_HEADER.size + SLOT_BYTES)

    def write(self, seq: int, payload: bytes, alive: Any) -> None:
        """Write message `seq` once every reader has read message seq - NUM_SLOTS."""
        while (
            min(_COUNTER.unpack_from(self.buf, 8 * i)[0] for i in range(self.num_readers)) < seq - NUM_SLOTS
        ):
            alive()
            time.sleep(0.0005)
        at = self._slot(seq)
        start = at + _HEADER.size
        self.buf[start : start + len(payload)] = payload
        _HEADER.pack_into(self.buf, at, seq, len(payload))

    def read(self, seq: int, reader: int) -> bytes:
        at = self._slot(seq)
        found, length = _HEADER.unpack_from(self.buf, at)
        if found != seq:
            raise RuntimeError(f"shared-memory channel out of step: expected message {seq}, found {found}")
        start = at + _HEADER.size
        payload = bytes(self.buf[start : start + length])
        _COUNTER.pack_into(self.buf, 8 * reader, seq)
        return payload

    def close(self) -> None:
        self.buf = None
        self.memory.close()
        if self.owner:
            self.memory.unlink()


@dataclass(slots=True)
class ShmHandle:
    """What a spawned rank needs to open its ends of a ShmChannel (picklable for spawn)."""

    broadcast_name: str
    num_readers: int
    reader: int  # this rank's index among the readers (rank - 1)
    doorbell: Connection  # rank 0 rings it for every published message
    reply_name: str
    reply_bell: Connection  # this rank rings it for every reply


class StepChannel(ABC):
    """Rank 0's end."""

    @abstractmethod
    def publish(self, message: Any) -> None: ...

    @abstractmethod
    def collect(self) -> list[Any]:
        """One reply from every other rank, in rank order."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class WorkerEnd(ABC):
    """A rank's end of the channel from rank 0."""

    @abstractmethod
    def receive(self) -> Any: ...

    @abstractmethod
    def reply(self, message: Any) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional
        pass


def _encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class ShmChannel(StepChannel):
    def __init__(self, num_workers: int) -> None:
        self.ring = ShmRing.create(num_workers)
        self.seq = 0
        self.bells: list[Connection] = []
        self.reply_rings: list[ShmRing] = []
        self.reply_bells: list[Connection] = []
        self.reply_seqs = [0] * num_workers
        self.handles: list[ShmHandle] = []
        self.sentinels: list[int] = []  # process sentinels, set once the ranks are spawned
        for reader in range(num_workers):
            bell_read, bell_write = multiprocessing.Pipe(duplex=False)
            reply_read, reply_write = multiprocessing.Pipe(duplex=False)
            ring = ShmRing.create(1)
            self.bells.append(bell_write)
            self.reply_rings.append(ring)
            self.reply_bells.append(reply_read)
            self.handles.append(
                ShmHandle(
                    self.ring.memory.name, num_workers, reader, bell_read, ring.memory.name, reply_write
                )
            )

    def _alive(self) -> None:
        ready = multiprocessing.connection.wait(self.sentinels, timeout=0) if self.sentinels else []
        if ready:
            raise PeerLost("a rank exited")

    def publish(self, message: Any) -> None:
        payload = _encode(message)
        self.seq += 1
        inline = len(payload) <= SLOT_BYTES
        if inline:
            self.ring.write(self.seq, payload, self._alive)
        for bell in self.bells:
            try:
                bell.send_bytes(b"" if inline else payload)
            except OSError as error:
                raise PeerLost(f"a rank is gone: {error}") from error

    def collect(self) -> list[Any]:
        replies = []
        for index, (bell, ring) in enumerate(zip(self.reply_bells, self.reply_rings)):
            while not bell.poll(POLL_S):
                self._alive()
            try:
                data = bell.recv_bytes()
            except (EOFError, OSError) as error:
                raise PeerLost(f"rank {index + 1} is gone") from error
            self.reply_seqs[index] += 1
            replies.append(pickle.loads(data if data else ring.read(self.reply_seqs[index], 0)))
        return replies

    def close(self) -> None:
        for bell in self.bells + self.reply_bells:
            bell.close()
        self.ring.close()
        for ring in self.reply_rings:
            ring.close()


class ShmWorkerEnd(WorkerEnd):
    def __init__(self, handle: ShmHandle, parent_pid: int) -> None:
        self.handle = handle
        self.ring = ShmRing.attach(handle.broadcast_name, handle.num_readers)
        self.reply_ring = ShmRing.attach(handle.reply_name, 1)
        self.parent_pid = parent_pid
        self.seq = 0
        self.reply_seq = 0

    def _alive(self) -> None:
        if os.getppid() != self.parent_pid:
            raise PeerLost("rank 0 is gone")

    def receive(self) -> Any:
        bell = self.handle.doorbell
        while not bell.poll(POLL_S):
            self._alive()
        try:
            data = bell.recv_bytes()
        except (EOFError, OSError) as error:
            raise PeerLost("rank 0 closed the channel") from error
        self.seq += 1
        return pickle.loads(data if data else self.ring.read(self.seq, self.handle.reader))

    def reply(self, message: Any) -> None:
        payload = _encode(message)
        self.reply_seq += 1
        inline = len(payload) <= SLOT_BYTES
        if inline:
            self.reply_ring.write(self.reply_seq, payload, self._alive)
        try:
            self.handle.reply_bell.send_bytes(b"" if inline else payload)
        except OSError as error:
            raise PeerLost("rank 0 is gone") from error

    def close(self) -> None:
        self.ring.close()
        self.reply_ring.close()


class ProcessGroupChannel(StepChannel, WorkerEnd):
    """Broadcast and gather of pickled messages over a gloo group of their own (across machines).
    Its timeout is long: a rank waits here while the engine is idle, and a dead peer is noticed
    by its closed connection, not by a timeout."""

    IDLE_TIMEOUT = datetime.timedelta(days=365)

    def __init__(self, store: dist.Store, topology: Topology) -> None:
        self.rank = topology.rank
        self.size = topology.world_size
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("steps", store), self.rank, self.size, self.IDLE_TIMEOUT
        )

    def _broadcast(self, payload: bytes | None) -> bytes:
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._wait(self.group.broadcast(length, 0))
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload is not None
            else torch.empty(int(length.item()), dtype=torch.uint8)
        )
        if data.numel():
            self._wait(self.group.broadcast(data, 0))
        return data.numpy().tobytes()

    @staticmethod
    def _wait(work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            raise PeerLost(f"a rank is gone: {error}") from error

    def _gather(self, payload: bytes) -> list[bytes]:
        length = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [[torch.empty_like(length) for _ in range(self.size)]]
        self._wait(self.group.allgather(lengths, [length]))
        sizes = [int(t.item()) for t in lengths[0]]
        width = max(sizes)
        data = torch.zeros(width, dtype=torch.uint8)
        if payload:
            data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [[torch.empty_like(data) for _ in range(self.size)]]
        if width:
            self._wait(self.group.allgather(parts, [data]))
        return [part[:size].numpy().tobytes() for part, size in zip(parts[0], sizes)]

    def publish(self, message: Any) -> None:
        self._broadcast(_encode(message))

    def receive(self) -> Any:
        return pickle.loads(self._broadcast(None))

    def reply(self, message: Any) -> None:
        self._gather(_encode(message))

    def collect(self) -> list[Any]:
        return [pickle.loads(part) for part in self._gather(b"")[1:]]
