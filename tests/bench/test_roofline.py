from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepinfer.bench.cli import main
from deepinfer.bench.roofline import (
    Roofline,
    default_model_path,
    llama_config_from_gguf,
    matmul_params,
    measure_roofline,
    model_bytes_per_token,
    model_flops_per_token,
    utilization,
)

TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_matmul_params_equal_the_linear_weights_of_a_real_llama() -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(TINY) == linear


def test_flops_per_token_is_two_per_weight_plus_attention() -> None:
    head_dim = 64 // 8
    assert model_flops_per_token(TINY, 0) == 2 * matmul_params(TINY)
    extra = model_flops_per_token(TINY, 1000) - model_flops_per_token(TINY, 0)
    assert extra == 4 * 3 * 8 * head_dim * 1000
    with pytest.raises(ValueError, match="missing vocab_size"):
        matmul_params({k: v for k, v in TINY.items() if k != "vocab_size"})


def test_bytes_per_token_shares_weights_across_the_batch() -> None:
    weights = 4 * matmul_params(TINY)
    kv_per_position = 2 * 3 * 2 * 8 * 4  # K and V, layers, kv heads, head_dim, fp32
    assert model_bytes_per_token(TINY, 0, batch_size=1) == weights
    assert model_bytes_per_token(TINY, 100, batch_size=4) == weights / 4 + kv_per_position * 100
    assert model_bytes_per_token(TINY, 0, weight_bytes=1000.0, batch_size=2) == 500.0


def test_default_model_config_read_from_its_gguf() -> None:
    config, weight_bytes = llama_config_from_gguf(default_model_path())
    assert config["hidden_size"] == 576 and config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    # SmolLM2-135M: about 135M weights, the LM head tied to the embedding.
    assert 130e6 < matmul_params(config) < 140e6
    assert 0 < weight_bytes < default_model_path().stat().st_size


def test_measured_roofline_and_utilization() -> None:
    roofline = measure_roofline(sizes=(64, 128), threads=1, size_mib=16, repeats=2)
    assert set(roofline.gemm_flops_by_size) == {64, 128}
    assert roofline.peak_flops == max(roofline.gemm_flops_by_size.values()) > 1e7
    assert roofline.peak_bytes_per_s >= roofline.copy_bytes_per_s > 1e8

    fixed = Roofline(1e12, 1e11, {}, 1e11, 1e11, 2)
    used = utilization(fixed, TINY, total_tokens_per_s=1000, output_tokens_per_s=100, context_len=10)
    assert used.mfu == pytest.approx(1000 * model_flops_per_token(TINY, 10) / 1e12)
    assert used.mbu == pytest.approx(100 * model_bytes_per_token(TINY, 10) / 1e11)


def test_roofline_command_converts_a_result(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "serve.json"
    summary = {
        "output_throughput": 50.0,
        "total_token_throughput": 150.0,
        "input_throughput": 100.0,
        "num_cards": 1,
        "mean_input_tokens": 200.0,
        "mean_output_tokens": 100.0,
        "mean_concurrency": 4.0,
        "prefix_cache_hit_rate": None,
    }
    result.write_text(json.dumps({"runs": [{"summary": summary}]}))
    out_json = tmp_path / "roofline.json"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code = main(
        ["roofline", "--sizes", "64", "--bandwidth-mib", "8", "--repeats", "1", "--threads", "1",
         "--result", str(result), "--model-config", str(config), "--json-out", str(out_json)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "GEMM 64×64 fp32" in printed and "MFU" in printed
    record = json.loads(out_json.read_text())
    assert record["utilization"]["context_len"] == 250.0
    expected_flops = model_flops_per_token(TINY, 250)
    assert record["utilization"]["flops_per_token"] == expected_flops
    assert record["utilization"]["mfu"] == pytest.approx(
        150 * expected_flops / record["roofline"]["peak_flops"]
    )
