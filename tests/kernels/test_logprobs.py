"""rowwise.c's logprobs (a token's logprob and rank, a row's top tokens) against torch's
log_softmax, rank and topk, at every instruction-set level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.rowwise import rowwise_kernels

VOCAB = 49157  # 3072 vectors of 16 and a tail of 5


def _torch_answer(row: torch.Tensor, temperature: float, token: int, k: int) -> tuple[float, int, list[int]]:
    logprobs = torch.log_softmax(row / temperature, dim=-1)
    rank = int((logprobs > logprobs[token]).sum()) + 1
    return float(logprobs[token]), rank, torch.topk(logprobs, k).indices.tolist() if k else []


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_logprobs_are_torch_log_softmax(level: isa.Level) -> None:
    kernels = rowwise_kernels(level.compiler_flags)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(5, VOCAB, generator=generator) * 4.0
    x[1, :1000] = float("-inf")  # masked tokens
    x[3, VOCAB - 2] = 30.0  # the best token in the tail past the last 16
    temperatures = [1.0, 0.7, 1.5, 1.0, 0.2]
    tokens = [17, 5000, 49000, VOCAB - 1, 123]
    tops = [0, 5, 20, 3, 1]
    answers = kernels.logprobs(x, list(range(5)), temperatures, tokens, tops)
    for r, answer in enumerate(answers):
        assert answer is not None
        logprob, rank, top = answer
        expected, expected_rank, expected_top = _torch_answer(x[r], temperatures[r], tokens[r], tops[r])
        assert logprob == pytest.approx(expected, abs=2e-5, rel=1e-6), r
        assert rank == expected_rank, r
        assert [token for token, _ in top] == expected_top, r
        reference = torch.log_softmax(x[r] / temperatures[r], dim=-1)
        for token, value in top:
            assert value == pytest.approx(float(reference[token]), abs=2e-5, rel=1e-6)
    assert answers[3][2][0][0] == VOCAB - 2  # the best token, in the tail past the last 16


def test_ties_list_the_lower_token_first_and_bad_rows_go_back_to_torch() -> None:
    kernels = rowwise_kernels()
    x = torch.zeros(3, 40)
    x[0, [3, 9, 30]] = 2.0  # a three-way tie at the top
    x[1, 7] = float("nan")
    x[2, 7] = float("inf")
    answers = kernels.logprobs(x, [0, 1, 2], [1.0] * 3, [9, 0, 0], [4, 2, 2])
    _, rank, top = answers[0]
    assert rank == 1 and [token for token, _ in top] == [3, 9, 30, 0]
    assert answers[1] is None and answers[2] is None
    with pytest.raises(IndexError):
        kernels.logprobs(x, [0], [1.0], [40], [1])
    with pytest.raises(ValueError):
        kernels.logprobs(x, [0], [1.0], [0], [21])
