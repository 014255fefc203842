"""DeepSeek-V4.1's kept state on the engine's paged cache groups.

What a sequence keeps, one declaration (model/deepseek_v4/cache.py's CacheDecl) per (layer, kind):

kind              rows per token  row width        layers                  a step reads back
sliding_kv        1               head_dim         every layer             the W - 1 positions before
compressor_state  1               2 * head_dim     C2 KV sources           1 position (an open block)
compressed_kv     1 / ratio       head_dim         KV sources (C1 and C2)  the entries the top-k picks
indexer_keys      1 / ratio       index_head_dim   index-K sources         every entry
token_ids         1               1 (int64)        once (the model)        max_ngram_size - 1 positions

Layers that borrow another layer's compressed KV or index keys (the config's sharing maps) read
the source's rows: a shared cache is declared, and counted, once. The C2 compressor ring of the
contiguous store (model/deepseek_v4/v41_cache.py) becomes one [logits | latent] row per token here, as
V4's compressor state: a step rebuilds the ring of its chunk from the row of the open block's
first token (if the chunk starts inside a block) and writes its own tokens' rows when it ends,
so rolling back needs no undo and no `backtrack` bound. The token ids are the context Engram's
n-grams read before a chunk (the runner hands the model only the chunk's tokens), an image
position's as Engram's image sentinel (-1, layers/engram.py); they are declared under the first
Engram layer.

model/deepseek_v4/model.py's `v4_cache_groups` turns the declarations into groups: a sliding group per
lookback (window = lookback + 1: the raw KV, the C2 state, the token ids), the full group (C1
entries and C1 index keys, one per token) and the compressed group of rate 2 (C2 entries and
their index keys). A prefix hit ends on a multiple of every group's block tokens, hence on an
even position: no C2 block is open there, and every entry before it is complete and cached.
"""

from __future__ import annotations

import torch

from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.model.deepseek_v4.cache import CacheDecl, CacheKind, StepLayout
from deepinfer.model.deepseek_v4.paged import PagedTensor, PagedV4Cache
from deepinfer.model.deepseek_v4.v41_config import C2, DeepseekV41Arch


def token_ids_layer(arch: DeepseekV41Arch) -> int | None:
    """The layer the token-id rows are declared under (None: no Engram, nothing kept)."""
    return arch.engram.layer_ids[0] if arch.engram is not None and arch.engram.layer_ids else None


def cache_declarations(arch: DeepseekV41Arch) -> list[CacheDecl]:
    """Every tensor the backbone keeps per sequence (DSpark's draft layers keep none here: not in the engine yet)."""
    decls = []
    for layer in range(arch.num_layers):
        decls.append(CacheDecl(layer, CacheKind.SLIDING_KV, arch.head_dim, 1, arch.sliding_window - 1))
        ratio = arch.compress_ratio(layer)
        if arch.owns_compressor(layer):
            if ratio == C2:
                decls.append(CacheDecl(layer, CacheKind.COMPRESSOR_STATE, 2 * arch.head_dim, 1, ratio - 1))
            decls.append(CacheDecl(layer, CacheKind.COMPRESSED_KV, arch.head_dim, ratio, None))
        if arch.owns_index_keys(layer):
            decls.append(CacheDecl(layer, CacheKind.INDEXER_KEYS, arch.index_head_dim, ratio, None))
    tokens_layer = token_ids_layer(arch)
    if tokens_layer is not None:
        decls.append(CacheDecl(tokens_layer, CacheKind.TOKEN_IDS, 1, 1, arch.engram.max_ngram_size - 1))
    return decls


