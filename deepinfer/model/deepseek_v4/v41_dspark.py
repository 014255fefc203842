"""DSpark, DeepSeek-V4.1's draft layers (`mtp.*`): a block of drafts filled at once from the
target's features and the last token, a rank-r Markov correction and a confidence head.

Context (the "main" keys): the target model hands, per token, the mean of the streams entering
the attention of each layer in `dspark.target_layer_ids` (concatenated, [n * hidden]). DSpark
projects them once (`main_proj`, then `main_norm`) and each draft layer turns the result into
its own key row (the layer's `wkv`, `kv_norm`, RoPE at the token's position); those rows are the
sliding-window part of that layer's attention. A draft block after a last token x at position p
attends the rows of positions p - W .. p - 1 (W the sliding window; positions below 0 are none).

Block: x at p followed by `num_drafts - 1` noise tokens at p + 1, ..., embedded with the target's
embedding and run through the draft layers as V4.1 blocks (mHC streams, sliding attention with
sink, DSpark's own MoE), except that the attention is non-causal: every block position sees the
context rows and every block position's own key (the keys of the block are computed from the
block itself, not from the target). Position j's hidden state (before the final norm) h_j gives
the draft of position p + j + 1:
    logits_j = head(norm(h_j)) + markov_head . markov_embed[t_j]   (Markov correction, rank r)
    confidence_j = sigmoid(w . [h_j, markov_embed[t_j]] / temperature)
where t_0 = x and t_j is draft j - 1, so the drafts are drawn in order (speculative/dspark.py)
but the block runs once. The confidence is DeepSeek's estimate that draft j is accepted; it
depends on the drafts before it, never on draft j itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.mhc import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.norm import Fp32RMSNorm
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.sparse import attend_with_sink
from deepinfer.model.deepseek_v4.v41_block_parts import v41_hyper_connections, v41_moe
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch, rope_specs
from deepinfer.model.deepseek_v4.v41_weights import expected_tensors

CONFIDENCE_CLAMP = 60.0  # DeepSeek clamps the scaled confidence logit (exp never overflows)


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape), requires_grad=False)


class DSparkAttention(torch.nn.Module):
    """V4.1's sliding attention (q LoRA, one K = V head, RoPE tail, sink, grouped output) over
    given context keys plus the whole block's own keys."""

    def __init__(self, arch: DeepseekV41Arch, rope: TrailingRope) -> None:
        super().__init__()
        self.arch, self.rope = arch, rope
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.wq_a = _param(arch.q_lora_rank, arch.hidden_size)
        self.q_norm = Fp32RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.wq_b = _param(arch.num_heads * arch.head_dim, arch.q_lora_rank)
        self.wkv = _param(arch.head_dim, arch.hidden_size)
        self.kv_norm = Fp32RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.wo_a = _param(arch.o_groups * arch.o_lora_rank, arch.num_heads // arch.o_groups * arch.head_dim)
        self.wo_b = _param(arch.hidden_size, arch.o_groups * arch.o_lora_rank)
        self.attn_sink = _param(arch.num_heads)
        self.scale = arch.head_dim**-0.5

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, hidden] at positions [N] -> key (= value) rows [N, head_dim]."""
        return self.rope(self.kv_norm(F.linear(x, self.wkv)), positions)

    def forward(
        self,
        x: torch.Tensor,  # [S * B, hidden] normed block inputs, sequence-major
        positions: torch.Tensor,  # [S * B]
        context: torch.Tensor,  # [S, W, head_dim] this layer's context keys
        visible: torch.Tensor,  # [S, W] bool: which context rows exist
    ) -> torch.Tensor:  # [S * B, hidden]
        seqs, block = context.shape[0], x.shape[0] // context.shape[0]
        q = F.linear(self.q_norm(F.linear(x, self.wq_a)), self.wq_b).view(-1, self.num_heads, self.head_dim)
        q = self.rope(q, positions).view(seqs, block, self.num_heads, self.head_dim)
        own = self.keys(x, positions).view(seqs, block, self.head_dim)
        keys = torch.cat((context, own), dim=1)  # [S, W + B, head_dim]
        seen = torch.cat((visible, visible.new_ones(seqs, block)), dim=1)  # non-causal in the block
        out = torch.stack(
            [
                attend_with_sink(q[s], keys[s], seen[s].expand(block, -1), self.attn_sink, self.scale)
                for s in range(seqs)
            ]
        ).flatten(0, 1)  # [S * B, H, D]
        out = self.rope(out, positions, inverse=True)
        return F.linear(self._grouped_down(out), self.wo_b)

    def _grouped_down(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H, D] -> [N, G * o_lora]: each group of heads has its own wo_a block."""
        groups = self.arch.o_groups
        grouped = out.reshape(out.shape[0], groups, self.wo_a.shape[1]).transpose(0, 1)
        weight = self.wo_a.view(groups, self.arch.o_lora_rank, -1).transpose(1, 2)
        return torch.bmm(grouped, weight).transpose(0, 1).flatten(1)


