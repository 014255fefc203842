"""The Llama family in plain PyTorch: Llama 2/3, SmolLM2, Qwen2 (QKV bias), Qwen3 (QK-norm).

Weights use HF names; q/k/v and gate/up are fused into one matmul each at load time, because on
a CPU one wide GEMM is markedly faster than three narrow ones. Under tensor parallelism every
rank holds its KV heads (and the query heads that read them), its share of the MLP and of the
vocabulary (layers/parallel_linear.py); the heads split unevenly when the group does not divide
them (SmolLM2's 3 KV heads over 2 ranks: 2 and 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch
import torch.nn.functional as F

from deepinfer.attention.backend import AttentionBackend
from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.attention.float32_boundary import Float32Boundary
from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata
from deepinfer.cache_layout import CacheGroup
from deepinfer.kernels.bf16_layers import Bf16Stack
from deepinfer.kernels.bf16_matmul import Bf16Kernels, fits
from deepinfer.kernels.decode_layers import DecodeStack
from deepinfer.kernels.gguf_blocks import PackedMatrix
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.model.base import CausalLM, cache_tensor
from deepinfer.model.config import ModelConfig
from deepinfer.model.layers.bf16_linear import Bf16Linear, use_bf16_kernels_
from deepinfer.model.layers.gguf_linear import (
    GGUFEmbedding,
    GGUFLinear,
    KernelLayouts,
    norm_then_project,
    packed_linear,
)
from deepinfer.model.layers.int8_linear import Int8Linear, quantize_linears_
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Segment,
    VocabParallelEmbedding,
    head_segments,
)
from deepinfer.model.layers.rotary import RotaryEmbedding
from deepinfer.model.llama.bf16_decode import build_bf16_stack
from deepinfer.model.llama.gguf_decode import build_decode_stack
from deepinfer.model.llama.stack_step import caches_fit, step_rows
from deepinfer.model.loader.weights import NameMap, Target, WeightLoader
from deepinfer.model.parallel import SINGLE, ModelParallel, TensorParallel


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        q_rows, kv_rows = head_segments(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
        self.head_dim = cfg.head_dim
        # This rank's heads (all of them in one process).
        self.num_heads, self.num_kv_heads = q_rows.local // cfg.head_dim, kv_rows.local // cfg.head_dim
        self.q_size = q_rows.local
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q_rows, kv_rows, kv_rows], bias=cfg.attention_bias
        )
        self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, tp)
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
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        columns = Segment.even(cfg.intermediate_size, tp)
        self.intermediate = columns.local
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [columns, columns])
        self.down_proj = RowParallelLinear(columns, cfg.hidden_size, tp)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: gate_up_proj of the normed input [T, 2 I] (computed by the layer, like qkv)."""
        if isinstance(self.down_proj, GGUFLinear) and gate_up.dim() == 2 and gate_up.dtype is torch.float32:
            return self.down_proj.forward_swiglu(gate_up)  # SwiGLU in the kernel's activation pass
        kernels = rowwise_kernels()
        if kernels is not None and gate_up.dim() == 2 and gate_up.dtype is torch.bfloat16 and gate_up.is_cpu:
            # in fp32, rounded once: the arithmetic kernels/bf16_layers.c runs for the whole stack
            return self.down_proj(kernels.swiglu_bf16(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

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


class LlamaForCausalLM(CausalLM):
    supports_kv_cache_dtype = True
    takes_rope_scaling = True
    cpu_bfloat16 = True
    captures_decode_graphs = True

    def __init__(self, cfg: ModelConfig, parallel: ModelParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        tp = self.tp = (parallel or ModelParallel()).tp
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: ParallelLMHead | None = (
            None if cfg.tie_word_embeddings else ParallelLMHead.empty(cfg.vocab_size, cfg.hidden_size, tp)
        )
        # Layers with the same window (None: full attention) share a cache group; groups in order
        # of first appearance, layers in order within their group.
        windows = cfg.layer_windows or [None] * cfg.num_layers
        self.group_windows: list[int | None] = list(dict.fromkeys(windows))
        self.layer_groups = [self.group_windows.index(w) for w in windows]
        order = sorted(range(cfg.num_layers), key=lambda i: (self.layer_groups[i], i))
        self.cache_index = [order.index(i) for i in range(cfg.num_layers)]  # layer -> flat cache tensor
        # Run every layer in one C call when a step allows it (tests turn it off to compare with
        # the layer-by-layer path). The stack: False until built on first use, None when the
        # model does not qualify.
        self.fused_decode = True
        self._decode_stack: DecodeStack | Bf16Stack | Literal[False] | None = False

    @classmethod
    def from_config(cls, config: ModelConfig, parallel: ModelParallel | None = None) -> LlamaForCausalLM:
        return cls(config, parallel)

    def attention_shape(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return attn.num_heads, attn.num_kv_heads, attn.head_dim

    def cache_groups(self, dtype: torch.dtype, owner: str = "target") -> list[CacheGroup]:
        cfg = self.config
        slot = (2, self.layers[0].self_attn.num_kv_heads, cfg.head_dim)  # K then V of this rank's heads
        groups = []
        for g, window in enumerate(self.group_windows):
            tensors = tuple(
                cache_tensor(f"layers.{i}.kv", slot, dtype, owner)
                for i in range(cfg.num_layers)
                if self.layer_groups[i] == g
            )
            groups.append(CacheGroup("full" if window is None else "sliding", tensors, window=window))
        return groups

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: ForwardMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        fused = self._fused_layers(h, positions, kv_caches, meta, backend)
        if fused is not None:
            h, residual = fused
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                cache, group = kv_caches[self.cache_index[i]], meta.groups[self.layer_groups[i]]
                h, residual = layer(h, residual, positions, cache, group, backend)
        h, _ = self.norm.add_forward(h, residual)
        return h

    def _fused_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: ForwardMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of every layer in one C call when the step and the model allow it
        (llama/gguf_decode.py: packed weights; llama/bf16_decode.py: bf16 kernel weights behind
        the fp32 attention boundary; decode-kernel rows); None otherwise."""
        if isinstance(backend, Float32Boundary):  # a bf16 model: the stack widens q/k/v itself
            backend = backend.inner
        if not self.fused_decode or not isinstance(backend, CpuPagedBackend):
            return None
        if self._decode_stack is False:  # not built yet (the packed weights are in place by now)
            self._decode_stack = build_decode_stack(self.layers, backend) or build_bf16_stack(
                self.layers, backend
            )
        stack = self._decode_stack
        rows = None if stack is None else step_rows(h, positions, meta, stack.dtype)
        caches = [kv_caches[i] for i in self.cache_index]
        if rows is None or not caches_fit(caches):
            return None
        return self._decode_stack.run(h, rows, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return self.embed_tokens.logits(hidden)
        return self.lm_head(hidden)

    def quantize(self, method: str) -> None:
        """int8: every projection and the LM head (a tied head gets its own int8 copy; the
        embedding lookup stays in float)."""
        if method != "int8":
            super().quantize(method)
        quantize_linears_(self.layers)
        if self.lm_head is None:
            embed = self.embed_tokens
            self.lm_head = ParallelLMHead(Int8Linear(embed.weight), embed.rows, embed.sizes, self.tp)
        else:
            self.lm_head.linear = Int8Linear(self.lm_head.linear.weight)

    def use_bf16_kernels(self, kernels: Bf16Kernels) -> bool:
        """Every bf16 projection and the LM head (a tied head gets its own packed copy; the
        embedding stays for the lookups)."""
        replaced = use_bf16_kernels_(self.layers, kernels)
        embed = self.embed_tokens
        if self.lm_head is None and fits(embed.weight):
            self.lm_head = ParallelLMHead(
                Bf16Linear(embed.weight, None, kernels), embed.rows, embed.sizes, self.tp
            )
            replaced += 1
        elif self.lm_head is not None:
            replaced += use_bf16_kernels_(self.lm_head, kernels)
        return replaced > 0

    def use_packed_weights(self, packed: Mapping[str, PackedMatrix]) -> set[str]:
        """Every projection whose parts are all packed (q/k/v and gate/up as one group each), the
        embedding (looked up row by row) and the LM head, which for tied embeddings is the
        embedding's packed matrix itself. Each is computed on in the kernels' interleaved layout."""
        packed = KernelLayouts(packed)
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
        """Load HF-named weights into this rank's part of every layer, fusing q/k/v and gate/up
        into their combined matrices (loader/weights.py)."""
        loader = WeightLoader(self, _LlamaNames(self))
        loader.load_all(weights)
        loader.finish()


# Checkpoint projections that are segments of a fused one: name -> (fused name, segment).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_FUSED |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class _LlamaNames(NameMap):
    """HF names (optionally under `model.`): the layers' own names, q/k/v and gate/up as segments
    of their fused projection; a split layer's inner linear takes its weight."""

    missing_error = KeyError

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.modules = dict(model.named_modules())

    def route(self, loader: WeightLoader, name: str, key: str) -> Target | None:
        short = name.removeprefix("model.")
        if short == "lm_head.weight" and loader.model.lm_head is None:
            return None  # tied: the checkpoint repeats the embedding
        if "rotary_emb" in short:
            return None
        module_name, _, kind = short.rpartition(".")
        parent, _, part = module_name.rpartition(".")
        unexpected = KeyError(f"unexpected weight {short!r} for {type(loader.model).__name__}")
        if part not in _FUSED:
            return loader.candidate((f"{module_name}.linear.{kind}", short), unexpected)
        fused, segment = _FUSED[part]
        module_name = f"{parent}.{fused}"
        module = self.modules.get(module_name)
        if isinstance(module, GGUFLinear) and (kind != "bias" or module.bias is None):
            raise KeyError(f"a packed GGUF projection takes only its bias from dense weights, not {kind!r}")
        inner = "" if isinstance(module, GGUFLinear) else "linear."
        param = loader.candidate((f"{module_name}.{inner}{kind}",), unexpected).param
        return Target(param, loader.segment_rows(param, segment))
