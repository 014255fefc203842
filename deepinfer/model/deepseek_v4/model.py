"""DeepSeek-V4 (V4-Flash, V4-Pro), in plain PyTorch: numerically transformers' DeepseekV4ForCausalLM.

A token's residual is `hc_mult` streams (mHC, layers/mhc.py); each layer collapses them into the
input of its attention and of its MoE block and spreads their outputs back. Attention is one of
three layer types (layers/v4_attention.py): a sliding window of raw K = V rows, plus a compressed
history (CSA: one entry per 4 tokens, the lightning indexer picks index_topk of them; HCA: one
per 128 tokens, all attended). The first layers route tokens to experts by a fixed table
(hash_moe), the others by a learned router (layers/v4_moe.py). The MTP module (one sliding-window
block) drafts the token after next from the final streams and the next token's embedding.

The kept state is explicit per-token and per-entry rows behind a V4Cache; `cache_declarations`
lists them (layer, kind, row width, rows per token, how far back a step reads). On the engine they
become cache groups (`cache_groups`, `group_declarations`): one sliding group per distinct
lookback (window = lookback + 1) and one compressed group per compress rate, read and written
through model/deepseek_v4/paged.py's PagedV4Cache. `forward_cached` runs a step over any V4Cache;
`forward` is it over the engine's groups (on the `triton` backend with the sparse attention and
the routed experts on kernels/triton; the torch code otherwise).

Over several ranks (ModelParallel): attention splits its query heads by output group
(layers/v4_attention.py, which says what stays replicated), the MoE block splits or shards its
experts as DeepSeek-V3's does (layers/v4_moe.py), the embedding and head split the vocabulary; the
mHC mixing, the norms and the hash routing tables are replicated (they act on the whole residual
streams every rank carries). The kept state is the same on every rank of a tensor-parallel group.
MTP is not loaded: speculative decoding is not run over several ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.cache_layout import CacheGroup
from deepinfer.config import ConfigError, ParallelConfig
from deepinfer.model.base import CausalLM, cache_tensor
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v4.attention import V4Attention
from deepinfer.model.deepseek_v4.cache import INTEGER_KINDS, CacheDecl, CacheKind, StepLayout, V4Cache
from deepinfer.model.deepseek_v4.config import CSA, DeepseekV4Arch
from deepinfer.model.deepseek_v4.mhc import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm
from deepinfer.model.deepseek_v4.paged import PagedTensor, PagedV4Cache, step_layout
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.weights import load_v4_weights
from deepinfer.model.layers.parallel_linear import Segment, VocabParallelEmbedding, vocab_segments
from deepinfer.model.parallel import ModelParallel

log = logging.getLogger(__name__)


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


def cache_declarations(arch: DeepseekV4Arch) -> list[CacheDecl]:
    """Every tensor the model keeps per sequence (see model/deepseek_v4/cache.py): main layers
    0 .. num_layers - 1, then each MTP module's block (sliding window) as layer num_layers + depth."""
    window = arch.sliding_window
    decls = []
    for layer in range(arch.num_layers + arch.num_mtp_layers):
        decls.append(CacheDecl(layer, CacheKind.SLIDING_KV, arch.head_dim, 1, window - 1))
        rate = arch.compress_rate(layer)
        if not rate:
            continue
        csa = arch.layer_type(layer) == CSA
        # CSA rows carry two halves for its overlapping windows, so a step closing a window
        # re-reads that window and the one before; an HCA step only the open window.
        windows = 2 if csa else 1
        state = CacheDecl(
            layer, CacheKind.COMPRESSOR_STATE, 2 * windows * arch.head_dim, 1, windows * rate - 1
        )
        decls.append(state)
        decls.append(CacheDecl(layer, CacheKind.COMPRESSED_KV, arch.head_dim, rate, None))
        if csa:
            decls.append(CacheDecl(layer, CacheKind.INDEXER_STATE, 4 * arch.index_head_dim, 1, 2 * rate - 1))
            decls.append(CacheDecl(layer, CacheKind.INDEXER_KEYS, arch.index_head_dim, rate, None))
    return decls


