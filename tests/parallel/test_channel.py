"""The shared-memory step channel between real processes: order, messages larger than a slot,
more messages than slots, and a reader that dies."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from deepinfer.engine.parallel.channel import NUM_SLOTS, SLOT_BYTES, PeerLost, ShmChannel
from tests.parallel.channel_echo import echo

pytestmark = pytest.mark.slow


def test_publish_collect_and_a_dead_reader():
    channel = ShmChannel(2)
    context = multiprocessing.get_context("spawn")
    readers = [context.Process(target=echo, args=(h, os.getpid()), daemon=True) for h in channel.handles]
    for reader in readers:
        reader.start()
    channel.sentinels = [r.sentinel for r in readers]
    try:
        sizes = [10, SLOT_BYTES + 7, 3] * NUM_SLOTS  # wraps the ring several times; some travel on the pipe
        for i, size in enumerate(sizes):
            channel.publish(bytes([i % 256]) * size)
            assert channel.collect() == [(r, size, bytes([i % 256]) * min(size, 4)) for r in range(2)]
        channel.publish("exit")
        with pytest.raises(PeerLost):
            channel.collect()
    finally:
        for reader in readers:
            reader.kill()
        channel.close()
