"""The engine end to end on the Triton backend (interpreted on the CPU): a tiny random Llama and a
tiny Qwen2 with sliding-window layers give the C kernel backend's greedy tokens, batched, in
chunks and with prefix hits, and the same prompt logits; a tiny DeepSeek-V3 decodes through the
Triton MLA kernel, its routed experts (bf16 and block-FP8 checkpoints) through the fused MoE
kernel, to the torch path's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.kernels.triton import fused_moe as fused_moe_module
from deepinfer.kernels.triton import mla_decode as mla_decode_module
from tests.deepseek.conftest import VARIANTS
from tests.deepseek.tiny_checkpoint import build_checkpoint
from tests.triton.tiny_llama import CONFIGS, greedy, write_checkpoint


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory, default_model_path):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), default_model_path)


def test_triton_backend_greedy_equals_cpu_backend(checkpoint, device):
    shared = [(7 * j) % 48000 + 100 for j in range(20)]
    prompts = [shared + [(11 * i + 5 * j) % 48000 + 200 for j in range(3 + 6 * i)] for i in range(3)]
    options = dict(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_blocks=96,
        num_threads=1,
        prefill_chunk_size=7,
    )
    cpu = LLM(attention_backend="cpu_paged", device="cpu", **options)
    gpu_path = LLM(attention_backend="triton", device=device, **options)
    assert gpu_path.engine.core.runner.backend.name == "triton"
    expected = greedy(cpu, prompts)
    # batched and chunked by 7, then the last prompt again over the blocks the first run cached
    assert greedy(gpu_path, prompts) == expected
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    again = gpu_path.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == expected[2]
    torch.testing.assert_close(
        gpu_path.engine.core.score(prompts[1]), cpu.engine.core.score(prompts[1]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("variant", "layers", "moe_layers"),
    [("v3", 3, 2), ("v3_fp8", 2, 1)],  # v3_fp8: block-FP8 experts, dequantized at load
)
def test_tiny_v3_greedy_equals_cpu_backend(variant, layers, moe_layers, tmp_path, device, monkeypatch):
    calls = []
    kernel = mla_decode_module.mla_decode_latent
    monkeypatch.setattr(mla_decode_module, "mla_decode_latent", lambda *a: calls.append(1) or kernel(*a))
    moe_calls = []
    experts = fused_moe_module.expert_pairs
    monkeypatch.setattr(fused_moe_module, "expert_pairs", lambda *a: moe_calls.append(1) or experts(*a))
    overrides, fp8, seed = VARIANTS[variant]
    checkpoint = build_checkpoint(tmp_path / variant, overrides, fp8=fp8, seed=seed)
    vocab = checkpoint.config["vocab_size"]
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for backend, where in (("cpu_paged", "cpu"), ("triton", device)):
        llm = LLM(
            model=str(checkpoint.path), attention_backend=backend, device=where, dtype="float32",
            num_blocks=64, num_threads=1,
        )  # fmt: skip
        generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in generated])
    assert outputs[0] == outputs[1]
    assert len(calls) == layers * 7  # every decode step of each layer, only with triton
    assert len(moe_calls) == moe_layers * 8  # each MoE layer's routed experts, every step, only with triton


def test_tiny_v3_fp8_weights_kept_equal_dequantized(tmp_path, device, monkeypatch):
    """An FP8 V3 checkpoint with its o_proj and dense / shared-expert MLP weights kept in FP8 (the
    Triton FP8 linear) gives the greedy tokens of the same checkpoint dequantized at load."""
    from deepinfer.kernels.triton import fp8_gemm as fp8_gemm_module
    from deepinfer.model.layers.fp8_linear import Fp8BlockLinear

    calls = []
    gemm = fp8_gemm_module.fp8_block_linear
    monkeypatch.setattr(fp8_gemm_module, "fp8_block_linear", lambda *a: calls.append(1) or gemm(*a))
    overrides, fp8, seed = VARIANTS["v3_fp8"]
    # A dense MLP 256 wide: its fused gate / up rows start on a 128-row scale tile, so it is kept;
    # the shared expert's (48 + 48 rows) is not, and stays dequantized beside its kept down_proj.
    checkpoint = build_checkpoint(
        tmp_path / "fp8", {**overrides, "intermediate_size": 256}, fp8=fp8, seed=seed
    )
    prompts = [[5, 17, 33, 60, 8, 91, 12], [40, 3, 77, 21]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs, models = [], []
    for backend, where, weights in (("cpu_paged", "cpu", "dequantize"), ("triton", device, "keep")):
        llm = LLM(
            model=str(checkpoint.path), attention_backend=backend, device=where, dtype="float32",
            num_blocks=32, num_threads=1, fp8_weights=weights,
        )  # fmt: skip
        generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in generated])
        models.append(llm.engine.core.runner.model)
    assert outputs[0] == outputs[1]
    kept = {n: m for n, m in models[1].named_modules() if isinstance(m, Fp8BlockLinear)}
    assert not any(isinstance(m, Fp8BlockLinear) for m in models[0].modules())
    expected = {"layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"}
    expected |= {"layers.1.self_attn.o_proj", "layers.1.mlp.shared_experts.down_proj"}
    assert expected <= kept.keys()
    assert "layers.1.mlp.shared_experts.gate_up_proj" not in kept  # 48-row segments: dequantized
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in kept.values())
    # every kept linear of the backbone, every step (prefill + 5 decode steps), only when kept
    backbone = [n for n in kept if n.startswith("layers.")]
    assert len(calls) >= len(backbone) * 6
