"""The contiguous store of what DeepSeek-V4.1's attention keeps per sequence, in plain growing tensors (no paging).

Per sequence, at logical indices (token positions, or entry numbers for the compressed kinds):
- sliding KV of every layer: [tokens, head_dim], the post-RoPE K = V rows (a step reads the
  W - 1 positions before its first token, W the sliding window);
- compressed KV of every layer that owns a compressor (a KV source): [entries, head_dim]
  post-RoPE; the layers sharing it read the source's rows;
- index keys of every index-K source: [entries, index_head_dim], as the indexer stores them;
- the compressor ring of every C2 KV source: [S, 2, head_dim] (layers/v41_compressor.py);
- the token ids so far: the Engram n-grams of the next chunk start from them.

A step writes every row of its own tokens and entries before reading, so rolling a sequence back
(`truncate`, rejected draft tokens) only moves its length: the rows are written again. The one
thing a rollback can lose is the ring slot of an open C2 block's first token, which later tokens
overwrite; the ring is sized for `backtrack` tokens and `truncate` refuses to go further back
than that from the furthest position ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.v41_cache import DEFAULT_BACKTRACK
from deepinfer.model.deepseek_v4.v41_compressor import ring_size
from deepinfer.model.deepseek_v4.v41_config import C2, DeepseekV41Arch


class _Rows:
    """One growing [rows, width] float32 tensor; rows at or past `count` are not held."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.data = torch.zeros((0, width), device=device)

    def write(self, first: int, rows: torch.Tensor) -> None:
        end = first + rows.shape[0]
        if end > self.data.shape[0]:
            grown = self.data.new_zeros((max(end, 2 * self.data.shape[0], 16), self.data.shape[1]))
            grown[: self.data.shape[0]] = self.data
            self.data = grown
        self.data[first:end] = rows.float()


@dataclass
class _Sequence:
    length: int = 0  # tokens computed
    furthest: int = 0  # the furthest length any step went to (what the rings may have seen)
    tokens: list[int] = field(default_factory=list)
    sliding: dict[int, _Rows] = field(default_factory=dict)
    entries: dict[int, _Rows] = field(default_factory=dict)
    index_keys: dict[int, _Rows] = field(default_factory=dict)
    rings: dict[int, torch.Tensor] = field(default_factory=dict)


class ContiguousV41Cache:
    def __init__(
        self, arch: DeepseekV41Arch, backtrack: int = DEFAULT_BACKTRACK, device: torch.device | None = None
    ) -> None:
        self.arch, self.backtrack = arch, backtrack
        self.device = device or torch.device("cpu")
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0

    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        state = _Sequence()
        arch = self.arch
        for layer in range(arch.num_layers):
            state.sliding[layer] = _Rows(arch.head_dim, self.device)
            if arch.owns_compressor(layer):
                state.entries[layer] = _Rows(arch.head_dim, self.device)
                if arch.compress_ratio(layer) == C2:
                    slots = ring_size(C2, self.backtrack)
                    state.rings[layer] = torch.zeros((slots, 2, arch.head_dim), device=self.device)
            if arch.owns_index_keys(layer):
                state.index_keys[layer] = _Rows(arch.index_head_dim, self.device)
        self._sequences[seq_id] = state
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        del self._sequences[seq_id]

    def length(self, seq_id: int) -> int:
        return self._sequences[seq_id].length

    def tokens(self, seq_id: int) -> list[int]:
        return self._sequences[seq_id].tokens

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget every token at or past num_tokens (speculative rollback)."""
        state = self._sequences[seq_id]
        if not 0 <= num_tokens <= state.length:
            raise ValueError(f"cannot truncate a sequence of {state.length} tokens to {num_tokens}")
        if state.rings and state.furthest - num_tokens > self.backtrack:
            raise ValueError(
                f"rolling back to {num_tokens} tokens after computing {state.furthest} exceeds the "
                f"{self.backtrack} tokens the C2 compressor rings keep (backtrack)"
            )
        state.length = num_tokens
        del state.tokens[num_tokens:]

    def step(self, seq_ids: list[int], layout: StepLayout) -> V41Step:
        if len(seq_ids) != len(layout.starts):
            raise ValueError(f"{len(seq_ids)} sequences for a step layout of {len(layout.starts)}")
        for seq_id, start in zip(seq_ids, layout.starts, strict=True):
            if start != self._sequences[seq_id].length:
                raise ValueError(
                    f"sequence {seq_id} holds {self._sequences[seq_id].length} tokens; a step must continue "
                    f"it there, not at position {start}"
                )
        for seq_id, start, count in zip(seq_ids, layout.starts, layout.query_lens, strict=True):
            state = self._sequences[seq_id]  # the step writes its rings up to start + count
            state.furthest = max(state.furthest, start + count)
        return V41Step(self, [self._sequences[s] for s in seq_ids], layout)


class V41Step:
    """One step's view of its sequences (`seq` is the index in the step's layout). Reads never
    go past the step's last token, nor before its window."""

    def __init__(self, cache: ContiguousV41Cache, sequences: list[_Sequence], layout: StepLayout) -> None:
        self.cache, self.sequences, self.layout = cache, sequences, layout

    def _end(self, seq: int) -> int:
        return self.layout.starts[seq] + self.layout.query_lens[seq]

    def context(self, seq: int) -> list[int]:
        """The token ids before this step's chunk (all of them here; Engram reads the last
        max_ngram_size - 1)."""
        return self.sequences[seq].tokens

    def write_sliding(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        """rows [n, head_dim] of this step's tokens at positions first .. first + n - 1 (all of
        the step's, or, under YoCo's bounded replay, its last ones)."""
        self.sequences[seq].sliding[layer].write(first, rows)

    def sliding(self, seq: int, layer: int, first: int, last: int) -> torch.Tensor:
        """Rows of positions first .. last [last - first + 1, head_dim]."""
        if first < self.layout.starts[seq] - self.cache.arch.sliding_window + 1 or last >= self._end(seq):
            raise RuntimeError(f"layer {layer}: sliding rows {first}..{last} are outside the step's window")
        return self.sequences[seq].sliding[layer].data[first : last + 1]

    def ring(self, seq: int, layer: int) -> torch.Tensor | None:
        """The C2 compressor ring of a KV source (mutated in place); None for C1."""
        return self.sequences[seq].rings.get(layer)

    def write_entries(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        self.sequences[seq].entries[layer].write(first, rows)

    def entries(self, seq: int, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Compressed KV rows [len(index), head_dim] of the KV source `layer`."""
        if index.numel() and int(index.max()) >= self._end(seq) // self.cache.arch.compress_ratio(layer):
            raise RuntimeError(f"layer {layer}: a compressed entry past the step's last token was read")
        return self.sequences[seq].entries[layer].data[index]

    def write_index_keys(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        self.sequences[seq].index_keys[layer].write(first, rows)

    def index_keys(self, seq: int, layer: int) -> torch.Tensor:
        """Every complete entry's index key [entries, index_head_dim] of the index-K source `layer`."""
        count = self._end(seq) // self.cache.arch.compress_ratio(layer)
        return self.sequences[seq].index_keys[layer].data[:count]

    def finish(self, input_ids: torch.Tensor) -> None:
        """After the forward: the sequences hold this step's token ids (as Engram keeps them:
        -1 at image positions)."""
        for seq, state in enumerate(self.sequences):
            first = self.layout.offsets[seq]
            state.tokens.extend(input_ids[first : first + self.layout.query_lens[seq]].tolist())
            state.length = self._end(seq)
