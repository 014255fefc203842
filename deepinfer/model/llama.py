"""The Llama family in plain PyTorch: Llama 2/3, SmolLM2, Qwen2 (QKV bias), Qwen3 (QK-norm).

Weights use HF names; q/k/v and gate/up are fused into one matmul each at load time, because on
a CPU one wide GEMM is markedly faster than three narrow ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.kernels.gguf_blocks import PackedMatrix
from deepinfer.model.base import CausalLM, KVCacheSpec
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers.gguf_linear import GGUFEmbedding, GGUFLinear, norm_then_project, packed_linear
from deepinfer.model.layers.int8_linear import Int8Linear, quantize_linears_
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.rotary import RotaryEmbedding
from deepinfer.model.registry import register_model


def _linear(rows: int, cols: int, bias: bool = False) -> torch.nn.Linear:
    layer = torch.nn.Linear(cols, rows, bias=bias)
    layer.requires_grad_(False)
    return layer


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = _linear(self.q_size + 2 * self.kv_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.o_proj = _linear(cfg.hidden_size, self.q_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """qkv: qkv_proj of the normed input, [T, (H + 2 KVH) D] (the layer computes it, so that
        the norm can be fused into the projection). Returns the o_proj output [T, hidden]."""
        num_tokens = qkv.shape[0]
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = qkv.view(num_tokens, heads, self.head_dim)  # [T, H + 2 KVH, D]
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1
            )
        self.rotary.apply_(positions, qk)  # q and k heads rotated together, in place
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = backend.forward(q, k, v, cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = _linear(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: gate_up_proj of the normed input [T, 2 I] (computed by the layer, like qkv)."""
        if isinstance(self.down_proj, GGUFLinear) and gate_up.dim() == 2 and gate_up.dtype is torch.float32:
            return self.down_proj.forward_swiglu(gate_up)  # SwiGLU in the kernel's activation pass
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_then_project(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        h = self.self_attn(qkv, positions, cache, meta, backend)
        gate_up, residual = norm_then_project(
            self.post_attention_layernorm, self.mlp.gate_up_proj, h, residual
        )
        return self.mlp(gate_up), residual


@register_model("llama", "qwen2", "qwen3", "mistral", "smollm")
class LlamaForCausalLM(CausalLM):
    supports_kv_cache_dtype = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.requires_grad_(False)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.vocab_size, cfg.hidden_size)

    @classmethod
    def from_config(cls, config: ModelConfig) -> LlamaForCausalLM:
        return cls(config)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        cfg = self.config
        return KVCacheSpec(cfg.num_layers, (2, cfg.num_kv_heads, cfg.head_dim), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, cache, meta, backend)
        h, _ = self.norm.add_forward(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def quantize(self, method: str) -> None:
        """int8: every projection and the LM head (a tied head gets its own int8 copy; the
        embedding lookup stays in float)."""
        if method != "int8":
            super().quantize(method)
        quantize_linears_(self.layers)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = Int8Linear(head)

    def use_packed_weights(self, packed: Mapping[str, PackedMatrix]) -> set[str]:
        """Every projection whose parts are all packed (q/k/v and gate/up as one group each), the
        embedding (looked up row by row) and the LM head, which for tied embeddings is the
        embedding's packed matrix itself."""
        used: set[str] = set()
        for i, layer in enumerate(self.layers):
            attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}."
            qkv = [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
            bias = self.config.attention_bias
            attn.qkv_proj = packed_linear(packed, qkv, bias, used) or attn.qkv_proj
            attn.o_proj = (
                packed_linear(packed, [f"{prefix}self_attn.o_proj.weight"], False, used) or attn.o_proj
            )
            gate_up = [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]
            mlp.gate_up_proj = packed_linear(packed, gate_up, False, used) or mlp.gate_up_proj
            mlp.down_proj = (
                packed_linear(packed, [f"{prefix}mlp.down_proj.weight"], False, used) or mlp.down_proj
            )
        embedding = packed.get("model.embed_tokens.weight")
        if embedding is not None:
            self.embed_tokens = GGUFEmbedding(embedding)
            used.add("model.embed_tokens.weight")
            if self.lm_head is None:
                self.lm_head = packed_linear({"tied": embedding}, ["tied"], False, set())
        if not self.config.tie_word_embeddings:
            self.lm_head = packed_linear(packed, ["lm_head.weight"], False, used) or self.lm_head
        return used

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up into their combined matrices."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
        fused |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        offsets = {"qkv_proj": [0, q, q + kv, q + 2 * kv], "gate_up_proj": [0, inter, 2 * inter]}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the checkpoint repeats the embedding
            if "rotary_emb" in name:
                continue
            target = name
            for part, (fused_name, index) in fused.items():
                if f".{part}." in name:
                    target = name.replace(part, fused_name)
                    lo, hi = offsets[fused_name][index], offsets[fused_name][index + 1]
                    params[target].data[lo:hi].copy_(tensor)
                    loaded.add(f"{target}[{index}]")
                    break
            else:
                if target not in params:
                    raise KeyError(f"unexpected weight {name!r} for {type(self).__name__}")
                params[target].data.copy_(tensor)
                loaded.add(target)
        expected = set()
        for pname, _ in self.named_parameters():
            base = pname.rsplit(".", 2)
            if len(base) == 3 and base[1] in offsets:
                expected |= {f"{pname}[{i}]" for i in range(len(offsets[base[1]]) - 1)}
            else:
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:8]}{'...' if len(missing) > 8 else ''}")
