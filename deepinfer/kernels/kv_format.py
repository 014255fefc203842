"""The KV cache element types the C attention kernels read, as their `kv_format` argument
(paged_attention.h's KV_FLOAT32, KV_FLOAT16, KV_BFLOAT16)."""

from __future__ import annotations

import torch

KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_format(dtype: torch.dtype) -> int:
    """The kernels' code for a cache of `dtype` (KeyError for one they do not read)."""
    return KV_FORMATS[dtype]
