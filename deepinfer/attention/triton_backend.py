"""The GPU backend: Triton kernels over the paged cache (kernels/triton/paged_attention.py).

Decode rows (query length 1) go through the decode kernel, one program per row and KV head;
every other chunk, whatever its length, through the prefill kernel in tiles of BLOCK_M queries.
On CUDA the kernels are compiled; on the CPU they run only under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests prove them against the reference backend.
"""

from __future__ import annotations

import torch

from deepinfer.attention.backend import write_kv
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.kernels.triton import usable_on

# Queries per prefill tile: a tensor-core tile on the GPU, and few padded rows for the short
# chunks of speculative verification.
BLOCK_M = 16
# Positions one decode program reads: a batch-1 row of 4k positions runs 32 parts per KV head.
DECODE_PART = 128


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device, decode_part: int = DECODE_PART) -> None:
        """`decode_part`: positions per decode program (a longer row is split and merged)."""
        if not usable_on(device.type):
            raise RuntimeError(
                "attention_backend='triton' needs triton and a CUDA device "
                "(or TRITON_INTERPRET=1 set before start, to interpret it on the CPU: slow, for tests)"
            )
        from deepinfer.kernels.triton import paged_attention

        self._kernels = paged_attention
        self.decode_part = decode_part

    def prepare(self, meta: AttentionMetadata) -> None:
        d = meta.num_decodes
        lens = meta.seq_lens[:d].contiguous()
        if meta.window is None:
            starts = torch.zeros_like(lens)
        else:  # a decode row sees its last `window` positions
            starts = (lens - meta.window).clamp_(min=0)
        meta.extra["triton_decode"] = (meta.block_tables[:d].contiguous(), lens, starts)
        window = meta.window or max(meta.seq_lens_list[:d], default=0)
        contexts = [min(n, window) for n in meta.seq_lens_list[:d]]
        meta.extra["triton_parts"] = self._kernels.decode_parts(contexts, self.decode_part)
        chunks = []  # (block-table row, first step token, query count, context length)
        token = d
        for i in range(d, meta.num_seqs):
            chunks.append((i, token, meta.query_lens[i], meta.seq_lens_list[i]))
            token += meta.query_lens[i]
        device = meta.block_tables.device
        # A decode-only step makes its empty tiles on the device: no host copy, so the step can be
        # captured in a CUDA graph (runner/graphs.py).
        meta.extra["triton_tiles"] = (
            self._kernels.prefill_tiles(chunks, BLOCK_M, device)
            if chunks
            else torch.empty((4, 0), dtype=torch.int64, device=device)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D], cache: [S, 2, KVH, D] -> out [T, H, D]."""
        write_kv(cache, k, v, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        tables, lens, starts = meta.extra["triton_decode"]
        self._kernels.paged_decode(
            out[:d], q[:d], cache, tables, lens, starts, meta.block_size, scale,
            num_parts=meta.extra["triton_parts"], part_len=self.decode_part,
        )  # fmt: skip
        self._kernels.paged_prefill(
            out, q, cache, meta.block_tables, meta.extra["triton_tiles"], meta.block_size, scale,
            meta.window, BLOCK_M,
        )  # fmt: skip
        return out
