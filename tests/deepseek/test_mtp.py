"""The MTP module against a plain reference written from the DeepSeek-V3 report.

Reference (report §2.2, official weights layout): for position i with main-model output h_i and
next token t_{i+1}: x_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]); the MTP block is an ordinary
decoder layer (HF's DeepseekV3DecoderLayer, causal over the MTP stream); draft logits for t_{i+2}
are shared_head.head(shared_head.norm(block(x)_i)). Ours runs through paged latent caches: a
prefill chunk, then single-row decode steps.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata
from deepinfer.model.loader.load import load_model

BLOCK = 4
TABLE = [3, 0, 5, 1, 7, 2, 6, 4]  # non-contiguous blocks: 32 slots


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _meta(start: int, count: int) -> ForwardMetadata:
    positions = range(start, start + count)
    slots = [TABLE[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
    group = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([TABLE]),
        seq_lens=torch.tensor([start + count]),
        query_lens=[count],
        seq_lens_list=[start + count],
        num_decodes=int(count == 1),
        block_size=BLOCK,
    )
    return ForwardMetadata([group])


def reference_draft_logits(checkpoint, ids: list[int]) -> torch.Tensor:
    """Draft logits [n - 1, V]: row i predicts t_{i+2} from h_i and t_{i+1}."""
    hf, w = checkpoint.hf, checkpoint.mtp_weights
    n = len(ids)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        emb = hf.model.embed_tokens(torch.tensor(ids[1:]))
        x = torch.cat([_rms(emb, w["enorm.weight"]), _rms(h[:-1], w["hnorm.weight"])], dim=-1)
        x = (x @ w["eh_proj.weight"].T)[None]
        positions = torch.arange(n - 1)[None]
        mask = torch.full((n - 1, n - 1), float("-inf")).triu(1)[None, None]
        out = checkpoint.mtp_block(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=hf.model.rotary_emb(x, positions),
        )[0]
        return _rms(out, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T


def our_draft_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Main model over the whole prompt, then MTP: rows [0, chunk) as one prefill, the rest decoded."""
    latent = model.arch.latent_dim
    n = len(ids)
    with torch.no_grad():
        caches = [torch.zeros(len(TABLE) * BLOCK, latent) for _ in model.layers]
        hidden = model(torch.tensor(ids), torch.arange(n), caches, _meta(0, n), None)
        mtp_cache = torch.zeros(len(TABLE) * BLOCK, latent)
        next_ids = torch.tensor(ids[1:])
        logits = []
        for start, count in [(0, chunk)] + [(i, 1) for i in range(chunk, n - 1)]:
            rows = slice(start, start + count)
            step_logits, _ = model.mtp_draft_logits(
                next_ids[rows],
                torch.arange(start, start + count),
                hidden[rows],
                mtp_cache,
                _meta(start, count),
            )
            logits.append(step_logits)
        return torch.cat(logits)


@pytest.fixture(scope="module", params=["v3_ckpt", "v3_fp8_ckpt"])
def mtp_case(request):
    checkpoint = request.getfixturevalue(request.param)
    loaded = load_model(str(checkpoint.path), torch.float32, torch.device("cpu"))
    return checkpoint, loaded.model


def test_mtp_matches_reference(mtp_case):
    checkpoint, model = mtp_case
    ids = torch.randint(3, checkpoint.config["vocab_size"], (21,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    ours = our_draft_logits(model, ids, chunk=13)
    expected = reference_draft_logits(checkpoint, ids)
    assert ours.shape == (len(ids) - 1, checkpoint.config["vocab_size"])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_mtp_is_deterministic_and_chunking_invariant(mtp_case):
    checkpoint, model = mtp_case
    ids = torch.randint(3, checkpoint.config["vocab_size"], (17,), generator=torch.Generator().manual_seed(4))
    ids = ids.tolist()
    first = our_draft_logits(model, ids, chunk=9)
    assert torch.equal(first, our_draft_logits(model, ids, chunk=9))
    assert (first.argmax(-1) == our_draft_logits(model, ids, chunk=16).argmax(-1)).all()


def test_mtp_cache_groups_and_bad_depth(v3_ckpt):
    model = load_model(str(v3_ckpt.path), torch.float32, torch.device("cpu")).model
    latent = v3_ckpt.config["kv_lora_rank"] + v3_ckpt.config["qk_rope_head_dim"]
    assert model.num_mtp_layers == 1
    [group] = model.mtp_cache_groups(torch.float32)
    assert group.kind == "full" and [(t.slot_shape, t.dtype, t.owner) for t in group.tensors] == [
        ((latent,), "float32", "mtp")
    ]
    with pytest.raises(ValueError, match="depth 1"):
        model.mtp_draft_logits(
            torch.tensor([5]),
            torch.tensor([0]),
            torch.zeros(1, 64),
            torch.zeros(32, latent),
            _meta(0, 1),
            depth=1,
        )


def test_checkpoint_without_mtp_weights_loads_without_mtp(v3_ckpt, tmp_path):
    """Checkpoints stripped of the MTP module (common in conversions) still serve the main model."""
    mtp_prefix = f"model.layers.{v3_ckpt.config['num_hidden_layers']}."
    for shard in sorted(v3_ckpt.path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            kept = {n: f.get_tensor(n) for n in f.keys() if not n.startswith(mtp_prefix)}  # noqa: SIM118
        save_file(kept, str(tmp_path / shard.name))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((v3_ckpt.path / name).read_bytes())
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu")).model
    assert model.num_mtp_layers == 0
    assert model.mtp_cache_groups(torch.float32) == []
    ids = [5, 17, 42, 99, 7]
    with torch.no_grad():
        caches = [torch.zeros(len(TABLE) * BLOCK, model.arch.latent_dim) for _ in model.layers]
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(5), caches, _meta(0, 5), None))
        expected = v3_ckpt.hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
