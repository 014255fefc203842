"""bf16 on the CPU: `dtype=auto`'s choice, parity with HF transformers in bf16 (tolerances from
bf16's epsilon) and the default model's greedy tokens in bf16 against fp32."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer import LLM, SamplingParams
from deepinfer.attention.float32_boundary import Float32Boundary
from deepinfer.bench.hf_from_gguf import hf_dir_is_complete, write_hf_dir
from deepinfer.bench.hf_from_gguf import main as write_hf_dir_cli
from deepinfer.config import ConfigError, EngineConfig
from deepinfer.kernels import isa
from deepinfer.kernels.bf16_layers import Bf16Stack
from deepinfer.model.layers.bf16_linear import Bf16Linear
from deepinfer.model.llama.model import LlamaForCausalLM
from deepinfer.model.loader.dtype import engine_dtype
from deepinfer.model.loader.source import converted_gguf_dir
from tests.engine.fused_steps import record_both_paths
from tests.engine.greedy import CHAT, QUESTIONS
from tests.engine.test_parity_tiny import make_checkpoint

CPU = torch.device("cpu")
EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: the spacing of bf16 values in [1, 2)
native_bf16 = pytest.mark.skipif(not isa.runs_bfloat16(), reason="this CPU has no AVX512-BF16 or AMX")


def fake_checkpoint(directory: Path, dtype: torch.dtype, model_type: str = "llama") -> Path:
    """A directory whose config and safetensors header are all `dtype=auto` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}
    (directory / "config.json").write_text(json.dumps(config | {"vocab_size": 16, "intermediate_size": 16}))
    tensors = {
        "model.norm.weight": torch.ones(8),
        "model.embed_tokens.weight": torch.zeros(16, 8, dtype=dtype),
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def auto(directory: Path, **options: object) -> torch.dtype:
    return engine_dtype(EngineConfig.from_kwargs(model=str(directory), **options), CPU)


@native_bf16
def test_auto_keeps_half_checkpoints_in_bf16_where_the_cpu_has_it(tmp_path: Path) -> None:
    assert auto(fake_checkpoint(tmp_path / "bf16", torch.bfloat16)) is torch.bfloat16
    assert auto(fake_checkpoint(tmp_path / "fp16", torch.float16)) is torch.bfloat16
    assert auto(fake_checkpoint(tmp_path / "fp32", torch.float32)) is torch.float32
    # int8 linears and a GGUF's own blocks compute in fp32
    assert auto(tmp_path / "bf16", quantization="int8") is torch.float32
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        auto(tmp_path / "bf16", kv_cache_dtype="float32")
    assert engine_dtype(EngineConfig.from_kwargs(), CPU) is torch.float32  # the default GGUF


@native_bf16
def test_auto_is_fp32_below_avx512_bf16_and_for_models_without_a_bf16_cpu_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "bf16", torch.bfloat16)
    monkeypatch.setattr(LlamaForCausalLM, "cpu_bfloat16", False)
    assert auto(checkpoint) is torch.float32
    monkeypatch.undo()
    monkeypatch.setenv(isa.ENV, "avx512_vnni")  # the level just below: a CPU without AVX512-BF16
    assert not isa.runs_bfloat16()
    assert auto(checkpoint) is torch.float32
    # Asked for, bf16 is honoured there too (as vLLM's CPU backend does), with a warning.
    with caplog.at_level(logging.WARNING, logger="deepinfer.model.loader.dtype"):
        assert auto(checkpoint, dtype="bfloat16") is torch.bfloat16
    assert "emulated" in caplog.text
    assert auto(checkpoint, dtype="float32") is torch.float32
    assert (
        engine_dtype(EngineConfig.from_kwargs(model=str(checkpoint)), torch.device("cuda")) is torch.bfloat16
    )


def test_runs_bfloat16_follows_the_selected_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.ENV, "portable")
    assert not isa.runs_bfloat16()
    monkeypatch.delenv(isa.ENV)
    assert isa.runs_bfloat16() == any(level.name == "avx512_bf16" for level in isa.machine_levels())


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_path: Path) -> Path:
    return converted_gguf_dir(default_model_path)


