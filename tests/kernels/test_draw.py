"""rowwise.c's draws (temperature, top-k, top-p, min-p) against a float64 inverse CDF and the
sampler's torch truncation, at every instruction-set level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.runner.sampler import truncated_probs_batch
from deepinfer.sampling_params import SamplingParams

VOCAB = 49157  # 3072 vectors of 16 and a tail of 5; spans of 1024 and a short last one


def _plain(temperatures: list[float]) -> list[tuple[float, int, float, float]]:
    return [(t, 0, 1.0, 0.0) for t in temperatures]


def _reference_cdf(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """The running mass of softmax(row / temperature) in float64, with the kernel's cut: tokens
    more than 87 below the best (after the temperature) weigh nothing."""
    scaled = row.double() / temperature
    shifted = scaled - scaled.max()
    weights = torch.where(shifted >= -87.0, shifted.exp(), torch.zeros_like(shifted))
    return weights.cumsum(0)


def _assert_inverse_cdf(row: torch.Tensor, temperature: float, u: float, pick: int) -> None:
    """The pick's interval of the running mass holds u times the total, within float32 rounding."""
    cdf = _reference_cdf(row, temperature)
    total = float(cdf[-1])
    target, slack = u * total, 2e-5 * total
    before = float(cdf[pick - 1]) if pick else 0.0
    assert float(cdf[pick]) > before, f"token {pick} has no mass"
    assert before - slack <= target <= float(cdf[pick]) + slack, (
        pick,
        before / total,
        u,
        float(cdf[pick]) / total,
    )


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_draws_follow_the_inverse_cdf(level: isa.Level) -> None:
    kernels = rowwise_kernels(level.compiler_flags)
    assert kernels is not None
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, VOCAB, generator=generator) * 4.0
    x[1, :3000] = float("-inf")  # masked tokens (structured output): never drawn
    x[1, -2000:] = float("-inf")
    x[2, 777] = 40.0  # one dominant token
    temperatures = [1.0, 0.7, 1.3, 0.05]
    uniforms = [0.0, 1e-9, 0.25, 0.5, 0.999, 1.0 - 2.0**-53]
    for u in uniforms:
        picks = kernels.draw(x, [0, 1, 2, 3], _plain(temperatures), [u] * 4)
        for r, pick in enumerate(picks):
            _assert_inverse_cdf(x[r], temperatures[r], u, pick)
    first, last = kernels.draw(x, [1, 1], _plain([0.7, 0.7]), [0.0, 1.0 - 2.0**-53])
    assert x[1, first] > float("-inf") and x[1, last] > float("-inf")
    assert kernels.draw(x, [2], _plain([1.3]), [0.5]) == [777]


def test_every_level_draws_the_same_and_a_row_alone_as_in_a_batch() -> None:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(6, VOCAB, generator=generator) * 3.0
    uniforms = torch.rand(6, generator=generator, dtype=torch.float64).tolist()
    temperatures = [0.6, 0.8, 1.0, 1.2, 0.9, 2.0]
    answers = {
        level.name: rowwise_kernels(level.compiler_flags).draw(
            x, list(range(6)), _plain(temperatures), uniforms
        )
        for level in isa.machine_levels()
    }
    assert len(set(map(tuple, answers.values()))) == 1, answers
    batch = next(iter(answers.values()))
    kernels = rowwise_kernels()
    assert [kernels.draw(x, [r], _plain([temperatures[r]]), [uniforms[r]])[0] for r in range(6)] == batch
    assert kernels.draw(
        x, [4, 1], _plain([temperatures[4], temperatures[1]]), [uniforms[4], uniforms[1]]
    ) == [
        batch[4],
        batch[1],
    ]
    strided = x[:, 1:]  # rows VOCAB floats apart, one shorter
    for r, pick in enumerate(kernels.draw(strided, list(range(6)), _plain(temperatures), uniforms)):
        _assert_inverse_cdf(strided[r], temperatures[r], uniforms[r], pick)


def test_draw_frequencies_are_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, float("-inf")]])
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(20000, generator=generator, dtype=torch.float64).tolist()
    kernels = rowwise_kernels()
    picks = torch.tensor(kernels.draw(logits, [0] * len(uniforms), _plain([0.8] * len(uniforms)), uniforms))
    counts = torch.bincount(picks, minlength=5).double()
    expected = torch.softmax(logits[0].double() / 0.8, -1)
    torch.testing.assert_close(counts / counts.sum(), expected, atol=0.012, rtol=0)
    assert counts[4] == 0


def test_rows_without_a_distribution_draw_what_greedy_picks() -> None:
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(7))
    x[0, [30, 60]] = float("nan")
    x[1, 45] = float("inf")
    x[2] = float("-inf")
    kernels = rowwise_kernels()
    assert kernels.draw(x, [0, 1, 2], _plain([1.0] * 3), [0.5] * 3) == [30, 45, 0]
    assert kernels.draw(x, [3], _plain([1e-45]), [0.5]) == [int(x[3].argmax())]  # x / t overflows
    with pytest.raises(ValueError, match="positive"):
        kernels.draw(x, [3], _plain([0.0]), [0.5])
    with pytest.raises(IndexError):
        kernels.draw(x, [4], _plain([1.0]), [0.5])


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_truncated_draws_keep_the_tokens_torch_keeps(level: isa.Level) -> None:
    kernels = rowwise_kernels(level.compiler_flags)
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(6, VOCAB, generator=generator) * 2.5
    x[5, :20000] = float("-inf")
    params = [
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=500, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=1.0, top_p=0.999),
        SamplingParams(temperature=0.9, top_k=30000, top_p=0.95),  # top-k beyond the unmasked tokens
    ]
    reference = truncated_probs_batch(x, params).double()
    settings = [(p.temperature, p.top_k, p.top_p, p.min_p) for p in params]
    uniforms = [0.0, 1e-7, 0.1, 0.37, 0.5, 0.8, 0.999999, 1.0 - 2.0**-53]
    seen: list[set[int]] = [set() for _ in params]
    for u in uniforms:
        for r, pick in enumerate(kernels.draw(x, list(range(6)), settings, [u] * 6)):
            cdf = reference[r].cumsum(0)
            before = float(cdf[pick - 1]) if pick else 0.0
            assert reference[r, pick] > 0, f"row {r}: token {pick} is truncated away"
            assert before - 2e-5 <= u <= float(cdf[pick]) + 2e-5, (r, pick, u)
            seen[r].add(pick)
    assert all(len(picks) > 1 for picks in seen)  # the draws move with the uniform
    # the kept sets are torch's: the lowest uniform lands on the first kept token, the highest on the last
    for r in range(6):
        kept = reference[r].nonzero().flatten()
        first, last = kernels.draw(x, [r, r], [settings[r]] * 2, [0.0, 1.0 - 2.0**-53])
        assert (first, last) == (int(kept[0]), int(kept[-1])), r


def test_top_p_keeps_a_tie_whole() -> None:
    # four tokens of equal weight hold 0.8 of the mass: top_p 0.3 reaches into them, so all four stay
    x = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]))
    kernels = rowwise_kernels()
    picks = {kernels.draw(x, [0], [(1.0, 0, 0.3, 0.0)], [u])[0] for u in (0.0, 0.3, 0.6, 0.99)}
    assert picks == {0, 1, 2, 3}
    assert kernels.draw(x, [0], [(1.0, 0, 0.85, 0.0)], [1.0 - 2.0**-53]) == [5]  # the 0.1s reach 0.85 too
    assert kernels.draw(x, [0], [(1.0, 2, 1.0, 0.0)], [0.99]) == [3]  # top-k 2 keeps the tie whole too