def group_declarations(decls: list[CacheDecl]) -> list[list[CacheDecl]]:
    """The declarations bucketed into engine cache groups, in order of first appearance: a
    windowed kind (one row per token, `lookback` positions read back) goes to the sliding group
    of window lookback + 1, a compressed kind (one entry per m tokens) to the compressed group of
    rate m (`v4_cache_groups` makes rate 1, V4.1's C1 entries, a full group)."""
    buckets: dict[tuple[str, int], list[CacheDecl]] = {}
    for decl in decls:
        if decl.lookback is not None:
            key = ("sliding", decl.lookback + 1)
        else:
            key = ("compressed", decl.tokens_per_row)
        buckets.setdefault(key, []).append(decl)
    return list(buckets.values())


def v4_cache_groups(decls: list[CacheDecl], dtype: torch.dtype, owner: str) -> list[CacheGroup]:
    """One CacheGroup per bucket of `group_declarations`, a [slots, width] tensor per declaration
    (in `dtype`, or int64 for the integer kinds)."""
    groups = []
    for bucket in group_declarations(decls):
        tensors = tuple(
            cache_tensor(
                f"layers.{d.layer}.{d.kind.value}",
                (d.width,),
                torch.int64 if d.kind in INTEGER_KINDS else dtype,
                owner,
            )
            for d in bucket
        )
        first = bucket[0]
        if first.lookback is not None:
            groups.append(CacheGroup("sliding", tensors, window=first.lookback + 1))
        elif first.tokens_per_row == 1:
            groups.append(CacheGroup("full", tensors))
        else:
            groups.append(CacheGroup("compressed", tensors, tokens_per_entry=first.tokens_per_row))
    return groups


def paged_tensors(
    decls: list[CacheDecl], kv_caches: list[torch.Tensor]
) -> dict[tuple[int, CacheKind], PagedTensor]:
    """(layer, kind) -> its tensor among `kv_caches` (the groups' tensors flattened in the order of
    `v4_cache_groups`) and its group index."""
    out: dict[tuple[int, CacheKind], PagedTensor] = {}
    flat = iter(kv_caches)
    for group, bucket in enumerate(group_declarations(decls)):
        for decl in bucket:
            out[(decl.layer, decl.kind)] = PagedTensor(decl, next(flat), group)
    return out