@pytest.mark.parametrize("name", ["llama3-scaled-rope", "qwen2-qkv-bias", "qwen3-qk-norm"])
def test_bf16_tiny_model_matches_hf_bf16(name: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """Logits of a bf16 checkpoint against HF in bf16 and against HF in fp32 on the same (bf16)
    values. bf16 keeps 8 significant bits: each rounding moves a value by up to EPS/2 of it, and
    both engines round at every op, in different places (our norms round once, from fp32, and
    our attention too or, on AMX tiles, rounds its softmax weights to bf16; HF's SDPA and
    RMSNorm in bf16). So: within a few EPS of the largest logit of HF
    bf16, and no further from the fp32 values than twice HF bf16's own distance from them."""
    hf = make_checkpoint(name, tmp_path, tokenizer_dir).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)  # the weights as a real checkpoint: bf16
    exact = copy.deepcopy(hf).float()  # the same values computed in fp32
    llm = LLM(model=str(tmp_path), dtype="bfloat16", num_blocks=64, max_num_batched_tokens=256)
    core = llm.engine.core
    assert core.loaded.model.embed_tokens.weight.dtype is torch.bfloat16
    assert {t.dtype for g in core.layout.groups for t in g.group.tensors} == {"bfloat16"}
    assert isinstance(core.runner.backend, Float32Boundary)
    # 12 tokens: the C kernel's rows (reading K/V back from the bf16 cache); 49: the tiled prefill
    for prompt in (
        [(5 * j) % 49000 + 100 for j in range(12)],
        [(7 + 3 * j) % 49000 + 100 for j in range(49)],
    ):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0].float()
            truth = exact(torch.tensor([prompt])).logits[0]
        ours = core.score(prompt)
        assert ours.dtype is torch.float32
        scale = truth.abs().max().item()
        assert (ours - reference).abs().max().item() <= 4 * EPS * scale
        hf_error = (reference - truth).abs().max().item()
        assert (ours - truth).abs().max().item() <= 2 * hf_error + EPS / 2 * scale
    llm.close()


