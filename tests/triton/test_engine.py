"""The engine end to end on the Triton backend (interpreted on the CPU): a tiny random Llama and a
tiny Qwen2 with sliding-window layers give the C kernel backend's greedy tokens, batched, in
chunks and with prefix hits, and the same prompt logits; a tiny DeepSeek-V3 decodes through the
Triton MLA kernel to the torch path's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from deepinfer import LLM, SamplingParams
from deepinfer.kernels.triton import mla_decode as mla_decode_module
from deepinfer.model.loader.source import converted_gguf_dir
from tests.deepseek.conftest import VARIANTS
from tests.deepseek.tiny_checkpoint import build_checkpoint
from tests.engine.test_parity_tiny import COMMON, make_checkpoint

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen2-sliding": lambda: Qwen2Config(
        **COMMON,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory, default_model_path):
    directory = tmp_path_factory.mktemp(request.param)
    make_checkpoint(
        request.param, directory, converted_gguf_dir(default_model_path), CONFIGS[request.param]()
    )
    return directory


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


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
    expected = _greedy(cpu, prompts)
    # batched and chunked by 7, then the last prompt again over the blocks the first run cached
    assert _greedy(gpu_path, prompts) == expected
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    again = gpu_path.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == expected[2]
    torch.testing.assert_close(
        gpu_path.engine.core.score(prompts[1]), cpu.engine.core.score(prompts[1]), atol=1e-4, rtol=0
    )


def test_tiny_v3_greedy_equals_cpu_backend(tmp_path, device, monkeypatch):
    calls = []
    kernel = mla_decode_module.mla_decode_latent
    monkeypatch.setattr(mla_decode_module, "mla_decode_latent", lambda *a: calls.append(1) or kernel(*a))
    overrides, fp8, seed = VARIANTS["v3"]
    checkpoint = build_checkpoint(tmp_path / "v3", overrides, fp8=fp8, seed=seed)
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
    assert len(calls) == 3 * 7  # every decode step of each of the 3 layers, only with triton
