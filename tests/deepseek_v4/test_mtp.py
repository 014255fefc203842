"""The MTP module, loaded from `mtp.0.*`, against a reference assembled from transformers' modules.

transformers does not run V4's MTP, so the reference is DeepSeek's published formula on HF
pieces: the main model's final streams at i (captured at HF's hyper head) and the embedding of
token i + 1, each RMS-normed (hnorm, enorm) and projected (h_proj per stream, e_proj added to all),
then an HF decoder layer holding the module's block (sliding window, routed MoE), the module's
own hyper head and norm, and the shared LM head.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.cache import StepLayout
from tests.deepseek_v4.conftest import CachedRun


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def reference_draft_logits(tiny, ids: list[int]) -> torch.Tensor:
    hf, cfg, w = tiny.hf, tiny.hf.config, tiny.mtp_weights
    captured = {}
    hook = hf.model.hc_head.register_forward_hook(
        lambda m, args, out: captured.setdefault("streams", args[0])
    )
    with torch.no_grad():
        hf(torch.tensor([ids]))
    hook.remove()
    streams = captured["streams"][:, :-1]  # [1, S - 1, hc, hidden]: position i pairs with token i + 1
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        embeds = _rms(hf.model.embed_tokens(torch.tensor([ids[1:]])), w["enorm.weight"], eps)
        x = (embeds @ w["e_proj.weight"].t()).unsqueeze(2) + _rms(streams, w["hnorm.weight"], eps) @ w[
            "h_proj.weight"
        ].t()
        length = x.shape[1]
        positions = torch.arange(length).unsqueeze(0)
        rope = {kind: hf.model.rotary_emb(x, positions, layer_type=kind) for kind in ("main", "compress")}
        distance = positions.view(-1, 1) - positions.view(1, -1)
        visible = (distance >= 0) & (distance < cfg.sliding_window)
        mask = torch.zeros(1, 1, length, length).masked_fill(~visible, float("-inf"))
        x = tiny.mtp_block(
            x,
            position_embeddings=rope,
            position_ids=positions,
            attention_mask=mask,
            input_ids=torch.tensor([ids[1:]]),
        )
        hidden = _rms(tiny.mtp_head(x), w["norm.weight"], eps)
        return hf.lm_head(hidden)[0]


def test_mtp_draft_logits_match_reference(tiny, tiny_model):
    ids = torch.randint(
        3, tiny.config["vocab_size"], (30,), generator=torch.Generator().manual_seed(8)
    ).tolist()
    expected = reference_draft_logits(tiny, ids)
    for chunk in (29, 1, 6):
        run = CachedRun(tiny_model)
        seq = run.new_sequence()
        (streams,) = run.step({seq: ids})
        drafts, position = [], 0
        while position < len(ids) - 1:
            rows = list(range(position, min(position + chunk, len(ids) - 1)))
            layout = StepLayout((position,), (len(rows),))
            with torch.no_grad():
                logits, _ = tiny_model.mtp_forward(
                    torch.tensor([ids[r + 1] for r in rows]),
                    torch.tensor(rows),
                    streams[rows[0] : rows[-1] + 1],
                    layout,
                    run.cache.step([seq], layout),
                )
            drafts.append(logits)
            position = rows[-1] + 1
        torch.testing.assert_close(torch.cat(drafts), expected, atol=1e-4, rtol=0)


def test_mtp_is_declared_as_a_sliding_window_layer(tiny_model):
    arch = tiny_model.arch
    mtp = [d for d in tiny_model.cache_declarations() if d.layer == arch.num_layers]
    assert [d.kind.value for d in mtp] == ["sliding_kv"]
    assert tiny_model.num_mtp_layers == 1
