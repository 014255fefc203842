"""The engine's default thread count follows the CPUs a process may use: its affinity mask and the
CPU quota of its cgroup (cgroup v1 and v2 trees written out here, then real processes pinned to one
core or placed in a real cgroup with a quota of one CPU where this machine lets us make one)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine.parallel.context import rank_threads
from deepinfer.engine.parallel.cores import cgroup_cpu_limit, usable_cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_takes_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")  # the pod: 1.5 CPUs
    _write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")  # the container: none
    _write(root / "kubepods" / "cpu.max", "400000 100000\n")
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_limit(proc, root) == 1.5
    assert usable_cpus(proc, root) == min(len(os.sched_getaffinity(0)), 2)  # 1.5 rounds up


def test_v1_container_sees_its_own_cgroup_as_the_root(tmp_path):
    # docker without a cgroup namespace: /proc/self/cgroup names the host's path, which is not
    # under the container's mount; the mount's root is the container's cgroup.
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "100000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "proc_cgroup"
    _write(proc, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_limit(proc, root) == 1.0
    assert usable_cpus(proc, root) == 1


@pytest.mark.parametrize(
    ("files", "proc_line"),
    [
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n"),
        ({"cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n"}, "0::/\n"),
        ({"cgroup.controllers": "cpu\n", "cpu.max": "garbage\n"}, "0::/\n"),
        ({}, "0::/\n"),
    ],
)
def test_no_quota_leaves_the_affinity(tmp_path, files, proc_line):
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        _write(root / name, text)
    proc = tmp_path / "proc_cgroup"
    _write(proc, proc_line)
    assert cgroup_cpu_limit(proc, root) is None
    assert usable_cpus(proc, root) == len(os.sched_getaffinity(0))
    assert cgroup_cpu_limit(tmp_path / "missing", root) is None


def test_more_threads_than_cpus_is_said(caplog):
    config = EngineConfig.from_kwargs(num_threads=usable_cpus() + 1)
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine.parallel.context"):
        assert rank_threads(config, None) == usable_cpus() + 1
    assert "--num-threads" in caplog.text


_ENGINE_THREADS = """
import torch
from deepinfer import LLM
llm = LLM(max_model_len=256, kv_cache_memory="64MiB")
print(torch.get_num_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_an_engine_pinned_to_one_core_runs_one_thread():
    core = min(os.sched_getaffinity(0))
    result = subprocess.run(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n{_ENGINE_THREADS}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.split()[-1] == "1"


def _quota_cgroup() -> Path | None:
    """A new cgroup with a quota of one CPU (v1's cpu controller or v2 with cpu enabled); None
    where this machine does not let us make one."""
    name = f"deepinfer-test-{uuid.uuid4().hex[:8]}"
    for base, limits in (
        (Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}),
        (Path("/sys/fs/cgroup"), {"cpu.max": "100000 100000"}),
    ):
        directory = base / name
        try:
            directory.mkdir()
        except OSError:
            continue
        try:
            for file, value in limits.items():
                (directory / file).write_text(value)
        except OSError:
            directory.rmdir()
            continue
        return directory
    return None


def test_a_process_under_a_cpu_quota_counts_one_cpu():
    directory = _quota_cgroup()
    if directory is None:
        pytest.skip("this machine does not let the tests make a cgroup with a CPU quota")
    try:
        joined = f"open({str(directory / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))"
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                f"{joined}\nfrom deepinfer.engine.parallel.cores import usable_cpus, cgroup_cpu_limit\n"
                "print(cgroup_cpu_limit(), usable_cpus())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        directory.rmdir()  # the child has exited: the cgroup is empty
    assert result.stdout.split() == ["1.0", "1"]
