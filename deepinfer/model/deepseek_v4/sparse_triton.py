"""`attend_with_sink` on the Triton kernel (kernels/triton/sparse_attention.py): the engine's
`attention_backend="triton"` path of DeepSeek-V4's attention.

The model gathers its keys and a [queries, keys] visibility mask (window rows, then compressed
entries, whatever the layer type); the kernel wants, per query, the list of rows it attends. Each
mask row becomes its visible columns, in key order, padded with -1 to the longest list of the
block (a decode row lists at most window + entries rows, not the block's whole key range).
"""

from __future__ import annotations

import torch


def visible_rows(mask: torch.Tensor) -> torch.Tensor:
    """mask [n, L] bool -> [n, K] int64: each query's visible columns in increasing order, then
    -1; K is the most any query sees (one read back to the host)."""
    width = int(mask.sum(dim=1).max()) if mask.numel() else 0
    # Visible columns first, each group in column order (a stable sort of the negated mask).
    columns = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]
    return torch.where(mask.gather(1, columns), columns, -1)


def attend_with_sink_triton(
    q: torch.Tensor,  # [n, H, D]
    kv: torch.Tensor,  # [L, D]: keys and values
    mask: torch.Tensor,  # [n, L] bool: which rows each query sees
    sinks: torch.Tensor,  # [H] logits of the sink
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    # Imported on use: Triton is an optional dependency, needed only when this path is chosen.
    from deepinfer.kernels.triton import sparse_attention

    return sparse_attention.sparse_attention_with_sink(
        q.contiguous(), kv.contiguous(), visible_rows(mask), sinks, scale
    )
