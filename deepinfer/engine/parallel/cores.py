"""How many CPUs this process may keep busy: its affinity mask, capped by its cgroup's CPU quota.

`os.cpu_count()` counts the machine's CPUs. A process started under `taskset`, in a container with
a cpuset (`docker --cpuset-cpus`) or with a CPU quota (`docker --cpus`, a Kubernetes CPU limit)
may use fewer, and an OpenMP team larger than that waits on itself at every barrier: on a 2-core
Zen 4 the default model's batch-1 TPOT was 8.6-9.4 ms with two threads pinned to one core against
6.1-6.4 ms with one, and 10.7-11.3 against 5.7-6.7 ms under a quota of one CPU
(docs/benchmarks.md, "Threads and cores").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may run on, capped by the tightest CPU quota over its cgroup and its
    ancestors, rounded up (1.5 CPUs: two threads were faster than one, docs/benchmarks.md);
    at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(proc_cgroup, root)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(cpus, 1)


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota, in CPUs (quota / period), over this process's cgroup and its
    ancestors, from cgroup v2's cpu.max or v1's cpu.cfs_quota_us; None where none is set or the
    files cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and not controllers:  # the v2 hierarchy (alone, or beside v1 as "unified")
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            limits += _limits_up(base, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            limits += _limits_up(base, path, _v1_limit)
    return min(limits, default=None)


def _limits_up(base: Path, path: str, read: Callable[[Path], float | None]) -> Iterator[float]:
    """The limits of the cgroup at `path` under `base` and of each ancestor that is there. A
    container whose cgroup is mounted as the root sees its own path missing under it: the walk
    up then reaches the root, which is that cgroup."""
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = base.joinpath(*parts[:depth])
        if directory.is_dir():
            limit = read(directory)
            if limit is not None:
                yield limit


def _v2_limit(directory: Path) -> float | None:
    """cpu.max: "<quota> <period>" in microseconds, or "max <period>" for none."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> float | None:
    """cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
