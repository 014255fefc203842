"""A rank that answers every message with its size (for the channel test; importable by spawn)."""

from __future__ import annotations

import os

from deepinfer.engine.parallel.channel import ShmHandle, ShmWorkerEnd


def echo(handle: ShmHandle, parent_pid: int) -> None:
    end = ShmWorkerEnd(handle, parent_pid)
    while True:
        message = end.receive()
        if message == "exit":
            os._exit(3)
        end.reply((handle.reader, len(message), message[:4]))