@pytest.fixture(scope="module")
def bf16_llm(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """The default model's values written as a bf16 safetensors checkpoint (deepinfer/bench/hf_from_gguf.py),
    loaded with `dtype=auto` where the CPU has native bf16 and asked for elsewhere."""
    folder = write_hf_dir(default_model_path, tmp_path_factory.mktemp("smollm2-bf16"), "bfloat16")
    llm = LLM(
        model=str(folder), dtype="auto" if isa.runs_bfloat16() else "bfloat16", kv_cache_memory=64 << 20
    )
    assert llm.engine.core.loaded.model.embed_tokens.weight.dtype is torch.bfloat16
    yield llm
    llm.close()


GREEDY_TOKENS = 16


def test_bf16_default_model_greedy_agrees_with_fp32(bf16_llm: LLM, dense_llm: LLM) -> None:
    """The same chat prompts greedy in bf16, each token then scored by fp32 (the GGUF's values,
    dequantized) after the bf16 run's own prefix. bf16 rounding moves logits by about EPS of
    their size, so bf16 may choose another token only where fp32's best and bf16's choice are
    that close: by no more than 4 EPS of the largest logit, at every position. Counting each
    position on its own (not up to a first difference, after which two greedy runs part for
    good), fp32 prefers bf16's own token at 58 of the 64 here (Zen 4, torch 2.13; 62 with
    torch's bf16 GEMM)."""
    tokenizer = dense_llm.get_tokenizer()
    prompts = [tokenizer.encode(CHAT.format(q)) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    bf16 = [o.outputs[0].token_ids for o in bf16_llm.generate(requests, params, use_tqdm=False)]
    agreed = 0
    for prompt, ours in zip(prompts, bf16):
        logits = dense_llm.engine.core.score(prompt + ours)[len(prompt) - 1 : -1]  # fp32's, for each of ours
        chosen = torch.tensor(ours)
        agreed += int((logits.argmax(-1) == chosen).sum())
        margins = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
        assert (margins <= 4 * EPS * logits.abs().max(-1).values).all(), margins
    assert agreed >= len(prompts) * GREEDY_TOKENS * 3 // 4, bf16


@native_bf16
def test_bf16_greedy_tokens_do_not_depend_on_the_batch(bf16_llm: LLM) -> None:
    """Where the CPU has bf16 arithmetic, every projection runs on kernels/bf16_matmul.c, which
    sums each output in one order whatever rows come with it: each prompt alone and all four
    together give the same tokens (torch's bf16 GEMM did not)."""
    model = bf16_llm.engine.core.loaded.model
    assert isinstance(model.layers[0].mlp.down_proj.linear, Bf16Linear)
    assert isinstance(model.lm_head.linear, Bf16Linear)  # tied: a packed copy of the embedding
    tokenizer = bf16_llm.get_tokenizer()
    requests = [{"prompt_token_ids": tokenizer.encode(CHAT.format(q))} for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in bf16_llm.generate(requests, params, use_tqdm=False)]
    alone = [bf16_llm.generate([r], params, use_tqdm=False)[0].outputs[0].token_ids for r in requests]
    assert alone == together


@native_bf16
def test_bf16_logprobs_do_not_depend_on_prompt_chunking(
    bf16_llm: LLM, default_model_path: Path, tmp_path: Path
) -> None:
    """Our bf16 kernel rounds every projection's output, so a last-bit difference in attention can
    change a token: prompts of ~300 tokens prefilled in 40-token chunks (longer than the backend's
    row-kernel threshold) must give the top logprobs, bit for bit, of the same prompts prefilled
    whole. The torch GEMMs of the tiled prefill attention summed in an order set by the chunk's
    shape and did not."""
    tokenizer = bf16_llm.get_tokenizer()
    long_question = " ".join(QUESTIONS) * 4
    requests = [
        {"prompt_token_ids": tokenizer.encode(CHAT.format(f"{q} {long_question}"))} for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    # through the module's command line, which writes the directories the benchmarks read
    folder = write_hf_dir_cli(
        ["--gguf", str(default_model_path), "--dtype", "bfloat16", "--out", str(tmp_path / "bf16")]
    )
    assert hf_dir_is_complete(folder, default_model_path, "bfloat16")
    chunked = LLM(
        model=str(folder),
        dtype="auto",
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=40,
        enable_prefix_caching=False,
    )
    try:
        pieces = [chunked.generate([r], params, use_tqdm=False)[0].outputs[0] for r in requests]
    finally:
        chunked.close()
    whole = [bf16_llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in requests]
    for a, b in zip(pieces, whole):
        assert a.token_ids == b.token_ids
        assert [sorted((t, p.logprob) for t, p in d.items()) for d in a.logprobs] == [
            sorted((t, p.logprob) for t, p in d.items()) for d in b.logprobs
        ]


@native_bf16
def test_bf16_steps_in_one_call_are_the_layer_by_layer_bits(
    bf16_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step of the bf16 model (its prompt rows are decode-kernel rows too) runs its layers in
    one C call (kernels/bf16_layers.c); each step's hidden states equal the layer-by-layer path's
    to the bit, prompts and decodes, alone and batched."""
    steps = record_both_paths(bf16_llm.engine.core.runner, monkeypatch, Bf16Stack)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bf16_llm.reset_prefix_cache()
    long_question = CHAT.format(" ".join(QUESTIONS) * 3)
    bf16_llm.generate(["The capital of France is", "One, two,", long_question], params, use_tqdm=False)
    bf16_llm.generate(["Hello"], params, use_tqdm=False)
    assert all(same for _, _, same in steps), steps
    assert all(fused for _, fused, _ in steps) and len(steps) >= 6, steps
    assert steps[0][0] > 16 and any(tokens == 3 for tokens, _, _ in steps)  # prompts, batched decodes
