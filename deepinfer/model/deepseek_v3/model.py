"""The DeepSeek-V3 family (V3, R1, V3.1, V3.2 with dense attention) and DeepSeek-V2, in plain PyTorch.

Multi-head Latent Attention caches one latent vector per token and layer (see
model/deepseek_v3/mla.py); DeepSeekMoE routes each token to a few experts (layers/moe.py); the
optional MTP modules draft the token after next for speculative decoding.

Checkpoints load from HF safetensors with the official tensor names, BF16/FP32 or FP8 with
128x128 block scales, dequantized at load, or, where `keep_fp8_weights` ran (the Triton path),
kept in FP8 for o_proj and the dense and shared-expert MLPs (layers/fp8_linear.py): the q and kv_a
projections (their rope rows reordered, their fused segments not tile-aligned in general), kv_b
(absorbed into MLA's attention) and the routed experts (the fused MoE kernel) stay dequantized.
At load time:
- q_a_proj and kv_a_proj_with_mqa become one matmul (both read the same hidden state);
- gate/up projections are fused, and routed experts are stacked into [E, ...] tensors;
- the rope rows of q and of the shared rope key are de-interleaved when the checkpoint uses
  DeepSeek's interleaved-pair rope (rope_interleave, the default), so the standard "rotate half"
  rope applies: the same pairs rotate by the same angles, only their storage order changes, and
  q·k is unchanged.

V3.2's DSA indexer is not run: attention is dense, which equals V3.2's sparse attention while the
context fits in index_topk (2048) tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata
from deepinfer.cache_layout import CacheGroup
from deepinfer.model.base import CausalLM, cache_tensor
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v3.mla import MLAStepMetadata, mla_attention
from deepinfer.model.layers.fp8 import FP8_DTYPES, SCALE_SUFFIX, weight_block_size
from deepinfer.model.layers.fp8_linear import Fp8BlockLinear, keep_block_fp8, linear
from deepinfer.model.layers.mlp import GatedMLP
from deepinfer.model.layers.moe import DeepseekMoE, RouterConfig
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.parallel_linear import Segment, VocabParallelEmbedding, vocab_segments
from deepinfer.model.layers.rotary import RotaryEmbedding, yarn_get_mscale
from deepinfer.model.loader.scaled import dequantize_checkpoint
from deepinfer.model.loader.weights import NameMap, Target, WeightLoader
from deepinfer.model.parallel import SINGLE, ModelParallel, TensorParallel

log = logging.getLogger(__name__)

# The official and HF implementations give the q/kv latent norms a fixed eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


@dataclass(slots=True, frozen=True)
class DeepseekArch:
    """The DeepSeek-specific part of config.json, validated."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: RouterConfig | None  # None: every layer is dense
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_interleave: bool
    max_position_embeddings: int
    num_mtp_layers: int
    tie_word_embeddings: bool
    fp8_block: tuple[int, int]

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> DeepseekArch:
        raw = cfg.raw
        if raw.get("attention_bias"):
            raise ValueError(
                "attention_bias=true is not supported for DeepSeek models (no checkpoint uses it)"
            )
        quant = raw.get("quantization_config")
        if quant and quant.get("quant_method", "fp8") != "fp8":
            raise ValueError(
                f"quantization_config.quant_method={quant.get('quant_method')!r} is not supported; "
                "only DeepSeek's block FP8 ('fp8') is"
            )
        is_v2 = cfg.model_type == "deepseek_v2"
        num_experts = raw.get("n_routed_experts")
        router = None
        if num_experts:
            router = RouterConfig(
                num_experts=int(num_experts),
                top_k=_required(raw, "num_experts_per_tok"),
                num_groups=int(raw.get("n_group") or 1),
                topk_groups=int(raw.get("topk_group") or 1),
                scoring=raw.get("scoring_func") or ("softmax" if is_v2 else "sigmoid"),
                topk_method=raw.get("topk_method") or ("greedy" if is_v2 else "noaux_tc"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", not is_v2)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            )
        return cls(
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=_required(raw, "kv_lora_rank"),
            qk_nope_head_dim=_required(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_required(raw, "qk_rope_head_dim"),
            v_head_dim=_required(raw, "v_head_dim"),
            intermediate_size=cfg.intermediate_size,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or cfg.intermediate_size),
            num_shared_experts=int(raw.get("n_shared_experts") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            router=router,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=_yarn_scaling(cfg),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            max_position_embeddings=cfg.max_position_embeddings,
            num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=cfg.tie_word_embeddings,
            fp8_block=weight_block_size(raw),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the KV latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.router is not None
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN: the long-context
        attention temperature correction of DeepSeek's YaRN."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            mscale = yarn_get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale *= mscale * mscale
        return scale


def _required(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json: {key!r} is required for DeepSeek models")
    return int(raw[key])


def _yarn_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """rope_scaling with YaRN's `factor` and cos/sin `attention_factor` made explicit, computed
    from factor, mscale and mscale_all_dim the way HF transformers' DeepSeek models do."""
    scaling = cfg.rope_scaling
    if not scaling or scaling.get("rope_type") != "yarn":
        return scaling
    scaling = dict(scaling)
    if scaling.get("factor") is None:
        scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    if scaling.get("attention_factor") is None:
        factor, mscale, mscale_all_dim = (
            scaling["factor"],
            scaling.get("mscale"),
            scaling.get("mscale_all_dim"),
        )
        if mscale and mscale_all_dim:
            scaling["attention_factor"] = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            scaling["attention_factor"] = yarn_get_mscale(factor)
    return scaling


class MLAttention(torch.nn.Module):
    """Under tensor parallelism a rank holds its heads' rows of q_b / kv_b and columns of o_proj;
    the latent projection and norm, and so the latent cache, are the same on every rank."""

    def __init__(self, arch: DeepseekArch, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        if arch.num_heads < tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} exceeds the model's {arch.num_heads} attention heads"
            )
        q_heads = Segment.even(arch.num_heads * arch.qk_head_dim, tp, arch.qk_head_dim)
        self.num_heads = q_heads.local // arch.qk_head_dim  # this rank's heads
        kv_heads = Segment.even(
            arch.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim),
            tp,
            arch.qk_nope_head_dim + arch.v_head_dim,
        )
        o_columns = Segment.even(arch.num_heads * arch.v_head_dim, tp, arch.v_head_dim)
        q_down = Segment.whole(arch.q_lora_rank) if arch.q_lora_rank else q_heads
        self.q_size = q_down.local
        # One matmul for the two projections of the hidden state: q (or q's LoRA down) and the KV latent.
        self.q_kv_a_proj = _param(self.q_size + arch.latent_dim, arch.hidden_size)
        self.splits: dict[str, tuple[int, list[Segment]]] = {
            "q_kv_a_proj": (0, [q_down, Segment.whole(arch.latent_dim)]),
            "kv_b_proj": (0, [kv_heads]),
            "o_proj": (1, [o_columns]),
        }
        if arch.q_lora_rank:
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = _param(q_heads.local, arch.q_lora_rank)
            self.splits["q_b_proj"] = (0, [q_heads])
        self.kv_a_layernorm = RMSNorm(arch.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = _param(kv_heads.local, arch.kv_lora_rank)
        self.o_proj = _param(arch.hidden_size, o_columns.local)
        self.rotary = rotary
        self.scale = arch.softmax_scale

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        step: MLAStepMetadata,
    ) -> torch.Tensor:
        arch = self.arch
        q, kv_a = F.linear(x, self.q_kv_a_proj).split([self.q_size, arch.latent_dim], dim=-1)
        if arch.q_lora_rank:
            q = F.linear(self.q_a_layernorm(q), self.q_b_proj)
        q_nope, q_rope = q.unflatten(-1, (self.num_heads, arch.qk_head_dim)).split(
            [arch.qk_nope_head_dim, arch.qk_rope_head_dim], dim=-1
        )
        latent, k_rope = kv_a.split([arch.kv_lora_rank, arch.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope.unsqueeze(1))
        out = mla_attention(
            q_nope,
            q_rope,
            latent,
            k_rope.squeeze(1),
            cache,
            self.kv_b_proj,
            arch.v_head_dim,
            meta,
            step,
            self.scale,
        )  # [T, H, v]
        return self.tp.all_reduce(linear(out.flatten(1), self.o_proj))  # o_proj may be kept in FP8


class DeepseekDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        arch: DeepseekArch,
        layer_idx: int,
        rotary: RotaryEmbedding,
        parallel: ModelParallel | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ModelParallel()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = MLAttention(arch, rotary, parallel.tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.is_moe_layer(layer_idx):
            assert arch.router is not None
            self.mlp: torch.nn.Module = DeepseekMoE(
                arch.hidden_size,
                arch.moe_intermediate_size,
                arch.num_shared_experts,
                arch.router,
                parallel.tp,
                parallel.ep,
            )
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, parallel.tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        step: MLAStepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, cache, meta, step)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        if isinstance(self.mlp, DeepseekMoE):
            return self.mlp(h, fused=step.triton), residual
        return self.mlp(h), residual


class SharedHead(torch.nn.Module):
    def __init__(self, arch: DeepseekArch) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # The official checkpoints repeat the main lm_head here; None: use the main model's.
        self.head: torch.nn.Parameter | None = _param(arch.vocab_size, arch.hidden_size)


class MTPLayer(torch.nn.Module):
    """One multi-token-prediction module (checkpoint layer num_hidden_layers + depth)."""

    def __init__(self, arch: DeepseekArch, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.eh_proj = _param(arch.hidden_size, 2 * arch.hidden_size)
        self.block = DeepseekDecoderLayer(arch, layer_idx, rotary)
        self.shared_head = SharedHead(arch)


class DeepseekV3ForCausalLM(CausalLM):
    """forward/compute_logits serve the main model; mtp_draft_logits runs an MTP module.

    MTP (speculative decoding): the module at depth d reads, for each position i, the hidden state
    h_i (depth 0: the main model's output at i, as returned by `forward`; depth d > 0: the hidden
    returned by depth d - 1) and the embedding of token t_{i+1}, and predicts t_{i+2+d}. It has its
    own latent cache per depth (`mtp_kv_cache_spec`), addressed with the same slots and block
    tables as the main model: MTP position i lives in the slot of position i.
    """

    def __init__(self, cfg: ModelConfig, parallel: ModelParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        parallel = parallel or ModelParallel()
        self.arch = arch = DeepseekArch.from_model_config(cfg)
        if not parallel.is_single and arch.num_mtp_layers:
            # Speculative decoding is not run over several ranks: the MTP weights are not loaded.
            self.arch = arch = dataclasses.replace(arch, num_mtp_layers=0)
        self.tp = parallel.tp
        rotary = RotaryEmbedding(
            arch.qk_rope_head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel.tp)
        self.layers = torch.nn.ModuleList(
            DeepseekDecoderLayer(arch, i, rotary, parallel) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        vocab_rows, self.vocab_sizes = vocab_segments(arch.vocab_size, parallel.tp)
        self.lm_head = None if arch.tie_word_embeddings else _param(vocab_rows.local, arch.hidden_size)
        self.splits: dict[str, tuple[int, list[Segment]]] = {"lm_head": (0, [vocab_rows])}
        self.mtp = torch.nn.ModuleList(
            MTPLayer(arch, arch.num_layers + i, rotary) for i in range(arch.num_mtp_layers)
        )

    @classmethod
    def from_config(cls, config: ModelConfig, parallel: ModelParallel | None = None) -> DeepseekV3ForCausalLM:
        return cls(config, parallel)

    def expert_layers(self) -> list[torch.nn.Module]:
        return [
            layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, DeepseekMoE) and layer.mlp.ep
        ]

    def cache_groups(self, dtype: torch.dtype, owner: str = "target") -> list[CacheGroup]:
        latent = (self.arch.latent_dim,)
        tensors = tuple(
            cache_tensor(f"layers.{i}.latent", latent, dtype, owner) for i in range(self.arch.num_layers)
        )
        return [CacheGroup("full", tensors)]

    # -- main model ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        forward_meta: ForwardMetadata,
        backend: AttentionBackend
        | None,  # MLA reads and writes its latent cache itself (its name: which kernel)
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        [meta] = forward_meta.groups
        step = MLAStepMetadata.build(meta, triton=backend is not None and backend.name == "triton")
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, cache, meta, step)
        h, _ = self.norm.add_forward(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.embed_tokens.logits(hidden)
        return self.tp.gather_last_dim(F.linear(hidden, self.lm_head), self.vocab_sizes)

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    # -- multi-token prediction ----------------------------------------------------------------

    @property
    def num_mtp_layers(self) -> int:
        """MTP modules loaded (0 when the config has none or the checkpoint omits their weights)."""
        return len(self.mtp)

    def mtp_cache_groups(self, dtype: torch.dtype) -> list[CacheGroup]:
        """The MTP modules' latent caches (one tensor per depth), sharing the main model's block
        tables; empty without MTP weights."""
        latent = (self.arch.latent_dim,)
        tensors = tuple(cache_tensor(f"mtp.{d}.latent", latent, dtype, "mtp") for d in range(len(self.mtp)))
        return [CacheGroup("full", tensors)] if tensors else []

    def mtp_draft_logits(
        self,
        next_token_ids: torch.Tensor,  # [T] token at position i + 1 (+ depth) for each row
        positions: torch.Tensor,  # [T] position i of each row
        previous_hidden: torch.Tensor,  # [T, hidden] h_i from the main model (or the previous depth)
        kv_cache: torch.Tensor,  # this depth's MTP cache [num_slots, latent_dim]
        forward_meta: ForwardMetadata,  # rows laid out and cached like a main-model step
        depth: int = 0,
        logits_rows: torch.Tensor | None = None,  # rows to compute logits for (default: all)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [N, vocab] for the token after next, and the hidden [T, hidden] of every row
        (the `previous_hidden` of depth + 1). Writes this step's rows into `kv_cache`."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"MTP depth {depth} out of range: the model has {len(self.mtp)} MTP modules")
        layer = self.mtp[depth]
        [meta] = forward_meta.groups
        step = MLAStepMetadata.build(meta)
        embeds = layer.enorm(self.embed_tokens(next_token_ids))
        x = F.linear(torch.cat([embeds, layer.hnorm(previous_hidden)], dim=-1), layer.eh_proj)
        h, residual = layer.block(x, None, positions, kv_cache, meta, step)
        hidden = h + residual
        rows = hidden if logits_rows is None else hidden[logits_rows]
        head = layer.shared_head.head if layer.shared_head.head is not None else self._lm_head_weight()
        return F.linear(layer.shared_head.norm(rows), head), hidden

    # -- weights -------------------------------------------------------------------------------

    def keep_fp8_weights(self) -> list[str]:
        """For an FP8 checkpoint on one rank, make o_proj and the dense and shared-expert MLP
        projections Fp8BlockLinears (those whose tiles fit, see keep_block_fp8), so that their
        weights load and stay FP8; returns the parameters kept. Call before load_weights."""
        if not self.config.raw.get("quantization_config") or self.tp.size > 1:
            return []
        kept = []
        for name, module in list(self.named_modules()):  # replaced while walked: a copy
            for kind, params in _KEPT_FP8:
                if isinstance(module, kind):
                    kept += [f"{name}.{p}" for p in params if keep_block_fp8(module, p, self.arch.fp8_block)]
        return kept

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load official HF names (FP8 block-quantized weights are dequantized on the way, but
        those of layers kept in FP8)."""
        names = _DeepseekNames(self.arch)
        loader = WeightLoader(self, names)

        def kept(name: str) -> bool:
            target = names.route(loader, name, names.key(name))
            return target is not None and loader.params[target.param].dtype in FP8_DTYPES

        loader.load_all(dequantize_checkpoint(weights, self.arch.fp8_block, kept))
        loader.drop_if_unloaded("mtp", "no MTP weights in the checkpoint: multi-token prediction disabled")
        for depth, layer in enumerate(self.mtp):
            if not loader.filled[f"mtp.{depth}.shared_head.head"]:
                layer.shared_head.head = None  # the checkpoint relies on the shared main lm_head
        loader.finish()


# The plain weights of V3 that may be kept in FP8, by module (see DeepseekV3ForCausalLM.keep_fp8_weights).
_KEPT_FP8: tuple[tuple[type[torch.nn.Module], tuple[str, ...]], ...] = (
    (MLAttention, ("o_proj",)),
    (GatedMLP, ("gate_up_proj", "down_proj")),
)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED_HALVES = {"gate_proj": 0, "up_proj": 1}
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class _DeepseekNames(NameMap):
    """Official HF names onto DeepseekV3ForCausalLM: q_a / kv_a as the two segments of q_kv_a_proj,
    gate / up as the halves of gate_up_proj (experts stacked), MTP layers after the backbone."""

    missing_error = KeyError

    def __init__(self, arch: DeepseekArch) -> None:
        self.arch = arch
        self.skipped_indexer = False

    def keeps_float32(self, param: str) -> bool:
        return param.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))  # routing decisions

    def route(self, loader: WeightLoader, name: str, key: str) -> Target | None:
        if name.endswith(SCALE_SUFFIX):  # passed through only for a weight kept in FP8
            owner = name.removesuffix(SCALE_SUFFIX)
            return _scale_target(loader, name, self._route(loader, owner, self.key(owner)))
        target = self._route(loader, name, key)
        if target is not None and loader.params[target.param].dtype in FP8_DTYPES:
            return dataclasses.replace(target, transform=_stored_fp8(name))
        return target

    def _route(self, loader: WeightLoader, name: str, key: str) -> Target | None:
        arch = self.arch
        if "rotary_emb." in name:
            return None
        short = name.removeprefix("model.")
        if short in ("embed_tokens.weight", "norm.weight"):
            return Target(short)
        if short == "lm_head.weight":
            return None if loader.model.lm_head is None else Target("lm_head")
        match = _LAYER_NAME.fullmatch(short)
        if match is None:
            raise KeyError(f"unexpected weight {name!r} for a DeepSeek model")
        layer_idx, rest = int(match.group(1)), match.group(2)
        if layer_idx < arch.num_layers:
            prefix = f"layers.{layer_idx}."
        elif layer_idx < arch.num_layers + arch.num_mtp_layers:
            depth = layer_idx - arch.num_layers
            if rest == "embed_tokens.weight":
                return None  # MTP shares the main model's embedding
            if rest.startswith(_MTP_OWN):
                return _generic(loader, name, f"mtp.{depth}.{rest}")
            prefix = f"mtp.{depth}.block."
        elif arch.num_mtp_layers == 0:
            return None  # MTP modules present but disabled by the config (num_nextn_predict_layers=0)
        else:
            raise KeyError(
                f"unexpected weight {name!r}: layer {layer_idx} is beyond num_hidden_layers={arch.num_layers} "
                f"+ num_nextn_predict_layers={arch.num_mtp_layers}"
            )
        return self._layer(loader, name, prefix, rest)

    def _layer(self, loader: WeightLoader, name: str, prefix: str, rest: str) -> Target | None:
        arch = self.arch
        if rest.startswith("self_attn.indexer."):
            if not self.skipped_indexer:
                log.warning("DSA indexer weights skipped: attention is dense (exact up to index_topk tokens)")
                self.skipped_indexer = True
            return None
        q_kv_a = prefix + "self_attn.q_kv_a_proj"
        if rest == "self_attn.q_a_proj.weight":
            return Target(q_kv_a, loader.segment_rows(q_kv_a, 0))
        if rest == "self_attn.q_proj.weight":
            return Target(q_kv_a, loader.segment_rows(q_kv_a, 0), self._rope_rows(arch.qk_head_dim))
        if rest == "self_attn.kv_a_proj_with_mqa.weight":
            return Target(q_kv_a, loader.segment_rows(q_kv_a, 1), self._rope_rows(arch.latent_dim))
        if rest == "self_attn.q_b_proj.weight":
            return Target(prefix + "self_attn.q_b_proj", None, self._rope_rows(arch.qk_head_dim))
        expert = _EXPERT_NAME.fullmatch(rest)
        if expert is not None:
            index, kind = int(expert.group(1)), expert.group(2)
            if kind == "down_proj":
                return Target(prefix + "mlp.experts.w2", index)
            half = arch.moe_intermediate_size
            offset = _FUSED_HALVES[kind] * half
            return Target(prefix + "mlp.experts.w13", (index, slice(offset, offset + half)))
        module, _, kind = rest.rpartition(".")
        module, _, proj = module.rpartition(".")
        if kind == "weight" and proj in _FUSED_HALVES and module in ("mlp", "mlp.shared_experts"):
            fused = f"{prefix}{module}.gate_up_proj"
            fused += ".weight" if f"{fused}.weight" in loader.params else ""  # kept in FP8
            if fused not in loader.params:
                raise KeyError(f"unexpected weight {name!r}")
            return Target(fused, loader.segment_rows(fused, _FUSED_HALVES[proj]))
        return _generic(loader, name, prefix + rest)

    def _rope_rows(self, head_rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Reorder the rope rows at the end of every `head_rows` block from interleaved pairs
        (x0, x1), (x2, x3), ... to halves (x0, x2, ...), (x1, x3, ...)."""
        rope = self.arch.qk_rope_head_dim
        if not self.arch.rope_interleave:
            return None
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])

        def reorder(weight: torch.Tensor) -> torch.Tensor:
            blocks = weight.reshape(-1, head_rows, weight.shape[-1])
            nope, rope_rows = blocks[:, : head_rows - rope], blocks[:, head_rows - rope :]
            return torch.cat([nope, rope_rows[:, order]], dim=1).reshape(weight.shape)

        return reorder


def _stored_fp8(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A weight bound for a layer kept in FP8 must be stored in FP8 (not cast into it)."""

    def check(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in FP8_DTYPES:
            raise ValueError(f"weight {name!r} is stored as {tensor.dtype}, but its layer keeps FP8 weights")
        return tensor

    return check


def _scale_target(loader: WeightLoader, name: str, weight: Target | None) -> Target:
    """The scale of a weight kept in FP8 goes to its Fp8BlockLinear's `scale`, at the scale rows
    of the weight's rows (fused segments start on a tile: keep_block_fp8)."""
    module_name = "" if weight is None else weight.param.removesuffix(".weight")
    module = loader.model.get_submodule(module_name) if module_name else None
    if weight is None or not isinstance(module, Fp8BlockLinear):
        raise KeyError(f"unexpected scale {name!r}: its weight is not kept in FP8")
    rows = weight.index
    if isinstance(rows, slice):
        block = module.block[0]
        rows = slice(rows.start // block, -(-rows.stop // block))
    return Target(f"{module_name}.scale", rows)


def _generic(loader: WeightLoader, name: str, target: str) -> Target:
    """Norm weights keep their name; plain matrices are stored without the `.weight` suffix."""
    unexpected = KeyError(f"unexpected weight {name!r} for this DeepSeek config")
    return loader.candidate((target, target.removesuffix(".weight")), unexpected)
