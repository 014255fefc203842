"""Our DeepSeek model, loaded from official-format checkpoints, against HF transformers.

Prefill logits agree within 1e-4 (fp32); greedy continuations, decoded token by token through the
paged latent cache (absorbed MLA), equal HF generate's. Variants cover q LoRA on/off, YaRN on/off,
FP8 block-quantized weights, V2 routing and V3.2 with its indexer weights present.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Mixture of experts activates a small part of the weights for every token. DeepSeek models cache",
]
VARIANT_FIXTURES = ["v3_ckpt", "v3_fp8_ckpt", "v2_ckpt", "v32_ckpt"]


@pytest.fixture(scope="module", params=VARIANT_FIXTURES)
def served(request):
    checkpoint = request.getfixturevalue(request.param)
    llm = request.getfixturevalue("v3_llm") if request.param == "v3_ckpt" else None
    return checkpoint, llm or LLM(model=str(checkpoint.path), num_blocks=64, num_threads=1)


def test_prefill_logits_match_hf(served):
    checkpoint, llm = served
    tokenizer = llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = llm.engine.core.score(ids)
        with torch.no_grad():
            theirs = checkpoint.hf(torch.tensor([ids])).logits[0]
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_greedy_decode_matches_hf_generate(served):
    """All prompts decode together in one batch: decode rows of different lengths share a step."""
    checkpoint, llm = served
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = checkpoint.hf.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2
            )[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == expected


def test_fp8_checkpoint_really_is_fp8(v3_fp8_ckpt):
    """The FP8 variant stores float8_e4m3fn weights with per-tile scales, partial tiles included."""
    from safetensors import safe_open

    dtypes, scale_shapes = {}, {}
    for shard in sorted(v3_fp8_ckpt.path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = f.get_tensor(name)
                dtypes[name] = tensor.dtype
                if name.endswith("_scale_inv"):
                    scale_shapes[name] = tuple(tensor.shape)
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == torch.float8_e4m3fn
    assert scale_shapes["model.layers.0.self_attn.q_proj.weight_scale_inv"] == (2, 1)  # 192 x 128
    assert scale_shapes["model.layers.0.mlp.down_proj.weight_scale_inv"] == (1, 2)  # 128 x 200
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32  # the router stays unquantized
