"""Assemble speculative decoding from the engine options, and profile the step costs it needs."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.cache_layout import CacheGroup
from deepinfer.config import EngineConfig
from deepinfer.model.base import CausalLM
from deepinfer.model.loader.load import LoadedModel, load_model
from deepinfer.runner.inputs import RowSpan
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.speculative.confidence_policy import ConfidencePolicy
from deepinfer.speculative.cost_model import (
    CostCurve,
    StepCostModel,
    cached_profile,
    synthetic_spans,
    time_shapes,
)
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.draft_model import DraftModelProposer
from deepinfer.speculative.dspark import DSparkProposer
from deepinfer.speculative.length_policy import LengthPolicy
from deepinfer.speculative.mtp import MTPProposer
from deepinfer.speculative.ngram import NgramProposer
from deepinfer.speculative.proposer import Proposer
from deepinfer.speculative.stats import SpecDecodeStats

PROFILE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
PROFILE_CONTEXT = 128  # cached tokens before the profiled rows: a short, typical decode context
PROFILE_REPEATS = 3
MAX_CHUNK_OVERHEAD_SEQS = 8


def load_draft_model(
    config: EngineConfig, target: LoadedModel, max_model_len: int, dtype: torch.dtype, device: torch.device
) -> LoadedModel | None:
    """The model that drafts for `speculative_method="draft"` (the target itself when no
    `speculative_model` is given); None for the other methods."""
    spec = config.speculative
    if spec.speculative_method != "draft":
        return None
    if spec.speculative_model is None:
        return target
    # The draft places the same positions as the target: it takes the same RoPE scaling.
    draft = load_model(
        spec.speculative_model, dtype, device, config.quantization, rope_scaling=config.rope_scaling
    )
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_model: vocabulary of {draft.config.vocab_size} tokens differs from the target's "
            f"{target.config.vocab_size}; a draft model must share the target's tokenizer"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_model: its context of {draft.config.max_position_embeddings} tokens is shorter than "
            f"max_model_len={max_model_len}; set max_model_len to at most that"
        )
    return draft


def proposer_cache_groups(
    method: str | None, target: CausalLM, draft: LoadedModel | None, kv_dtype: torch.dtype
) -> dict[str, list[CacheGroup]]:
    """The caches the proposer keeps beside the target's, by owner, so that one budget sizes
    them all: a draft model's KV, or the MTP modules' latents."""
    if method == "draft":
        assert draft is not None
        return {"draft": draft.model.cache_groups(kv_dtype, owner="draft")}
    if method == "mtp":
        groups = target.mtp_cache_groups(kv_dtype) if hasattr(target, "mtp_cache_groups") else []
        if not groups:
            raise ValueError(
                "speculative_method='mtp' needs a model with multi-token-prediction weights "
                f"(DeepSeek-V3 or V4 family with num_nextn_predict_layers > 0); {type(target).__name__} has none"
            )
        return {"mtp": groups}
    return {}


def build_speculative_decoder(
    config: EngineConfig, runner: ModelRunner, caches: KVCaches, draft: LoadedModel | None
) -> SpeculativeDecoder:
    spec, scheduler = config.speculative, config.scheduler
    method = spec.speculative_method
    proposer: Proposer
    if method == "ngram":
        proposer = NgramProposer(spec.speculative_ngram_min, spec.speculative_ngram_max)
    elif method == "mtp":
        proposer = MTPProposer(runner.model, caches.view("mtp"))
    elif method == "dspark":
        proposer = dspark_proposer(runner)
    else:
        assert draft is not None
        proposer = DraftModelProposer(draft.model, caches.view("draft"), config.attention_backend)
    max_k = spec.num_speculative_tokens
    cost = None
    if spec.speculative_length in ("dynamic", "confidence"):
        max_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (max_k + 1))
        cost = profile_step_cost(runner, proposer, max_tokens, scheduler.max_num_seqs)
    stats = SpecDecodeStats(
        method, spec.speculative_length, max_k, cost_model=cost.to_dict() if cost else None
    )
    return SpeculativeDecoder(
        proposer,
        LengthPolicy(spec.speculative_length, max_k, cost),
        stats,
        runner.sampling_row,
        runner.compute_logits,
        ConfidencePolicy(cost) if cost is not None and spec.speculative_length == "confidence" else None,
    )


def feature_layers(config: EngineConfig, model: CausalLM) -> tuple[int, ...]:
    """The target layers whose features every step keeps for the proposer, handed to the runner
    at construction: DSpark drafts from its layers' features; other methods need none."""
    if not config.speculative.enabled or config.speculative.speculative_method != "dspark":
        return ()
    return tuple(_dspark_layers(model).spec.target_layer_ids)