class DSparkLayer(torch.nn.Module):
    """One draft layer: a V4.1 block (shifted or plain mHC) around DSpark attention and MoE."""

    def __init__(self, arch: DeepseekV41Arch, rope: TrailingRope) -> None:
        super().__init__()
        eps, moe = arch.rms_norm_eps, arch.dspark.moe
        self.shifted = arch.hc_shifted
        self.attn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.attn = DSparkAttention(arch, rope)
        self.ffn_norm = Fp32RMSNorm(arch.hidden_size, eps)
        self.ffn = v41_moe(arch, moe)
        self.hc_attn, self.hc_ffn = v41_hyper_connections(arch)

    def forward(
        self,
        streams: torch.Tensor,  # [S * B, N, hidden]
        pre: torch.Tensor | None,  # [S * B, N] the previous layer's pre weights (shifted mHC)
        token_ids: torch.Tensor,  # [S * B]
        positions: torch.Tensor,  # [S * B]
        context: torch.Tensor,  # [S, W, head_dim]
        visible: torch.Tensor,  # [S, W]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        collapsed, post, comb, pre = self.hc_attn.mix(streams, pre, self.shifted)
        out = self.attn(self.attn_norm(collapsed), positions, context, visible)
        streams = HyperConnection.expand(streams, out, post, comb)
        collapsed, post, comb, pre = self.hc_ffn.mix(streams, pre, self.shifted)
        out = self.ffn(self.ffn_norm(collapsed), token_ids)
        return HyperConnection.expand(streams, out, post, comb), pre


class DSparkV41(torch.nn.Module):
    """The draft layers and heads; the embedding and LM head are the target's (stored once)."""

    def __init__(
        self,
        arch: DeepseekV41Arch,
        tensors: dict[str, torch.Tensor],
        embed: torch.Tensor,  # [vocab, hidden] the target's
        head: torch.Tensor,  # [vocab, hidden] the target's
        confidence_temperature: float | tuple[float, ...] = 1.0,
    ) -> None:
        """`tensors`: the checkpoint's (V41Weights.tensors: HF names, float32); the `mtp.*` ones
        are loaded, each missing or mis-shaped one an error naming it. `confidence_temperature`:
        DeepSeek's sigmoid temperature, one for all drafts or one per draft position."""
        super().__init__()
        spec = arch.dspark
        if spec.num_layers == 0:
            raise ValueError("num_nextn_predict_layers=0: the checkpoint has no DSpark layers")
        self.arch, self.spec = arch, spec
        hidden, vocab, rank = arch.hidden_size, arch.vocab_size, spec.markov_rank
        rope = TrailingRope(arch.rope_head_dim, rope_specs(arch)[0])  # DSpark layers: rope_theta
        self.main_proj = _param(hidden, len(spec.target_layer_ids) * hidden)
        self.main_norm = Fp32RMSNorm(hidden, arch.rms_norm_eps)
        self.layers = torch.nn.ModuleList(DSparkLayer(arch, rope) for _ in range(spec.num_layers))
        self.hc_head = (
            None if arch.hc_shifted else HyperHead(hidden, arch.hc_mult, arch.hc_eps, arch.rms_norm_eps)
        )
        self.norm = Fp32RMSNorm(hidden, arch.rms_norm_eps)
        self.markov_embed = _param(vocab, rank)
        self.markov_head = _param(vocab, rank)
        self.confidence_proj = _param(1, hidden + rank)
        self.embed, self.head = embed, head  # plain tensors: not this module's parameters
        temps = confidence_temperature
        if isinstance(temps, tuple) and len(temps) != spec.block_size:
            raise ValueError(
                f"confidence_temperature: {len(temps)} values for a block of {spec.block_size} drafts"
            )
        if min(temps if isinstance(temps, tuple) else (temps,)) <= 0:
            raise ValueError(f"confidence_temperature={temps}: must be positive")
        self.confidence_temperature = temps
        self._load(tensors)

    # -- context ---------------------------------------------------------------------------------

    def target_features(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target forward's `features` (layer -> [T, hidden]) -> [T, n * hidden], in the
        order of target_layer_ids (main_proj's input order)."""
        missing = [layer for layer in self.spec.target_layer_ids if layer not in features]
        if missing:
            raise ValueError(f"no target features of layers {missing}")
        return torch.cat([features[layer] for layer in self.spec.target_layer_ids], dim=-1)

    def context_keys(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features [..., n * hidden] at positions [...] -> every draft layer's key rows
        [L, ..., head_dim]."""
        shape = positions.shape
        main = self.main_norm(F.linear(features.reshape(-1, features.shape[-1]), self.main_proj))
        flat = positions.reshape(-1)
        return torch.stack([layer.attn.keys(main, flat).view(*shape, -1) for layer in self.layers])

    def window(self, last_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the context rows a block after a last token at last_positions [S] reads,
        [S, W] (p - W .. p - 1), and which exist (position >= 0)."""
        width = self.arch.sliding_window
        positions = last_positions.unsqueeze(1) - width + torch.arange(width, device=last_positions.device)
        return positions.clamp(min=0), positions >= 0

    # -- the block -------------------------------------------------------------------------------

    def block_hidden(
        self,
        last_tokens: torch.Tensor,  # [S]
        last_positions: torch.Tensor,  # [S]
        context: torch.Tensor,  # [L, S, W, head_dim] from context_keys
        visible: torch.Tensor,  # [S, W]
        num_drafts: int,
    ) -> torch.Tensor:  # [S, num_drafts, hidden] before the final norm
        seqs = last_tokens.shape[0]
        tokens = torch.full(
            (seqs, num_drafts), self.spec.noise_token_id, dtype=torch.long, device=last_tokens.device
        )
        tokens[:, 0] = last_tokens
        positions = (
            last_positions.unsqueeze(1) + torch.arange(num_drafts, device=last_positions.device)
        ).flatten()
        tokens = tokens.flatten()
        streams = F.embedding(tokens, self.embed).unsqueeze(1).expand(-1, self.arch.hc_mult, -1).contiguous()
        pre = HyperConnection.first_pre(tokens.shape[0], self.arch.hc_mult, tokens.device)
        for depth, layer in enumerate(self.layers):
            streams, pre = layer(streams, pre, tokens, positions, context[depth], visible)
        hidden = HyperConnection.collapse(streams, pre) if self.hc_head is None else self.hc_head(streams)
        return hidden.view(seqs, num_drafts, -1)

    # -- heads -----------------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden before the final norm [..., hidden] -> uncorrected logits [..., vocab]."""
        return F.linear(self.norm(hidden), self.head)

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Previous tokens [N] -> (their Markov embeddings [N, r], the logit correction [N, vocab])."""
        embedding = F.embedding(previous, self.markov_embed)
        return embedding, F.linear(embedding, self.markov_head)

    def confidence(self, hidden: torch.Tensor, markov_embedding: torch.Tensor, position: int) -> torch.Tensor:
        """Draft position `position`'s confidence in [0, 1]: hidden [N, hidden] (before the final
        norm), the previous token's Markov embedding [N, r] -> [N]."""
        temps = self.confidence_temperature
        temperature = temps[position] if isinstance(temps, tuple) else temps
        z = F.linear(torch.cat((hidden, markov_embedding), dim=-1).float(), self.confidence_proj.float())
        return torch.sigmoid((z.squeeze(-1) / temperature).clamp(-CONFIDENCE_CLAMP, CONFIDENCE_CLAMP))

    # -- weights ---------------------------------------------------------------------------------

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every `mtp.*` tensor the architecture declares, checked by name and shape first, then
        put onto the modules (experts stacked, the shared expert's gate and up rows fused)."""
        specs = {n: s for n, s in expected_tensors(self.arch).items() if n.startswith("mtp.")}
        for name, spec in specs.items():
            if name not in tensors:
                raise ValueError(f"{name}: DSpark tensor missing from the checkpoint")
            if tuple(tensors[name].shape) != spec.shape:
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, DSpark expects {spec.shape}")
        params = dict(self.named_parameters()) | dict(self.named_buffers())  # buffers: routers' bias_vl
        filled: set[str] = set()
        for name in specs:
            filled.update(_assign(params, _target(name), tensors[name].float()))
        unfilled = sorted(set(params) - filled)
        if unfilled:  # a parameter the checkpoint layout does not name: a bug here, not in the file
            raise RuntimeError(f"DSpark parameters left unloaded: {unfilled[:8]}")


def _target(name: str) -> str | tuple[str, int, str]:
    """HF name -> parameter path, or (stacked parameter path, expert or -1 for shared, which w)."""
    parts = name.split(".")
    depth, rest = parts[1], parts[2:]
    joined = ".".join(rest)
    heads = {
        "main_proj.weight": "main_proj",
        "main_norm.weight": "main_norm.weight",
        "norm.weight": "norm.weight",
        "markov_head.embed.weight": "markov_embed",
        "markov_head.head.weight": "markov_head",
        "confidence_head.proj.weight": "confidence_proj",
        "hc_head_fn": "hc_head.fn",
        "hc_head_base": "hc_head.base",
        "hc_head_scale": "hc_head.scale",
    }
    if joined in heads:
        return heads[joined]
    layer = f"layers.{depth}."
    if rest[0].startswith("hc_"):  # hc_attn_fn -> hc_attn.fn
        kind, field = rest[0][3:].split("_")
        return f"{layer}hc_{kind}.{field}"
    if rest[:2] == ["ffn", "experts"]:
        return (f"{layer}ffn.experts", int(rest[2]), rest[3])
    if rest[:2] == ["ffn", "shared_experts"]:
        return (f"{layer}ffn.shared_experts", -1, rest[2])
    return layer + joined


def _assign(
    params: dict[str, torch.nn.Parameter], target: str | tuple[str, int, str], value: torch.Tensor
) -> tuple[str, ...]:
    """Puts one tensor in place; returns the parameter paths it (partly) fills."""
    if isinstance(target, tuple):
        prefix, expert, which = target
        if expert >= 0:
            w13, w2 = params[prefix + ".w13"], params[prefix + ".w2"]
            inter = w2.shape[2]
            if which == "w2":
                w2.data[expert] = value
            else:  # w1: the gate rows, w3: the up rows
                w13.data[expert, slice(0, inter) if which == "w1" else slice(inter, 2 * inter)] = value
            return prefix + ".w13", prefix + ".w2"
        gate_up, down = params[prefix + ".gate_up_proj"], params[prefix + ".down_proj"]
        inter = down.shape[1]
        if which == "w2":
            down.data.copy_(value)
        else:
            gate_up.data[slice(0, inter) if which == "w1" else slice(inter, 2 * inter)] = value
        return prefix + ".gate_up_proj", prefix + ".down_proj"
    if target not in params:
        target = target.removesuffix(".weight")
    params[target].data = value.reshape(params[target].shape).clone()
    return (target,)
