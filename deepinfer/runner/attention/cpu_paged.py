"""The fast CPU backend: a C kernel for decode rows, SDPA over gathered context for prefill chunks.

Decode is memory bound: the kernel reads each sequence's K/V once, straight from the paged cache,
without gathering or padding. Prefill chunks are compute bound and few per step, so they go
through PyTorch's fused SDPA (GEMM-based) on their gathered context.
"""

from __future__ import annotations

import ctypes

import torch

from deepinfer.runner.attention.backend import attend_sequence, context_slots, write_kv
from deepinfer.runner.attention.metadata import AttentionMetadata
from deepinfer.runner.kernels.build import load_kernel_library

_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK = 32, 512, 256


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self) -> None:
        lib = load_kernel_library("paged_attention")
        if lib is None:
            raise RuntimeError("the paged_attention C kernel could not be built")
        self._decode = lib.paged_decode_attention
        self._decode.restype = None
        self._decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
        return (
            num_heads // num_kv_heads <= _MAX_GROUP and head_dim <= _MAX_HEAD_DIM and block_size <= _MAX_BLOCK
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        d = meta.num_decodes
        meta.extra["decode_tables"] = meta.block_tables[:d].contiguous()
        meta.extra["decode_lens"] = meta.seq_lens[:d].contiguous()
        meta.extra["prefill_slots"] = [context_slots(meta, i) for i in range(d, meta.num_seqs)]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            tables = meta.extra["decode_tables"]
            _, num_heads, head_dim = q.shape
            self._decode(
                _ptr(q),
                _ptr(cache[:, 0]),
                _ptr(cache[:, 1]),
                _ptr(out),
                _ptr(tables),
                _ptr(meta.extra["decode_lens"]),
                d,
                num_heads,
                cache.shape[2],
                head_dim,
                cache.stride(0),
                meta.block_size,
                tables.shape[1],
                scale,
            )
        start = d
        for slots, num_q in zip(meta.extra["prefill_slots"], meta.query_lens[d:]):
            out[start : start + num_q] = attend_sequence(
                q[start : start + num_q], cache[slots, 0], cache[slots, 1], scale
            )
            start += num_q
        return out