def dspark_proposer(runner: ModelRunner) -> DSparkProposer:
    """DSpark over the target's own draft layers (the runner keeps their target features)."""
    return DSparkProposer(_dspark_layers(runner.model))


def _dspark_layers(model: CausalLM) -> Any:  # the V4.1 model's DSparkV41
    drafter = getattr(model, "dspark", None)
    if drafter is None:  # check_engine refuses this first for an HF directory
        raise ValueError(
            f"speculative_method='dspark' needs DeepSeek-V4.1's DSpark layers; {type(model).__name__} has none"
        )
    return drafter


def _target_forward(runner: ModelRunner):
    """A verification-shaped forward: the target over the spans, logits at every row."""

    def forward(spans: list[RowSpan]) -> None:
        runner.compute_logits(runner.forward(runner.view.inputs(spans), spans))

    return forward


@torch.inference_mode()
def profile_step_cost(
    runner: ModelRunner, proposer: Proposer, max_tokens: int, max_seqs: int
) -> StepCostModel:
    """Time the target at a few batch sizes, the chunk overhead, and a drafting round; reused by
    engines sharing the same weights in this process. Runs at startup, when every block is free.

    The batch-size curve is taken on decode rows (n sequences of one token each, what a step
    without speculation runs); the chunk overhead is what verifying a sequence costs beyond its
    tokens: s sequences of 2 tokens (chunks) against 2s decode rows, per sequence."""
    groups = runner.view.groups
    sizes = tuple((g.block_tokens, g.num_blocks) for g in groups)
    # Every count up to the largest step, and one beyond it, so no step is extrapolated.
    counts = tuple(n for i, n in enumerate(PROFILE_COUNTS) if i == 0 or PROFILE_COUNTS[i - 1] < max_tokens)
    key = ("target", counts, max_seqs, sizes, str(runner.device), torch.get_num_threads())
    forward = _target_forward(runner)

    def measure() -> tuple[CostCurve, float]:
        shapes, measured = [], []
        for n in counts:
            spans = synthetic_spans(n, 1, PROFILE_CONTEXT, groups)
            if spans is None:
                break
            shapes.append(spans)
            measured.append(n)
        seqs = min(max_seqs, MAX_CHUNK_OVERHEAD_SEQS)
        chunks = synthetic_spans(seqs, 2, PROFILE_CONTEXT, groups)
        rows = synthetic_spans(2 * seqs, 1, PROFILE_CONTEXT, groups) if chunks else None
        extra = [chunks, rows] if chunks and rows else []
        seconds = time_shapes(forward, shapes + extra, PROFILE_REPEATS)
        verify = CostCurve(measured, seconds[: len(measured)])
        overhead = max(0.0, (seconds[-2] - seconds[-1]) / seqs) if extra else 0.0
        return verify, overhead

    verify, overhead = cached_profile(runner.model, key, measure)
    draft_round = None
    if proposer.has_confidence:
        draft_key = (proposer.name, min(max_seqs, 64), sizes, str(runner.device), torch.get_num_threads())
        owner = getattr(proposer, "model", runner.model)
        draft_round = cached_profile(
            owner, draft_key, lambda: proposer.profile_round(min(max_seqs, 64), PROFILE_REPEATS)
        )
    return StepCostModel(verify, overhead, draft_round)
