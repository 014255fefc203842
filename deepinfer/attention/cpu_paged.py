"""The fast CPU backend: a C kernel for decode rows, tiled GEMMs over gathered context for prefill chunks.

Decode is memory bound: the kernel reads each sequence's K/V once, straight from the paged cache,
without gathering or padding. Short chunks (speculative verification, the tail of a chunked
prompt) are cheaper the same way: each of their tokens becomes a kernel row whose context ends at
its own position, which is the causal mask. Long prefill chunks are compute bound and few per
step: their gathered context goes through tiled GEMMs that skip the masked half (prefill_tiled.py).
"""

from __future__ import annotations

import ctypes
import sys

import torch

from deepinfer.attention.backend import context_slots, write_kv
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.attention.prefill_tiled import attend_chunk_tiled
from deepinfer.kernels.build import load_kernel_library
from deepinfer.kernels.kv_format import KV_FORMATS, kv_format

_MAX_GROUP, _MAX_HEAD_DIM = 32, 512
# Chunks up to this many tokens run as kernel rows: below it, reading the context once per token
# (from cache) costs less than gathering it and a per-sequence attention call.
KERNEL_CHUNK_TOKENS = 16


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _library() -> ctypes.CDLL | None:
    # Without contraction: each fused multiply-add is written out, so a row's bits are the
    # source's, not the compiler's choice in each function it is inlined into.
    return load_kernel_library("paged_attention", ("-ffp-contract=off",))


def bf16_products(head_dim: int) -> bool:
    """Whether this CPU computes a bf16 cache's attention at this head size in bf16 products
    (AMX tiles or VDPBF16PS, once the kernel's self-check has passed) rather than in fp32: what
    `kv_cache_dtype` auto weighs for a GGUF model. Runs the self-check on its first call."""
    lib = _library()
    return lib is not None and lib.paged_attention_bf16_rows(ctypes.c_int64(head_dim)) > 0