class PagedV41Step:
    """One step's V41StepView over the engine's paged groups (see the module docstring). Reads
    are checked against the declarations (PagedV4Cache): a row outside a kind's lookback, or
    past the step's last token, raises instead of returning a released block's data."""

    def __init__(
        self,
        arch: DeepseekV41Arch,
        tensors: dict[tuple[int, CacheKind], PagedTensor],
        meta: ForwardMetadata,
        layout: StepLayout,
    ) -> None:
        self.arch, self.layout = arch, layout
        self.cache = PagedV4Cache(tensors, meta, layout)
        self.device = meta.groups[0].block_tables.device
        self._tokens_layer = token_ids_layer(arch)
        self._rings: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> [S, 2, head_dim]

    def _positions(self, first: int, end: int) -> torch.Tensor:
        return torch.arange(first, end, device=self.device)

    def _own(self, seq: int) -> torch.Tensor:
        """This step's positions of sequence `seq`."""
        start = self.layout.starts[seq]
        return self._positions(start, start + self.layout.query_lens[seq])

    def context(self, seq: int) -> list[int]:
        """The up to max_ngram_size - 1 token ids before this step's chunk."""
        if self._tokens_layer is None:
            raise RuntimeError("this model keeps no token ids: it has no Engram layer")
        start = self.layout.starts[seq]
        first = max(0, start - (self.arch.engram.max_ngram_size - 1))
        rows = self.cache.read(seq, self._tokens_layer, CacheKind.TOKEN_IDS, self._positions(first, start))
        return rows[:, 0].tolist()

    def write_sliding(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        self.cache.write(
            seq, layer, CacheKind.SLIDING_KV, self._positions(first, first + rows.shape[0]), rows
        )

    def sliding(self, seq: int, layer: int, first: int, last: int) -> torch.Tensor:
        """Rows of positions first .. last [last - first + 1, head_dim]."""
        return self.cache.read(seq, layer, CacheKind.SLIDING_KV, self._positions(first, last + 1))

    def ring(self, seq: int, layer: int) -> torch.Tensor | None:
        """The C2 ring of this step's chunk, [ratio - 1 + n, 2, head_dim]: large enough that the
        open block's earlier token and all n new tokens keep their own slots (p % size), so the
        compressor's writes into it are every new token's row, stored by `finish`."""
        ratio = self.arch.compress_ratio(layer)
        if ratio != C2:
            return None
        ring = self._rings.get((seq, layer))
        if ring is None:
            start, count = self.layout.starts[seq], self.layout.query_lens[seq]
            size = ratio - 1 + count
            ring = torch.zeros((size, 2, self.arch.head_dim), device=self.device)
            carried = self._positions(start - start % ratio, start)
            rows = self.cache.read(seq, layer, CacheKind.COMPRESSOR_STATE, carried)
            ring[carried % size] = rows.float().view(-1, 2, self.arch.head_dim)
            self._rings[(seq, layer)] = ring
        return ring

    def write_entries(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        index = self._positions(first, first + rows.shape[0])
        self.cache.write(seq, layer, CacheKind.COMPRESSED_KV, index, rows)

    def entries(self, seq: int, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Compressed KV rows [len(index), head_dim] of the KV source `layer`."""
        return self.cache.read(seq, layer, CacheKind.COMPRESSED_KV, index).float()

    def write_index_keys(self, seq: int, layer: int, first: int, rows: torch.Tensor) -> None:
        index = self._positions(first, first + rows.shape[0])
        self.cache.write(seq, layer, CacheKind.INDEXER_KEYS, index, rows)

    def index_keys(self, seq: int, layer: int) -> torch.Tensor:
        """Every complete entry's index key [entries, index_head_dim] of the index-K source `layer`."""
        end = self.layout.starts[seq] + self.layout.query_lens[seq]
        count = end // self.arch.compress_ratio(layer)
        index = self._positions(0, count)
        return self.cache.read(seq, layer, CacheKind.INDEXER_KEYS, index).float()

    def finish(self, input_ids: torch.Tensor) -> None:
        """After the forward: store the C2 rows of this step's tokens and their ids (as Engram
        keeps them: -1 at image positions)."""
        for (seq, layer), ring in self._rings.items():
            own = self._own(seq)
            self.cache.write(
                seq, layer, CacheKind.COMPRESSOR_STATE, own, ring[own % ring.shape[0]].flatten(1)
            )
        if self._tokens_layer is None:
            return
        offsets = self.layout.offsets
        for seq in range(len(self.layout.starts)):
            ids = input_ids[offsets[seq] : offsets[seq + 1]].unsqueeze(1)  # [n, 1]
            self.cache.write(seq, self._tokens_layer, CacheKind.TOKEN_IDS, self._own(seq), ids)
