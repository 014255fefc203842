"""Step inputs through the packed upload (runner/staging.py: one buffer, one copy; pinned and
non-blocking on CUDA) are the tensors the per-array upload gives, for every cache group."""

from __future__ import annotations

import torch

from deepinfer.cache_layout import CacheGroup, CacheTensor, GroupLayout
from deepinfer.runner.inputs import RowSpan, build_inputs
from deepinfer.runner.staging import PackedUpload, direct_upload, upload_for


def _groups() -> list[GroupLayout]:
    full = CacheGroup("full", (CacheTensor("kv", (2, 1, 4), "float32", 4),))
    sliding = CacheGroup("sliding", (CacheTensor("kv2", (2, 1, 4), "float32", 4),), window=3)
    return [GroupLayout(full, 16, 4), GroupLayout(sliding, 16, 4)]


def test_packed_upload_gives_the_direct_uploads_tensors():
    cpu = torch.device("cpu")
    spans = [
        RowSpan([[3, 5, 7], [2, 9, 13]], 9, [11]),  # a decode row
        RowSpan([[1, 4], [6, 8]], 2, [12, 13, 14, 15], prompt_len=6),  # a chunk
        RowSpan([[10], [0]], 0, [16]),
    ]
    packed = PackedUpload(cpu, pin=False)
    for _ in range(2):  # the buffer is refilled, never shared with the tensors given out
        first = build_inputs(spans, _groups(), cpu, packed)
        expected = build_inputs(spans, _groups(), cpu, direct_upload(cpu))
        again = build_inputs(spans[:1], _groups(), cpu, packed)  # a later step reuses the buffer
        assert torch.equal(first.input_ids, expected.input_ids)
        assert torch.equal(first.positions, expected.positions)
        assert first.offsets == expected.offsets
        for mine, theirs in zip(first.meta.groups, expected.meta.groups):
            for name in ("slot_mapping", "block_tables", "seq_lens"):
                assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
            assert mine.block_tables.shape == theirs.block_tables.shape == (3, 3)
        assert again.input_ids.tolist() == [11]
    empty = build_inputs([], _groups(), cpu, packed)
    assert empty.input_ids.shape == (0,) and empty.meta.groups[0].block_tables.shape == (0, 0)


def test_only_cuda_pins():
    assert not isinstance(upload_for(torch.device("cpu")), PackedUpload)
