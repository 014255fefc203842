"""DeepSeek-V4.1-Flash's language model in plain PyTorch, over a contiguous per-sequence cache.

A token's residual is `hc_mult` streams (mHC, layers/mhc.py), shifted by default: each block
collapses the streams with the pre weights the block before computed, and the last block's pre
weights collapse the final streams (no hyper head). Per block, in order:
- on an Engram layer, the n-gram memory is added to the streams (layers/engram.py), before the
  block's own mixing weights are computed from them;
- attention (layers/v41_attention.py): sliding-only, C1 or C2 with top-k sparse entries, the
  compressed KV, index keys and top-k shared between layers as the config's maps say; the
  attention input of the YoCo boundary (the first C1 layer) is kept for the step, and every KV
  source after it compresses that instead of its own input;
- the MoE (layers/v4_moe.py: sqrtsoftplus scores, top-k on score + correction bias, normalized
  weights times routed_scaling_factor, one shared expert; V4.1 has no hash-routed layers).
Then the final norm and the LM head.

YoCo's prefill truncation is off by default, as in DeepSeek's engine: every layer runs every
token. `forward_cached`'s `replay` is its `compact` mode, bounded replay (model/deepseek_v4/yoco.py): the
boundary block captures the shared hidden of every row, then it and every later layer run only
a prompt's last KEEP tokens with their sliding windows clipped to them (the compressors still
read every row's shared hidden). Since a consumer layer's sliding KV comes from its own input
(DeepSeek's `yoco_swa_share_hidden` is off), the clipped windows change the prompt's last rows:
they equal DeepSeek's `mask` mode, not the model run without truncation. On the engine,
`forward` plans it from each span's prompt length once `configure` took the options.
The attention's KV is kept in float32: DeepSeek's engine stores the sliding KV as FP8 and the
compressed KV as FP4 (or FP8), which is not emulated (the index keys' FP4 is, as it decides the
top-k). DSpark's draft layers (`mtp.*`) are model/deepseek_v4/v41_dspark.py, fed by `forward_cached`'s
`features`. Images: with a vision tower (`self.vision`, model/deepseek_v4/vision.py) the forward takes
`image_embeds` for the rows `image_mask` marks and puts them in place of those rows' token
embeddings. Image tokens (DeepSeek's engine marks every position of an image's embeddings,
`image_start` / `image_newline` / `image_end` included) choose their experts with the routers'
`gate.bias_vl` instead of `gate.bias`, and Engram leaves their streams as they are and cuts every
n-gram at them (layers/engram.py); without a mask every token is text.

On the engine (registered as `deepseek_v41`): `forward_cached` runs a step over any V41StepView;
`forward` is it over the engine's cache groups (`cache_groups`: model/deepseek_v4/v41_paged.py's
declarations grouped as V4's are), read through PagedV41Step. The loader hands the model its
checkpoint directory (`from_checkpoint`: the shards are mapped, the Engram tables stay FP8 and
memory-mapped). `check_engine` refuses, before any weight loads, what it does not run yet:
bounded replay with prefix caching or the KV tiers (or too few kept tokens), a speculative method other than
DSpark (`dspark`, built here as `self.dspark` when the checkpoint has its layers; `forward` fills
the runner's `features`), several ranks, and a dtype or device other than float32 on the CPU.
The KV store, the host tier and both prefill/decode handoffs carry its cache groups as stored
chunks (engine/connectors/chunks.py), as for DeepSeek-V4.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.cache_layout import CacheGroup
from deepinfer.config import ConfigError, EngineConfig, ParallelConfig
from deepinfer.model.base import CausalLM, refuse_encoders, refuse_truncation
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v4.cache import CacheDecl, StepLayout
from deepinfer.model.deepseek_v4.engram import (
    Engram,
    EngramHashing,
    compressed_vocabulary,
    with_image_sentinels,
)
from deepinfer.model.deepseek_v4.mhc import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.model import paged_tensors, v4_cache_groups
from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm
from deepinfer.model.deepseek_v4.paged import step_layout
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.v41_attention import CrossLayer, V41Attention
from deepinfer.model.deepseek_v4.v41_block_parts import v41_hyper_connections, v41_moe
from deepinfer.model.deepseek_v4.v41_cache import V41StepView
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch, rope_specs
from deepinfer.model.deepseek_v4.v41_dspark import DSparkV41
from deepinfer.model.deepseek_v4.v41_paged import PagedV41Step, cache_declarations
from deepinfer.model.deepseek_v4.v41_weights import V41Weights, load_v41_weights
from deepinfer.model.deepseek_v4.vision import PREPROCESSED_MERGE, VisionEncoderV41
from deepinfer.model.deepseek_v4.vision_vit import PatchGrid
from deepinfer.model.deepseek_v4.yoco import (
    BoundedReplay,
    check_keep_tokens,
    engine_backtrack,
    prompt_floors,
)


class V41Block(torch.nn.Module):
    def __init__(self, arch: DeepseekV41Arch, layer: int, rope: TrailingRope) -> None:
        super().__init__()
        eps, moe = arch.rms_norm_eps, arch.moe
        self.layer, self.shifted = layer, arch.hc_shifted
        self.captures_shared_hidden = layer == arch.yoco_boundary
        self.attn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.attn = V41Attention(arch, layer, rope)
        self.ffn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        if moe.num_shared_experts != 1:
            raise ValueError(
                f"n_shared_experts={moe.num_shared_experts}: this model runs DeepSeek-V4.1's one shared expert"
            )
        self.ffn = v41_moe(arch, moe)
        self.hc_attn, self.hc_ffn = v41_hyper_connections(arch)
        self.engram: Engram | None = None  # set at load on Engram layers (it holds the mapped table)
        self.feeds_dspark = layer in arch.dspark.target_layer_ids

    def forward(
        self,
        streams: torch.Tensor,  # [T, N, hidden]
        pre: torch.Tensor | None,  # [T, N] the previous block's pre weights (shifted mHC)
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        layout: StepLayout,
        step: V41StepView,
        shared: CrossLayer,
        ngrams: torch.Tensor | None,  # [T, max_ngram_size] n-gram ids (Engram layers)
        features: dict[int, torch.Tensor] | None = None,
        image_mask: torch.Tensor | None = None,  # [T] bool, None: all text
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.engram is not None:
            streams = self.engram.forward_windows(streams, ngrams, image_mask)
        if features is not None and self.feeds_dspark:
            features[self.layer] = streams.float().mean(dim=1)  # DSpark's feature: the streams' mean
        collapsed, post, comb, pre = self.hc_attn.mix(streams, pre, self.shifted)
        x = self.attn_norm(collapsed)
        if self.captures_shared_hidden:
            shared.shared_hidden = x  # every row: the consumer layers' compressors read it
            replay = shared.replay
            if replay is not None:  # bounded replay: from here on, the kept rows only
                # No top-k or candidate blocks cross into it: the boundary (the first C1 layer)
                # is a KV source and sharing keeps to one compress ratio, so the later layers'
                # come from it or after it, already on the kept rows.
                x, streams, post, comb, pre, token_ids = (
                    replay.keep(t) for t in (x, streams, post, comb, pre, token_ids)
                )
                positions, layout = replay.positions, replay.layout
        streams = HyperConnection.expand(streams, self.attn(x, positions, layout, step, shared), post, comb)
        collapsed, post, comb, pre = self.hc_ffn.mix(streams, pre, self.shifted)
        out = self.ffn(self.ffn_norm(collapsed), token_ids, image_mask)
        return HyperConnection.expand(streams, out, post, comb), pre


class DeepseekV41ForCausalLM(CausalLM):
    """Built with its weights (Engram layers keep their tables mapped from the checkpoint)."""

    uses_attention_backend = False

    def __init__(
        self,
        arch: DeepseekV41Arch,
        weights: V41Weights,
        vocab_map: torch.Tensor | None = None,
        config: ModelConfig | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        if config is not None:
            self.config = config
        main_spec, compress_spec = rope_specs(arch)
        main_rope = TrailingRope(arch.rope_head_dim, main_spec)
        compress_rope = TrailingRope(arch.rope_head_dim, compress_spec)
        self.embed = torch.nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        self.layers = torch.nn.ModuleList(
            V41Block(arch, i, compress_rope if arch.compress_ratio(i) else main_rope)
            for i in range(arch.num_layers)
        )
        self.hc_head = (
            None
            if arch.hc_shifted
            else HyperHead(arch.hidden_size, arch.hc_mult, arch.hc_eps, arch.rms_norm_eps)
        )
        self.norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.head = torch.nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        self.hashing = EngramHashing.from_arch(arch, vocab_map) if arch.engram is not None else None
        self.replay_keep: int | None = None  # bounded replay on the engine (`configure`)
        self._load(weights)
        # DSpark's draft layers (speculative_method="dspark"), sharing the embedding and head.
        self.dspark = (
            DSparkV41(arch, weights.tensors, self.embed.data, self.head.data)
            if arch.dspark.num_layers
            else None
        )
        # After _load: its check that every parameter was filled covers the language model only.
        self.vision = VisionEncoderV41.from_weights(arch, weights) if weights.vision else None
        # Requests' images are laid out by the preprocessing for 3 x 3 merges; a tower that merges
        # otherwise (the tiny test checkpoints') still loads, but the engine takes no images for it.
        self.accepts_images = self.vision is not None and arch.vision.downsample_ratio == PREPROCESSED_MERGE

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, vocab_map: torch.Tensor | None = None
    ) -> DeepseekV41ForCausalLM:
        """A checkpoint directory (config.json and the shards); `vocab_map`: Engram's compressed
        vocabulary (layers/engram.py's compressed_vocabulary), when the config has one."""
        raw = json.loads((Path(directory) / "config.json").read_text())
        arch = DeepseekV41Arch.from_raw(raw)
        return cls(arch, load_v41_weights(directory, arch), vocab_map, ModelConfig.from_hf(raw))

    # -- the engine's side ---------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls, directory: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> DeepseekV41ForCausalLM:
        """The loader's entry: the weights from the directory's shards, Engram's compressed
        vocabulary (when the config has one) from its tokenizer.json."""
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"DeepSeek-V4.1 runs in float32 on the CPU, not {dtype} on {device}")
        arch = DeepseekV41Arch.from_raw(config.raw)
        vocab_map = None
        if arch.engram is not None and arch.engram.compressed_vocab_size is not None:
            vocab_map = compressed_vocabulary(
                tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
            )
        return cls(arch, load_v41_weights(directory, arch), vocab_map, config)

    @classmethod
    def check_parallel(cls, config: ModelConfig, parallel: ParallelConfig) -> None:
        if parallel.world_size > 1:
            raise ConfigError(
                "tensor_parallel_size" if parallel.tensor_parallel_size > 1 else "data_parallel_size",
                "DeepSeek-V4.1 runs on one rank (its layers have no split over ranks yet)",
            )

    @classmethod
    def check_engine(cls, config: ModelConfig, engine: EngineConfig) -> None:
        """What this model does not run yet, refused before any weight loads."""
        cls.check_parallel(config, engine.parallel)
        if DeepseekV41Arch.from_raw(config.raw).vision.downsample_ratio != PREPROCESSED_MERGE:
            refuse_encoders(
                engine, "this checkpoint's tower does not merge 3 x 3 patches: it takes no images"
            )
        if engine.yoco_prefill_truncation != "off":
            arch = DeepseekV41Arch.from_raw(config.raw)
            if arch.yoco_boundary is None:
                refuse_truncation(engine, "this checkpoint's YoCo boundary is a DSpark layer: YoCo is off")
            check_keep_tokens(engine.yoco_prefill_keep_tokens, arch.sliding_window, engine_backtrack(engine))
            if engine.cache.enable_prefix_caching:
                raise ConfigError(
                    "enable_prefix_caching",
                    "YoCo's bounded replay leaves the consumer layers' rows before a prompt's last "
                    "yoco_prefill_keep_tokens unwritten, which a prefix hit would read: turn prefix "
                    "caching off with yoco_prefill_truncation='compact'",
                )
            if engine.store.enabled:
                raise ConfigError(
                    "kv_store",
                    "YoCo's bounded replay leaves rows of the consumer layers unwritten, which a stored "
                    "chunk would carry to another request: no KV store or host tier with "
                    "yoco_prefill_truncation='compact'",
                )
        method = engine.speculative.speculative_method
        if method not in (None, "dspark"):
            raise ConfigError(
                "speculative_method",
                f"DeepSeek-V4.1 drafts with its DSpark layers ('dspark'), not {method!r}",
            )
        if method == "dspark" and not DeepseekV41Arch.from_raw(config.raw).dspark.num_layers:
            raise ConfigError(
                "speculative_method",
                "'dspark' needs DSpark layers: this checkpoint has num_nextn_predict_layers=0",
            )
        if engine.dtype not in ("auto", "float32"):
            raise ConfigError("dtype", f"DeepSeek-V4.1 computes in float32, not {engine.dtype}")
        if engine.device not in ("auto", "cpu") or (engine.device == "auto" and torch.cuda.is_available()):
            raise ConfigError(
                "device",
                "DeepSeek-V4.1 runs on the CPU only (its Engram tables are host-mapped): pass device='cpu'",
            )

    def configure(self, engine: EngineConfig) -> None:
        """YoCo's bounded replay: `forward` keeps each prompt's last yoco_prefill_keep_tokens."""
        compact = engine.yoco_prefill_truncation == "compact"
        self.replay_keep = engine.yoco_prefill_keep_tokens if compact else None

    def cache_declarations(self) -> list[CacheDecl]:
        return cache_declarations(self.arch)

    def cache_groups(self, dtype: torch.dtype, owner: str = "target") -> list[CacheGroup]:
        """The kept state as engine cache groups (model/deepseek_v4/model.py's `group_declarations`)."""
        return v4_cache_groups(self.cache_declarations(), dtype, owner)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # the tensors of cache_groups(), in order
        meta: ForwardMetadata,  # one AttentionMetadata per cache group
        backend: AttentionBackend,  # unused: the model reads its groups itself (OwnAttention)
        features: dict[int, torch.Tensor] | None = None,  # DSpark's target features (forward_cached)
        image_mask: torch.Tensor | None = None,  # [T] bool: rows that are image tokens (None: all text)
        image_embeds: torch.Tensor | None = None,  # [image_mask.sum(), hidden], in row order
    ) -> torch.Tensor:  # final hidden [T, hidden], normed
        layout = step_layout(meta)
        tensors = paged_tensors(self.cache_declarations(), kv_caches)
        replay = None
        if self.replay_keep is not None:
            # The floor comes from the prompt's length, not the sequence's: a recompute after
            # preemption repeats the rows and windows of the first run.
            floors = prompt_floors(layout, tuple(meta.prompt_lens), self.replay_keep)
            if any(floors):
                replay = BoundedReplay.plan(layout, floors, input_ids.device)
        return self.forward_cached(
            input_ids,
            positions,
            layout,
            PagedV41Step(self.arch, tensors, meta, layout),
            features,
            replay=replay,
            image_mask=image_mask,
            image_embeds=image_embeds,
        )

    def embed_images(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """patches [P, 3, 14, 14] of images end to end, each image's (rows, cols) of patches ->
        their token embeddings [sum of image_token_count, hidden] (start, rows + newline, end)."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower")
        return self.vision.embed_patches(patches, [PatchGrid(rows, cols) for rows, cols in grids])

    # -- the language model --------------------------------------------------------------------

    def forward_cached(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], consecutive from each sequence's start in the layout
        layout: StepLayout,
        step: V41StepView,
        features: dict[int, torch.Tensor] | None = None,
        replay: BoundedReplay | None = None,
        *,
        image_mask: torch.Tensor | None = None,  # [T] bool, None: all text
        image_embeds: torch.Tensor | None = None,  # [image_mask.sum(), hidden]
    ) -> torch.Tensor:  # final hidden [T, hidden], normed
        """`features`, when given, receives DSpark's target features: for each of
        `arch.dspark.target_layer_ids`, the mean of the streams entering its attention [T, hidden].
        `replay` (model/deepseek_v4/yoco.py, planned for this layout) is YoCo's bounded replay: the layers
        from the boundary on run only its kept rows, their windows clipped to its floors; the
        rows they skip come back NaN, in the hidden and in the features of those layers.
        `image_embeds` replace the token embeddings of the rows `image_mask` marks (the vision
        tower's output for them); the MoE routes those rows with `bias_vl`, Engram skips them and
        cuts the n-grams at them, and the sequences keep them as Engram's image sentinel so a
        later chunk's n-grams are cut as in one whole pass."""
        if replay is not None and self.arch.yoco_boundary is None:
            raise ValueError("bounded replay needs a YoCo model: this one has no YoCo boundary")
        if image_mask is not None and (image_mask.dtype != torch.bool or image_mask.shape != input_ids.shape):
            raise ValueError(
                f"image_mask must be bool of the tokens' shape {tuple(input_ids.shape)}, "
                f"not {image_mask.dtype} {tuple(image_mask.shape)}"
            )
        runs = [torch.arange(s, s + n) for s, n in zip(layout.starts, layout.query_lens, strict=True)]
        if not torch.equal(positions.cpu(), torch.cat(runs) if runs else positions.cpu()[:0]):
            raise ValueError("positions must run consecutively from each sequence's start in the step layout")
        # Engram's token ids: image positions as its sentinel, read now and kept for later chunks.
        kept_ids = with_image_sentinels(input_ids, image_mask)  # [T]
        ngrams = None
        if self.hashing is not None:
            context = self.hashing.context([step.context(seq) for seq in range(len(layout.starts))])
            ngrams = self.hashing.windows(kept_ids.cpu(), torch.tensor(layout.query_lens), context)
        embeds = F.embedding(input_ids, self.embed)  # [T, hidden]
        if image_mask is not None and image_embeds is not None:
            embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), image_embeds.to(embeds.dtype))
        streams = embeds.unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        pre = HyperConnection.first_pre(input_ids.shape[0], self.arch.hc_mult, input_ids.device)
        shared = CrossLayer()
        ids = input_ids
        for layer in self.layers:
            if replay is not None and layer.captures_shared_hidden:
                shared.replay = replay  # the boundary block switches to the kept rows
            streams, pre = layer(
                streams, pre, ids, positions, layout, step, shared, ngrams, features, image_mask
            )
            if replay is not None and layer.captures_shared_hidden:
                ids, positions, layout, ngrams, image_mask = (
                    replay.keep(ids),
                    replay.positions,
                    replay.layout,
                    replay.keep(ngrams),
                    replay.keep(image_mask),
                )
        step.finish(kept_ids)
        hidden = self.norm(
            HyperConnection.collapse(streams, pre) if self.hc_head is None else self.hc_head(streams)
        )
        if replay is None:
            return hidden
        if features is not None:  # the boundary's own feature is taken before it drops rows
            for index in features:
                if index > self.arch.yoco_boundary:
                    features[index] = replay.spread(features[index])
        return replay.spread(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab]."""
        return F.linear(hidden, self.head)

    # -- weights -------------------------------------------------------------------------------

    def _load(self, weights: V41Weights) -> None:
        """HF names onto the modules: a name is a parameter's path, or its path with `.weight`
        dropped where the module keeps a bare parameter; experts are stacked, the shared
        expert's gate and up rows fused; Engram layers get their module; the image embeddings are
        not used without a vision model. DSpark's (`mtp.*`) tensors are not loaded. The buffers
        (the routers' `bias_vl`) are filled as the parameters are."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        filled: set[str] = set()
        arch = self.arch
        for name, value in weights.tensors.items():
            if name.startswith("mtp.") or name.startswith("image_"):
                continue
            if ".engram." in name:
                continue
            target = _target(name)
            if target is None:
                self._load_expert(name, value, params, filled)
                continue
            if target not in params:
                target = target.removesuffix(".weight")
            if target not in params or params[target].shape != value.shape:
                raise ValueError(
                    f"{name}: no parameter of shape {tuple(value.shape)} for it in the V4.1 model"
                )
            params[target].data = value.float()
            filled.add(target)
        for layer in arch.engram.layer_ids if arch.engram is not None else ():
            self.layers[layer].engram = Engram.from_weights(
                arch, layer, self.hashing, weights.tensors, weights.engram_tables[layer]
            )
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"parameters not in the checkpoint: {missing[:8]}")

    def _load_expert(
        self, name: str, value: torch.Tensor, params: dict[str, torch.nn.Parameter], filled: set[str]
    ) -> None:
        """`layers.L.ffn.experts.E.wN.weight` into the stacked w13 / w2, and the shared expert's
        w1 / w3 / w2 into gate_up_proj / down_proj (w1: gate rows, w3: up rows)."""
        parts = name.split(".")
        prefix = ".".join(parts[:3])  # layers.L.ffn
        which = parts[-2]
        if parts[3] == "experts":
            expert = int(parts[4])
            w13, w2 = params[prefix + ".experts.w13"], params[prefix + ".experts.w2"]
            inter = w2.shape[2]
            if which == "w2":
                w2.data[expert] = value
            else:
                rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
                w13.data[expert, rows] = value
            filled.update((prefix + ".experts.w13", prefix + ".experts.w2"))
            return
        gate_up, down = (
            params[prefix + ".shared_experts.gate_up_proj"],
            params[prefix + ".shared_experts.down_proj"],
        )
        inter = down.shape[1]
        if which == "w2":
            down.data.copy_(value)
        else:
            gate_up.data[slice(0, inter) if which == "w1" else slice(inter, 2 * inter)] = value
        filled.update((prefix + ".shared_experts.gate_up_proj", prefix + ".shared_experts.down_proj"))


def _target(name: str) -> str | None:
    """HF name -> parameter path (None: an expert weight, loaded by stacking)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[2] == "ffn" and parts[3] in ("experts", "shared_experts"):
        return None
    for kind in ("attn", "ffn", "head"):
        for field in ("fn", "base", "scale"):
            hf = f"hc_{kind}_{field}"
            if name == hf or name.endswith("." + hf):
                return name.removesuffix(hf) + f"hc_{kind}.{field}"
    return name
