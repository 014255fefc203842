"""Shared by the parallel tests."""

from __future__ import annotations

from pathlib import Path

from deepinfer import SamplingParams

DEEPSEEK_PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Engine options of every tiny DeepSeek-V4 engine: 4-token blocks (the CSA rate) and one thread a rank.
V4_ENGINE = {"block_size": 4, "num_blocks": 256, "num_threads": 1}


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def rank_processes(engine_pid: int) -> list[int]:
    """The ranks an engine process spawned (its children started by multiprocessing's spawn)."""
    ranks = []
    for pid in children(engine_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            ranks.append(pid)
    return ranks
