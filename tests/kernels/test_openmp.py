"""kernels/openmp.py: the OpenMP runtime torch and our kernels share ends a thread's idle workers
on request (async scheduling relies on it), and parallel work runs afterwards as before."""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.openmp import release_thread_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_the_calling_threads_workers_end_and_come_back_on_demand() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        expected = x @ x  # a parallel region: this thread now keeps a worker
        with_pool = _threads()
        assert release_thread_pool()
        assert _threads() < with_pool
        assert torch.equal(x @ x, expected)  # a new region starts new workers
    finally:
        torch.set_num_threads(previous)