class V4Block(torch.nn.Module):
    def __init__(
        self,
        arch: DeepseekV4Arch,
        layer: int,
        main_rope: TrailingRope,
        compress_rope: TrailingRope,
        parallel: ModelParallel | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ModelParallel()
        eps = arch.rms_norm_eps
        self.attn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.attn = V4Attention(arch, layer, main_rope, compress_rope, parallel.tp)
        self.ffn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.ffn = V4MoE(
            arch.hidden_size,
            arch.moe_intermediate_size,
            arch.num_experts,
            arch.top_k,
            arch.scoring_func,
            arch.routed_scaling_factor,
            arch.swiglu_limit,
            arch.vocab_size if arch.is_hash_layer(layer) else None,
            parallel.tp,
            parallel.ep,
        )
        self.hc_attn = HyperConnection(
            arch.hidden_size, arch.hc_mult, arch.hc_sinkhorn_iters, arch.hc_eps, eps
        )
        self.hc_ffn = HyperConnection(
            arch.hidden_size, arch.hc_mult, arch.hc_sinkhorn_iters, arch.hc_eps, eps
        )

    def forward(
        self,
        streams: torch.Tensor,  # [T, N, hidden]
        token_ids: torch.Tensor,  # [T]: what hash layers route by
        positions: torch.Tensor,
        layout: StepLayout,
        cache: V4Cache,
        triton: bool = False,  # sparse attention and routed experts through kernels/triton
    ) -> torch.Tensor:
        collapsed, post, comb = self.hc_attn(streams)
        out = self.attn(self.attn_norm(collapsed), positions, layout, cache, triton)
        streams = HyperConnection.expand(streams, out, post, comb)
        collapsed, post, comb = self.hc_ffn(streams)
        out = self.ffn(self.ffn_norm(collapsed), token_ids, fused=triton)
        return HyperConnection.expand(streams, out, post, comb)


class MTPModule(torch.nn.Module):
    """Reads the main model's final streams at position i and the embedding of token i + 1."""

    def __init__(
        self, arch: DeepseekV4Arch, layer: int, main_rope: TrailingRope, compress_rope: TrailingRope
    ) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.e_proj = _param(arch.hidden_size, arch.hidden_size)
        self.h_proj = _param(arch.hidden_size, arch.hidden_size)
        self.enorm = Fp32RMSNorm(arch.hidden_size, eps)
        self.hnorm = Fp32RMSNorm(arch.hidden_size, eps)
        self.norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.hc_head = HyperHead(arch.hidden_size, arch.hc_mult, arch.hc_eps, eps)
        self.block = V4Block(arch, layer, main_rope, compress_rope)


class DeepseekV4ForCausalLM(CausalLM):
    uses_attention_backend = False

    def __init__(self, cfg: ModelConfig, parallel: ModelParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        parallel = parallel or ModelParallel()
        self.arch = arch = DeepseekV4Arch.from_model_config(cfg)
        if not parallel.is_single and arch.num_mtp_layers:
            self.arch = arch = dataclasses.replace(arch, num_mtp_layers=0)  # MTP weights not loaded
        self.tp = parallel.tp
        main_rope = TrailingRope(arch.rope_head_dim, arch.main_rope)
        compress_rope = TrailingRope(arch.rope_head_dim, arch.compress_rope)
        self.embed = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel.tp)
        self.layers = torch.nn.ModuleList(
            V4Block(arch, i, main_rope, compress_rope, parallel) for i in range(arch.num_layers)
        )
        self.hc_head = HyperHead(arch.hidden_size, arch.hc_mult, arch.hc_eps, arch.rms_norm_eps)
        self.norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        vocab_rows, self.vocab_sizes = vocab_segments(arch.vocab_size, parallel.tp)
        self.head = None if arch.tie_word_embeddings else _param(vocab_rows.local, arch.hidden_size)
        self.splits: dict[str, tuple[int, list[Segment]]] = {"head": (0, [vocab_rows])}
        self.mtp = torch.nn.ModuleList(
            MTPModule(arch, arch.num_layers + d, main_rope, compress_rope) for d in range(arch.num_mtp_layers)
        )

    @classmethod
    def from_config(cls, config: ModelConfig, parallel: ModelParallel | None = None) -> DeepseekV4ForCausalLM:
        return cls(config, parallel)

    @classmethod
    def check_parallel(cls, config: ModelConfig, parallel: ParallelConfig) -> None:
        arch = DeepseekV4Arch.from_model_config(config)
        if parallel.tensor_parallel_size > arch.o_groups:
            raise ConfigError(
                "tensor_parallel_size",
                f"{parallel.tensor_parallel_size} ranks exceed this DeepSeek-V4's o_groups={arch.o_groups}: "
                "attention splits its query heads by output group, and every rank needs one",
            )

    def expert_layers(self) -> list[torch.nn.Module]:
        return [layer.ffn.experts for layer in self.layers if layer.ffn.ep is not None]

    # -- what the engine allocates -------------------------------------------------------------

    def cache_declarations(self) -> list[CacheDecl]:
        """What to allocate per sequence; MTP blocks only while their weights are loaded."""
        return [d for d in cache_declarations(self.arch) if d.layer < self.arch.num_layers + len(self.mtp)]

    def main_declarations(self) -> list[CacheDecl]:
        return [d for d in self.cache_declarations() if d.layer < self.arch.num_layers]

    def cache_groups(self, dtype: torch.dtype, owner: str = "target") -> list[CacheGroup]:
        """The main layers' kept state as engine cache groups (see `group_declarations`)."""
        return v4_cache_groups(self.main_declarations(), dtype, owner)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # the tensors of cache_groups(), in order
        meta: ForwardMetadata,  # one AttentionMetadata per cache group
        backend: AttentionBackend,  # OwnAttention: its name says which kernels ("triton" or torch)
    ) -> torch.Tensor:  # final streams [T, hc_mult, hidden]
        layout = step_layout(meta)
        cache = PagedV4Cache(paged_tensors(self.main_declarations(), kv_caches), meta, layout)
        return self.forward_cached(
            input_ids, positions, layout, cache, triton=backend is not None and backend.name == "triton"
        )

    # -- main model ----------------------------------------------------------------------------

    def forward_cached(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], consecutive within each sequence of the layout
        layout: StepLayout,
        cache: V4Cache,
        triton: bool = False,  # sparse attention and routed experts through kernels/triton
    ) -> torch.Tensor:  # final streams [T, hc_mult, hidden]
        runs = [
            torch.arange(s, s + n, device=positions.device) for s, n in zip(layout.starts, layout.query_lens)
        ]
        # No sequences: the empty step of a data-parallel rank without work (it still meets the
        # other ranks in the MoE layers' all-to-alls).
        expected = torch.cat(runs) if runs else positions[:0]
        if not torch.equal(positions, expected):
            raise ValueError("positions must run consecutively from each sequence's start in the step layout")
        h = self.embed(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, layout, cache, triton)
        return streams

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final streams [N, hc_mult, hidden] -> logits [N, vocab] (gathered over the vocabulary's ranks)."""
        normed = self.norm(self.hc_head(hidden))
        if self.head is None:
            return self.embed.logits(normed)
        return self.tp.gather_last_dim(F.linear(normed, self.head), self.vocab_sizes)

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head

    # -- multi-token prediction ----------------------------------------------------------------

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    def mtp_cache_groups(self, dtype: torch.dtype) -> list[CacheGroup]:
        """The MTP blocks' raw KV (one [slots, head_dim] tensor per depth, owner "mtp"), as a full
        group: the proposer catches up on the rows of the previous step after the target's window
        has moved on (a prefill chunk's first rows read up to window - 1 positions before the
        chunk), so these rows are not released with the target's sliding blocks. Empty without
        MTP weights."""
        decls = [d for d in self.cache_declarations() if d.layer >= self.arch.num_layers]
        tensors = tuple(
            cache_tensor(f"mtp.{d.layer - self.arch.num_layers}.{d.kind.value}", (d.width,), dtype, "mtp")
            for d in decls
        )
        return [CacheGroup("full", tensors)] if tensors else []

    def mtp_draft_logits(
        self,
        next_token_ids: torch.Tensor,  # [T] token i + 1 for each row
        positions: torch.Tensor,  # [T] position i of each row
        previous_hidden: torch.Tensor,  # [T, hc_mult, hidden] final streams at i (or the previous depth's)
        kv_cache: torch.Tensor,  # this depth's MTP raw KV [num_slots, head_dim]
        forward_meta: ForwardMetadata,  # the rows laid out like a main-model step, one (full) group
        depth: int = 0,
        logits_rows: torch.Tensor | None = None,  # rows to compute logits for (default: all)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP proposer's entry point: draft logits [N, vocab] for the token after next and the
        streams [T, hc_mult, hidden] of every row; writes this step's rows into `kv_cache`."""
        layer = self.arch.num_layers + depth
        (decl,) = [d for d in self.cache_declarations() if d.layer == layer]
        layout = step_layout(forward_meta)
        cache = PagedV4Cache({(layer, decl.kind): PagedTensor(decl, kv_cache, 0)}, forward_meta, layout)
        logits, streams = self.mtp_forward(next_token_ids, positions, previous_hidden, layout, cache, depth)
        return (logits if logits_rows is None else logits[logits_rows]), streams

    def mtp_forward(
        self,
        next_token_ids: torch.Tensor,  # [T] token i + 1 for each row
        positions: torch.Tensor,  # [T] position i of each row
        previous: torch.Tensor,  # [T, hc_mult, hidden] final streams at i (or the previous depth's)
        layout: StepLayout,
        cache: V4Cache,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [T, vocab] for token i + 2 and this depth's streams [T, hc_mult, hidden].
        Writes the rows of the MTP block (layer num_layers + depth) into `cache`."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"MTP depth {depth} out of range: the model has {len(self.mtp)} MTP modules")
        module = self.mtp[depth]
        embeds = module.enorm(self.embed(next_token_ids))
        streams = F.linear(embeds, module.e_proj).unsqueeze(1) + F.linear(
            module.hnorm(previous), module.h_proj
        )
        streams = module.block(streams, next_token_ids, positions, layout, cache)
        logits = F.linear(module.norm(module.hc_head(streams)), self._head_weight())
        return logits, streams

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Official DeepSeek-V4 names (and the variants transformers' save_pretrained writes); FP8
        block-scaled weights and MXFP4 experts are dequantized on the way."""
        load_v4_weights(self, weights)
