"""The OpenMP runtime our kernels share with torch (libgomp): freeing a thread's idle workers."""

from __future__ import annotations

import ctypes
import logging

import torch  # noqa: F401  (loads torch's libgomp first: the runtime every kernel library binds to)

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1


def release_thread_pool() -> bool:
    """End the calling thread's idle OpenMP workers (`omp_pause_resource_all`, soft: the next
    parallel region it leads starts new ones); True if the runtime did.

    libgomp keeps a pool of workers per thread that has led a parallel region and counts every
    pool against the cores. With asynchronous scheduling the forward thread leads every region
    after loading; the pool the loading thread kept would make libgomp, seeing more threads than
    cores, sleep at each barrier instead of spinning (a batch-1 decode step 3x slower on 2 cores)."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    released = pause(_OMP_PAUSE_SOFT) == 0
    if not released:
        log.warning("the OpenMP runtime kept this thread's workers: asynchronous steps may run slower")
    return released
