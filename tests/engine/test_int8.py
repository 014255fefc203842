"""quantization="int8": W8A8 linears that are close to fp32 and exactly batch-invariant."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams
from deepinfer.model.layers.int8_linear import EXACT_FP32_COLUMNS, Int8Linear, int8_matmul
from tests.engine.greedy import CHAT, assert_greedy_batch_invariant


@pytest.mark.parametrize("rows", [1, 2, 40])
def test_int8_matmul_is_the_exact_integer_product(rows: int) -> None:
    # Past one chunk of columns, and at the extremes: every product +-127 * 127.
    generator = torch.Generator().manual_seed(rows)
    columns = 2 * EXACT_FP32_COLUMNS + 17
    a = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (columns, 24), dtype=torch.int8, generator=generator)
    a[0], b[:, 0], b[:, 1] = 127, 127, -127
    expected = a.long() @ b.long()
    assert torch.equal(int8_matmul(a, b).long(), expected)
    assert expected[0, 0] == columns * 127 * 127  # beyond 2**24: one fp32 sum would not hold it


def test_int8_linear_is_close_to_fp32_and_rows_are_independent() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 128) * 0.05, torch.randn(300)
    layer = Int8Linear(weight, bias)
    x = torch.randn(33, 128)
    reference = F.linear(x, weight, bias)
    y = layer(x)
    assert ((y - reference).norm() / reference.norm()).item() < 0.02
    # Per-token scales and exact integer sums: a row's result does not depend on its neighbours.
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(alone, y)
    # A row with a huge outlier elsewhere in the batch leaves the other rows untouched.
    spiked = x.clone()
    spiked[0] *= 1000
    assert torch.equal(layer(spiked)[1:], y[1:])


@pytest.fixture(scope="module")
def int8_llm() -> Iterator[LLM]:
    llm = LLM(kv_cache_memory=64 << 20, quantization="int8")
    yield llm
    llm.close()


def test_int8_model_stays_close_to_fp32(dense_llm: LLM, int8_llm: LLM) -> None:
    text = CHAT.format("What is the capital of France? Explain briefly.") + (
        "The capital of France is Paris. It is known for the Eiffel Tower and its museums."
    )
    ids = dense_llm.get_tokenizer().encode(text)
    reference = torch.log_softmax(dense_llm.engine.core.score(ids), dim=-1)
    quantized = torch.log_softmax(int8_llm.engine.core.score(ids), dim=-1)
    kl = (reference.exp() * (reference - quantized)).sum(-1).mean().item()
    agreement = (reference.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    assert kl < 0.1 and agreement >= 0.75, (kl, agreement)
    prompt = CHAT.format("What is the capital of France?")
    params = SamplingParams(temperature=0, max_tokens=8)
    [fp32_out] = dense_llm.generate([prompt], params, use_tqdm=False)
    [int8_out] = int8_llm.generate([prompt], params, use_tqdm=False)
    assert "Paris" in fp32_out.outputs[0].text and "Paris" in int8_out.outputs[0].text


def test_int8_greedy_is_identical_alone_and_batched(int8_llm: LLM) -> None:
    # 12 tokens: the int8 path is slow one row at a time on this CPU (45 s for 24 tokens).
    assert_greedy_batch_invariant(int8_llm, max_tokens=12)


def test_int8_never_shares_prefix_blocks_with_fp32(dense_llm: LLM, int8_llm: LLM) -> None:
    assert int8_llm.engine.core.fingerprint != dense_llm.engine.core.fingerprint
    with pytest.raises(ValueError, match="quantization"):
        LLM(loaded=dense_llm.engine.core.loaded, quantization="int8")
