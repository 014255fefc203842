"""Steps over scattered block tables, shared by the attention kernel tests."""

from __future__ import annotations

import random

import torch

from deepinfer.attention.metadata import AttentionMetadata


def scattered_step(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    seed: int,
    window: int | None = None,
    device: str = "cpu",
) -> AttentionMetadata:
    """Sequences whose blocks are shuffled over the pool (block 0 never used, so a test can fill
    it with NaN); with a window, the blocks no query of the step sees point at block 0, as the
    engine's released blocks do."""
    rng = random.Random(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for num_q, length in zip(query_lens, seq_lens, strict=True):
        table = [free.pop() for _ in range(-(-length // block_size))]
        if window is not None:
            first_key = max(length - num_q - window + 1, 0)
            table[: first_key // block_size] = [0] * (first_key // block_size)
        tables.append(table)
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(length - num_q, length)
        )
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
        window=window,
    )
