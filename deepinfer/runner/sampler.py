"""Turn logits into tokens: logit bias, min_tokens, penalties, temperature, top-k/top-p/min-p, seeds.

Order of processing, fixed and documented because tests compute it by hand:
  1. logit_bias is added;
  2. while fewer than min_tokens have been generated, EOS and stop_token_ids are masked;
  3. repetition penalty (prompt + output tokens), then frequency and presence penalties (output);
  4. structured-output masks (disallowed tokens to -inf);
  5. logprobs are taken here: log_softmax of these processed logits divided by the temperature
     (greedy rows use temperature 1), i.e. the distribution before top-k/top-p/min-p truncation;
  6. greedy rows take the argmax; other rows divide by temperature, keep top-k, then the top-p
     nucleus, then drop tokens below min_p x the top probability, renormalize and sample.
Sampling is inverse-CDF with one uniform draw per token from the sequence's own generator when it
has a seed, so a seeded sequence gets the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels.rowwise import RowwiseKernels, rowwise_kernels
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.bitmask import apply_bitmask_


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from, and everything that decides how."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    masked_token_ids: list[int] = field(default_factory=list)  # EOS / stop ids under min_tokens
    generator: torch.Generator | None = None
    allowed_mask: torch.Tensor | None = None  # [V] bool, structured output


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1 + the number of tokens strictly more likely than this one
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, only on rows that ask for a penalty."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            )
            if seen.numel():
                values = logits[i, seen]
                logits[i, seen] = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty
                )
        if (p.frequency_penalty or p.presence_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab)[
                :vocab
            ]
            logits[i] -= p.frequency_penalty * counts.to(logits.dtype)
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _changes_logits(row: SamplingRow) -> bool:
    """Whether process_logits writes to this row's logits (the conditions of its steps)."""
    p = row.params
    return bool(
        p.logit_bias
        or row.masked_token_ids
        or row.allowed_mask is not None
        or p.repetition_penalty != 1.0
        or ((p.frequency_penalty or p.presence_penalty) and row.output_token_ids)
    )


def process_logits(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    bitmask: torch.Tensor | None = None,
    bitmask_rows: list[int] | None = None,
    on_triton: bool = False,
) -> torch.Tensor:
    """Steps 1-4 as float32 [N, V]: a new tensor where a step changes a value, else the logits
    themselves (a batch of plain greedy rows: copying 32 rows of a 49k vocabulary took 2% of a
    decode step), so callers never write to the result. `bitmask` [M, V/32] packs the allowed
    tokens of the constrained rows `bitmask_rows` (structured output); `on_triton` applies it with
    the Triton kernel, on the logits' device."""
    if bitmask is None and not any(_changes_logits(row) for row in rows):
        return logits.float()
    logits = logits.float().clone()
    if bitmask is not None and on_triton:
        from deepinfer.kernels.triton.bitmask import apply_bitmask_ as apply_on_device

        constrained = torch.tensor(bitmask_rows, dtype=torch.int64, device=logits.device)
        apply_on_device(logits, bitmask.to(logits.device, non_blocking=True), constrained)
    elif bitmask is not None:
        apply_bitmask_(logits, bitmask, bitmask_rows)
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor([int(t) for t in row.params.logit_bias], dtype=torch.long)
            logits[i, ids] += torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype)
        if row.masked_token_ids:
            logits[i, row.masked_token_ids] = float("-inf")
        if row.allowed_mask is not None:
            logits[i].masked_fill_(~row.allowed_mask[: logits.shape[-1]], float("-inf"))
    apply_penalties(logits, rows)
    return logits


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Step 6 for one non-greedy row: the final distribution [V] that is sampled from."""
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[0] = False
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw: one uniform number per token keeps seeded streams independent of the batch."""
    u = torch.rand(1, generator=generator, dtype=torch.float64).item()
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64)).item())
    index = min(index, probs.numel() - 1)
    while probs[index] == 0.0 and index > 0:  # guard against landing on a zeroed tail entry
        index -= 1
    return index


def truncated_probs_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """truncated_probs for many rows at once [M, V]; each row is computed independently of the
    others, so a row's result does not depend on what shares the batch."""
    vocab = logits.shape[-1]
    scaled = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        values = torch.topk(scaled, max(top_k), dim=-1).values  # [M, kmax]
        kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in top_k])[:, None])
        kth[torch.tensor([k == 0 for k in top_k])] = float("-inf")
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        index = torch.tensor(nucleus)
        sorted_probs, order = probs[index].sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        drop = before >= torch.tensor([params[i].top_p for i in nucleus], dtype=probs.dtype)[:, None]
        drop[:, 0] = False
        probs[index] = probs[index].masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
    floor = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if floor:
        index = torch.tensor(floor)
        min_p = torch.tensor([params[i].min_p for i in floor], dtype=probs.dtype)[:, None]
        selected = probs[index]
        probs[index] = selected.masked_fill(selected < min_p * selected.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def uniforms_for(generators: list[torch.Generator | None]) -> list[float]:
    """One uniform number per row, from the row's own generator when it has a seed."""
    return [torch.rand(1, generator=g, dtype=torch.float64).item() for g in generators]


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """Inverse-CDF draws for every row of probs [M, V] (as sample_from, batched)."""
    uniforms = uniforms_for(generators)
    cdf = probs.double().cumsum(-1)
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    picks = torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=probs.shape[-1] - 1).tolist()
    for i, index in enumerate(picks):
        while probs[i, index] == 0.0 and index > 0:  # guard against landing on a zeroed tail entry
            index -= 1
        picks[i] = index
    return picks


