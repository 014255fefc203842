"""Tensor-parallel layers: the one place where a weight is split over the ranks of a group.

A layer holds this rank's part of the weight as an ordinary inner module (`linear`, an
nn.Linear, or whatever replaces it: an int8 or quantized linear), so the split composes with
any weight representation; the communication (an all-reduce after a row-parallel product, a
gather of vocabulary-parallel logits) happens around the inner module, never inside it.

- ColumnParallelLinear: this rank's output features, of a weight whose rows may stack fused
  segments (q, k, v; gate, up), each split on its own.
- RowParallelLinear: this rank's input features; the partial products are summed over the group.
- VocabParallelEmbedding / ParallelLMHead: this rank's rows of the vocabulary.
With a group of one, each is exactly the unsplit layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model.parallel import SINGLE, TensorParallel, split_evenly


@dataclass(frozen=True, slots=True)
class Segment:
    """`size` rows (or columns) of a whole weight, of which this rank holds [lo, hi)."""

    size: int
    lo: int
    hi: int

    @classmethod
    def whole(cls, size: int) -> Segment:
        return cls(size, 0, size)

    @classmethod
    def even(cls, size: int, tp: TensorParallel, unit: int = 1) -> Segment:
        """An even split in multiples of `unit` (a head's rows)."""
        lo, hi = split_evenly(size // unit, tp.size, tp.rank)
        return cls(size, lo * unit, hi * unit)

    @property
    def local(self) -> int:
        return self.hi - self.lo

    def take(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor along `dim`."""
        if tensor.shape[dim] != self.size:
            raise ValueError(f"expected {self.size} entries along dim {dim}, got shape {tuple(tensor.shape)}")
        return tensor.narrow(dim, self.lo, self.local)


def head_segments(
    num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel
) -> tuple[Segment, Segment]:
    """(q rows, k or v rows) of this rank: the KV heads split as evenly as they go (uneven when the
    group does not divide them) and each rank takes the query heads that read its KV heads."""
    if num_kv_heads < tp.size:
        raise ValueError(
            f"tensor_parallel_size={tp.size} exceeds the model's {num_kv_heads} KV heads: every rank needs one"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    lo, hi = split_evenly(num_kv_heads, tp.size, tp.rank)
    kv = Segment(num_kv_heads * head_dim, lo * head_dim, hi * head_dim)
    q = Segment(num_heads * head_dim, lo * group * head_dim, hi * group * head_dim)
    return q, kv


def _linear(rows: int, cols: int, bias: bool = False) -> torch.nn.Linear:
    layer = torch.nn.Linear(cols, rows, bias=bias)
    layer.requires_grad_(False)
    return layer


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, in_features: int, segments: list[Segment], bias: bool = False) -> None:
        super().__init__()
        self.segments = segments
        self.offsets = [0]
        for segment in segments:
            self.offsets.append(self.offsets[-1] + segment.local)
        self.linear = _linear(self.offsets[-1], in_features, bias)

    @property
    def out_features(self) -> int:
        return self.offsets[-1]

    @property
    def splits(self) -> dict[str, tuple[int, list[Segment]]]:
        """How the weight loader places checkpoint tensors (loader/shards.py): rows, by segment."""
        return {"linear.weight": (0, self.segments), "linear.bias": (0, self.segments)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class RowParallelLinear(torch.nn.Module):
    """y = sum over ranks of x_r W_r^T, where x_r [T, columns.local] is this rank's part of the input."""

    def __init__(self, columns: Segment, out_features: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.columns = columns
        self.tp = tp
        self.linear = _linear(out_features, columns.local)

    @property
    def splits(self) -> dict[str, tuple[int, list[Segment]]]:
        """How the weight loader places the checkpoint weight: this rank's input columns."""
        return {"linear.weight": (1, [self.columns])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))


def vocab_segments(vocab_size: int, tp: TensorParallel) -> tuple[Segment, list[int]]:
    """This rank's vocabulary rows, and how many every rank holds."""
    sizes = [hi - lo for lo, hi in (split_evenly(vocab_size, tp.size, r) for r in range(tp.size))]
    return Segment(vocab_size, *split_evenly(vocab_size, tp.size, tp.rank)), sizes


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.rows, self.sizes = vocab_segments(vocab_size, tp)
        self.weight = torch.nn.Parameter(torch.empty(self.rows.local, hidden_size), requires_grad=False)

    @property
    def splits(self) -> dict[str, tuple[int, list[Segment]]]:
        """How the weight loader places the checkpoint weight: this rank's vocabulary rows."""
        return {"weight": (0, [self.rows])}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.lo
        outside = (local < 0) | (local >= self.rows.local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(1), 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output head: [N, hidden] -> [N, vocab]."""
        return self.tp.gather_last_dim(F.linear(hidden, self.weight), self.sizes)


class ParallelLMHead(torch.nn.Module):
    """Logits of this rank's vocabulary rows through an inner linear, gathered over the group."""

    def __init__(
        self, linear: torch.nn.Module, rows: Segment, sizes: list[int], tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.linear = linear
        self.rows = rows
        self.sizes = sizes
        self.tp = tp

    @classmethod
    def empty(cls, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> ParallelLMHead:
        rows, sizes = vocab_segments(vocab_size, tp)
        return cls(_linear(rows.local, hidden_size), rows, sizes, tp)

    @property
    def splits(self) -> dict[str, tuple[int, list[Segment]]]:
        """How the weight loader places the checkpoint weight: this rank's vocabulary rows."""
        return {"linear.weight": (0, [self.rows])}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last_dim(self.linear(hidden), self.sizes)