class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self, row_kernel_only: bool = False) -> None:
        """`row_kernel_only`: every chunk as kernel rows, however long, so that each query row
        is computed the same way whatever chunk it is in (slower for long prompts: -9% prefill
        at 512 tokens, -39% at 2048 on SmolLM2)."""
        self.kernel_chunk_tokens = sys.maxsize if row_kernel_only else KERNEL_CHUNK_TOKENS
        lib = _library()
        if lib is None:
            raise RuntimeError("the paged_attention C kernel could not be built")
        self._decode = lib.paged_decode_attention
        self._decode.restype = None
        self._decode.argtypes = (
            [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64]
        )
        self._write = lib.paged_write_kv
        self._write.restype = None
        self._write.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
        self._write.argtypes += [ctypes.c_int64] * 4
        # For a caller that runs whole layers in C (kernels/decode_layers.py): the same functions.
        self.write_kv_address = ctypes.cast(self._write, ctypes.c_void_p).value
        self.decode_item_address = ctypes.cast(lib.paged_attention_item, ctypes.c_void_p).value
        self.decode_merge_address = ctypes.cast(lib.paged_decode_attention_merge, ctypes.c_void_p).value
        self.decode_plan_address = ctypes.cast(lib.paged_attention_plan, ctypes.c_void_p).value
        # A bf16 cache's rows (head_dim 64 or 128) on bf16 products: 2 AMX bf16 tiles, 1
        # VDPBF16PS, 0 the fp32 path; asked here, once per process, before any parallel call.
        self.bf16_path = int(lib.paged_attention_bf16_path())

    @staticmethod
    def supports(
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
    ) -> bool:
        # Any block size: the kernel walks spans of positions, whatever blocks hold them.
        fits = num_heads // num_kv_heads <= _MAX_GROUP and head_dim <= _MAX_HEAD_DIM
        return fits and kv_dtype in KV_FORMATS

    def prepare(self, meta: AttentionMetadata) -> None:
        d = meta.num_decodes
        row_tokens = list(range(d))  # step token index of each kernel row
        row_seqs = list(range(d))  # the sequence whose block table a row reads
        row_lens = meta.seq_lens_list[:d]  # context length a row attends to
        long_chunks = []  # (first token, query length, context slots)
        start = d
        for i in range(d, meta.num_seqs):
            num_q, length = meta.query_lens[i], meta.seq_lens_list[i]
            if num_q <= self.kernel_chunk_tokens:
                row_tokens.extend(range(start, start + num_q))
                row_seqs.extend([i] * num_q)
                row_lens.extend(range(length - num_q + 1, length + 1))
            else:
                long_chunks.append((start, num_q, context_slots(meta, i)))
            start += num_q
        # A sliding window makes each row start later: at its own length - window.
        meta.extra["kernel_starts"] = (
            None
            if meta.window is None
            else torch.tensor([max(n - meta.window, 0) for n in row_lens], dtype=torch.int64)
        )
        rows = len(row_tokens)
        meta.extra["kernel_rows"] = rows
        # Kernel rows that are exactly tokens 0..rows-1 need no gather (the common case: no long prefill).
        contiguous = row_tokens == list(range(rows))
        meta.extra["kernel_tokens"] = None if contiguous else torch.tensor(row_tokens, dtype=torch.int64)
        if rows == d:
            meta.extra["kernel_tables"] = meta.block_tables[:d].contiguous()
            meta.extra["kernel_lens"] = meta.seq_lens[:d].contiguous()
        else:
            meta.extra["kernel_tables"] = meta.block_tables[torch.tensor(row_seqs, dtype=torch.int64)]
            meta.extra["kernel_lens"] = torch.tensor(row_lens, dtype=torch.int64)
        meta.extra["long_chunks"] = long_chunks

    def _write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """write_kv in one C call when the rows are fp32 with contiguous heads (the model's case)."""
        heads, dim = k.shape[1], k.shape[2]
        rows_ok = k.dtype is torch.float32 and k.stride(2) == 1 and k.stride(1) == dim
        rows_ok = rows_ok and v.dtype is torch.float32 and v.stride(2) == 1 and v.stride(1) == dim
        if not (rows_ok and cache.is_contiguous() and slots.dtype is torch.int64 and slots.is_contiguous()):
            write_kv(cache, k, v, slots)
            return
        k_cache = cache.data_ptr()  # slot 0's K; its V follows after one K row
        self._write(
            k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache, k_cache + cache.stride(1) * cache.element_size(),
            slots.data_ptr(), k.shape[0], heads * dim, cache.stride(0), kv_format(cache.dtype),
        )  # fmt: skip

    def attend_rows(
        self,
        q: torch.Tensor,  # [rows, H, D] fp32, contiguous
        cache: torch.Tensor,  # [num_slots, 2, KVH, D] fp32, fp16 or bf16
        out: torch.Tensor,  # [rows, H, D], written
        tables: torch.Tensor,  # [rows, max_blocks] int64: each row's block table
        lens: torch.Tensor,  # [rows] int64: each row attends to positions starts .. lens - 1
        block_size: int,
        scale: float,
        starts: torch.Tensor | None = None,  # [rows] int64, a sliding window's first positions
    ) -> None:
        """The C kernel over kernel rows (consecutive rows of one chunk share each K/V load)."""
        _, num_heads, head_dim = q.shape
        self._decode(
            _ptr(q), _ptr(cache[:, 0]), _ptr(cache[:, 1]), _ptr(out), _ptr(tables), _ptr(lens),
            ctypes.c_void_p(None) if starts is None else _ptr(starts), q.shape[0], num_heads, cache.shape[2],
            head_dim, cache.stride(0), block_size, tables.shape[1], scale, kv_format(cache.dtype),
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._write_kv(cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        rows = meta.extra["kernel_rows"]
        if rows:
            tokens = meta.extra["kernel_tokens"]
            q_rows = q[:rows] if tokens is None else q.index_select(0, tokens)
            out_rows = out[:rows] if tokens is None else torch.empty_like(q_rows)
            self.attend_rows(
                q_rows,
                cache,
                out_rows,
                meta.extra["kernel_tables"],
                meta.extra["kernel_lens"],
                meta.block_size,
                scale,
                meta.extra["kernel_starts"],
            )
            if tokens is not None:
                out.index_copy_(0, tokens, out_rows)
        for start, num_q, slots in meta.extra["long_chunks"]:
            out[start : start + num_q] = attend_chunk_tiled(
                q[start : start + num_q],
                cache[slots, 0].to(q.dtype),
                cache[slots, 1].to(q.dtype),
                scale,
                meta.window,
            )
        return out