def sample_rows_on_triton(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Step 6 for non-greedy rows with the Triton kernels, on the logits' device: the truncation
    (temperature, top-k, top-p, min-p) and the inverse-CDF draw, one program per row. The
    uniforms come from the same generators as on the CPU path; the draw compares them in float32,
    so a seeded row may pick a neighbouring token where the CPU path's float64 CDF splits a tie."""
    from deepinfer.kernels.triton.sampling import draw, truncated_probs

    device = logits.device
    params = [row.params for row in rows]
    f32 = dict(dtype=torch.float32, device=device)
    probs = truncated_probs(
        logits,
        torch.tensor([p.temperature for p in params], **f32),
        torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int32, device=device),
        torch.tensor([p.top_p for p in params], **f32),
        torch.tensor([p.min_p for p in params], **f32),
    )
    uniforms = torch.tensor(uniforms_for([row.generator for row in rows]), **f32)
    return draw(probs, uniforms).tolist()


def _row_kernels(logits: torch.Tensor) -> RowwiseKernels | None:
    """rowwise.c's kernels where they take these logits (fp32 CPU rows [N, V > 0] and a C
    compiler), else None: torch answers."""
    if logits.is_cpu and logits.dtype is torch.float32 and logits.dim() == 2 and logits.shape[1]:
        return rowwise_kernels()
    return None


def draw_tokens(logits: torch.Tensor, rows: list[SamplingRow], drawn: list[int]) -> dict[int, int]:
    """Step 6 for the non-greedy rows `drawn` of logits [N, V] off Triton: {row: token}. fp32 CPU
    rows are drawn by rowwise.c's `draw_rows`, a few passes over each row and no [N, V]
    temporaries (32 rows of a 49k vocabulary on Zen 4: torch's softmax, float64 cumsum and
    searchsorted took ~15 ms a step, mostly faulting in their results, and top-p's sort ~70 ms);
    without a C compiler, truncated_probs_batch and sample_rows. Either way one uniform per row,
    from its own generator."""
    kernels = _row_kernels(logits)
    if kernels is not None:
        uniforms = uniforms_for([rows[i].generator for i in drawn])
        settings = [(p.temperature, p.top_k, p.top_p, p.min_p) for p in (rows[i].params for i in drawn)]
        return dict(zip(drawn, kernels.draw(logits, drawn, settings, uniforms)))
    probs = truncated_probs_batch(logits[drawn], [rows[i].params for i in drawn])
    return dict(zip(drawn, sample_rows(probs, [rows[i].generator for i in drawn])))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first largest value, a NaN first): the C kernel for fp32 CPU rows,
    torch.argmax elsewhere (the same answer)."""
    kernels = _row_kernels(logits)
    return kernels.argmax(logits) if kernels is not None else logits.argmax(dim=-1).tolist()


class Sampler:
    """`on_triton`: the grammar bitmask and step 6 run through kernels/triton (the engine on the
    Triton backend); penalties, biases and logprobs stay in torch on the logits' device."""

    def __init__(self, on_triton: bool = False) -> None:
        self.on_triton = on_triton

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: torch.Tensor | None = None,
        bitmask_rows: list[int] | None = None,
    ) -> list[SampledToken]:
        """logits: [N, V] for N rows -> one token per row."""
        processed = process_logits(logits, rows, bitmask, bitmask_rows, self.on_triton)
        drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
        tokens = greedy_tokens(processed) if len(drawn) < len(rows) else [0] * len(rows)
        if drawn and self.on_triton:
            for i, token in zip(drawn, sample_rows_on_triton(processed[drawn], [rows[i] for i in drawn])):
                tokens[i] = token
        elif drawn:
            for i, token in draw_tokens(processed, rows, drawn).items():
                tokens[i] = token
        out = [SampledToken(token) for token in tokens]
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if wanted:
            add_logprobs(processed, rows, wanted, out)
        return out


def _temperature(params: SamplingParams) -> float:
    """The temperature logprobs are taken at: the row's, 1 for a greedy row."""
    return params.temperature if params.temperature > 0 else 1.0


def add_logprobs(
    processed: torch.Tensor, rows: list[SamplingRow], wanted: list[int], out: list[SampledToken]
) -> None:
    """Step 5 for the rows `wanted` of processed [N, V], their tokens already in out: each token's
    logprob and rank and its row's top `logprobs` tokens, from log_softmax of the row divided by
    its temperature; written into out[i]. fp32 CPU rows through rowwise.c's `logprob_rows`
    (log_softmax, a rank and a top-k per row through torch took ~10 ms for 32 rows of a 49k
    vocabulary on Zen 4); a row it leaves (a NaN or +inf among its logits) and other devices
    through torch."""
    kernels = _row_kernels(processed)
    answers: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(wanted)
    if kernels is not None:
        answers = kernels.logprobs(
            processed,
            wanted,
            [_temperature(rows[i].params) for i in wanted],
            [out[i].token_id for i in wanted],
            [rows[i].params.logprobs or 0 for i in wanted],
        )
    for i, answer in zip(wanted, answers):
        k = rows[i].params.logprobs or 0
        if answer is None:
            logprobs = torch.log_softmax(processed[i] / _temperature(rows[i].params), dim=-1)
            token = out[i].token_id
            top = torch.topk(logprobs, k) if k else None
            answer = (
                float(logprobs[token]),
                int((logprobs > logprobs[token]).sum()) + 1,
                list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            )
        out[i].logprob, out[i].rank = answer[0], answer[1]
        if k:
            out[i].top_logprobs = answer[2]
