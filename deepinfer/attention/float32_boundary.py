"""An fp32 attention backend (the CPU's C kernels) under a model whose activations are bf16.

The C kernels read fp32 queries and an fp32, fp16 or bf16 cache. A bf16 model hands them its
q/k/v widened to fp32 (exact) and gets the output rounded back to bf16 once. K/V reach the cache
in the cache's own dtype: bf16 for a bf16 model on the CPU by default (`kv_cache_dtype` auto),
their values as the model computed them. Attention runs in fp32 arithmetic, or on a CPU with AMX
on bf16 tiles (q and the softmax weights in bf16, sums in fp32, as HF's bf16 SDPA keeps them).
"""

from __future__ import annotations

import torch

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import AttentionMetadata


class Float32Boundary:
    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name

    def prepare(self, meta: AttentionMetadata) -> None:
        self.inner.prepare(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = self.inner.forward(q.float(), k.float(), v.float(), cache, meta, scale)
        return out.to(q.dtype)
