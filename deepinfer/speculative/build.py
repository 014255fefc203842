"""Assemble speculative decoding from the engine options, and profile the step costs it needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.model.loader.load import load_model
from deepinfer.speculative.batch import RowSpan, build_draft_step
from deepinfer.speculative.cost_model import (
    CostCurve,
    StepCostModel,
    cached_profile,
    synthetic_spans,
    time_shapes,
)
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.draft_model import DraftModelProposer
from deepinfer.speculative.length_policy import LengthPolicy
from deepinfer.speculative.mtp import MTPProposer
from deepinfer.speculative.ngram import NgramProposer
from deepinfer.speculative.proposer import Proposer
from deepinfer.speculative.stats import SpecDecodeStats

if TYPE_CHECKING:
    from deepinfer.engine.core import EngineCore
    from deepinfer.runner.model_runner import ModelRunner

METHODS = ("ngram", "draft", "mtp")
PROFILE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
PROFILE_CONTEXT = 128  # cached tokens before the profiled rows: a short, typical decode context
PROFILE_REPEATS = 3
MAX_CHUNK_OVERHEAD_SEQS = 8


def build_speculative_decoder(core: EngineCore) -> SpeculativeDecoder:
    config = core.config
    method = config.speculative_method
    if method not in METHODS:
        raise ValueError(f"speculative_method: expected one of {list(METHODS)} or None, got {method!r}")
    if not isinstance(config.num_speculative_tokens, int) or config.num_speculative_tokens < 1:
        raise ValueError(
            f"num_speculative_tokens: must be an integer >= 1, got {config.num_speculative_tokens!r}"
        )
    if config.speculative_length not in ("fixed", "dynamic"):
        raise ValueError(
            f"speculative_length: expected 'fixed' or 'dynamic', got {config.speculative_length!r}"
        )
    if config.speculative_model is not None and method != "draft":
        raise ValueError(f"speculative_model: only used with speculative_method='draft', not {method!r}")
    device, dtype = config.torch_device(), config.torch_dtype()
    proposer = _proposer(core, method, device, dtype)
    max_k = config.num_speculative_tokens
    cost = None
    if config.speculative_length == "dynamic":
        max_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * (max_k + 1))
        cost = profile_step_cost(core.runner, proposer, max_tokens, config.max_num_seqs, core.num_blocks)
    stats = SpecDecodeStats(
        method, config.speculative_length, max_k, cost_model=cost.to_dict() if cost else None
    )
    return SpeculativeDecoder(proposer, LengthPolicy(config.speculative_length, max_k, cost), stats)


def _proposer(core: EngineCore, method: str, device: torch.device, dtype: torch.dtype) -> Proposer:
    config = core.config
    if method == "ngram":
        return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    if method == "mtp":
        return MTPProposer(core.loaded.model, core.num_blocks, config.block_size, device, dtype)
    draft = (
        core.loaded
        if config.speculative_model is None
        else load_model(config.speculative_model, dtype, device, config.quantization)
    )
    if draft.config.vocab_size != core.loaded.config.vocab_size:
        raise ValueError(
            f"speculative_model: vocabulary of {draft.config.vocab_size} tokens differs from the target's "
            f"{core.loaded.config.vocab_size}; a draft model must share the target's tokenizer"
        )
    if draft.config.max_position_embeddings < core.max_model_len:
        raise ValueError(
            f"speculative_model: its context of {draft.config.max_position_embeddings} tokens is shorter than "
            f"max_model_len={core.max_model_len}; set max_model_len to at most that"
        )
    return DraftModelProposer(
        draft.model, core.num_blocks, config.block_size, device, dtype, config.attention_backend
    )


def _target_forward(runner: ModelRunner):
    """A verification-shaped forward: the target over the spans, logits at every row."""

    def forward(spans: list[RowSpan]) -> None:
        step = build_draft_step(spans, runner.block_size, runner.device)
        runner.backend.prepare(step.meta)
        hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta, runner.backend)
        runner.model.compute_logits(hidden)

    return forward


@torch.inference_mode()
def profile_step_cost(
    runner: ModelRunner, proposer: Proposer, max_tokens: int, max_seqs: int, num_blocks: int
) -> StepCostModel:
    """Time the target at a few batch sizes, the chunk overhead, and a drafting round; reused by
    engines sharing the same weights in this process. Runs at startup, when every block is free.

    The batch-size curve is taken on decode rows (n sequences of one token each, what a step
    without speculation runs); the chunk overhead is what verifying a sequence costs beyond its
    tokens: s sequences of 2 tokens (chunks) against 2s decode rows, per sequence."""
    bs = runner.block_size
    # Every count up to the largest step, and one beyond it, so no step is extrapolated.
    counts = tuple(n for i, n in enumerate(PROFILE_COUNTS) if i == 0 or PROFILE_COUNTS[i - 1] < max_tokens)
    key = ("target", counts, max_seqs, bs, num_blocks, str(runner.device), torch.get_num_threads())
    forward = _target_forward(runner)

    def measure() -> tuple[CostCurve, float]:
        shapes, measured = [], []
        for n in counts:
            spans = synthetic_spans(n, 1, PROFILE_CONTEXT, bs, num_blocks)
            if spans is None:
                break
            shapes.append(spans)
            measured.append(n)
        seqs = min(max_seqs, MAX_CHUNK_OVERHEAD_SEQS)
        chunks = synthetic_spans(seqs, 2, PROFILE_CONTEXT, bs, num_blocks)
        rows = synthetic_spans(2 * seqs, 1, PROFILE_CONTEXT, bs, num_blocks) if chunks else None
        extra = [chunks, rows] if chunks and rows else []
        seconds = time_shapes(forward, shapes + extra, PROFILE_REPEATS)
        verify = CostCurve(measured, seconds[: len(measured)])
        overhead = max(0.0, (seconds[-2] - seconds[-1]) / seqs) if extra else 0.0
        return verify, overhead

    verify, overhead = cached_profile(runner.model, key, measure)
    draft_round = None
    if proposer.has_confidence:
        draft_key = (
            proposer.name,
            min(max_seqs, 64),
            bs,
            num_blocks,
            str(runner.device),
            torch.get_num_threads(),
        )
        owner = getattr(proposer, "model", runner.model)
        draft_round = cached_profile(
            owner, draft_key, lambda: proposer.profile_round(min(max_seqs, 64), PROFILE_REPEATS)
        )
    return StepCostModel(verify, overhead, draft_round)
