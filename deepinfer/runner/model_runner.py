"""The one place where a step's plan becomes tensors: inputs, attention metadata, forward, sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.attention.backend import AttentionBackend, TorchReferenceBackend
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.model.base import CausalLM
from deepinfer.runner.inputs import ForwardInputs, RowSpan
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.sampler import SampledToken, Sampler, SamplingRow
from deepinfer.sequence import Sequence
from deepinfer.step import ScheduledSequence, SchedulerOutput
from deepinfer.structured.backend import GrammarMatcher

log = logging.getLogger(__name__)

# One packed allowed-token bitmask row per matcher (structured output), and the rows whose
# matcher failed.
GrammarMasks = Callable[[list[GrammarMatcher]], tuple[torch.Tensor, list[int]]]


def make_attention_backend(
    name: str,
    model: CausalLM,
    block_size: int,
    device: torch.device,
    kv_dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """`auto` picks the C kernel backend on CPU when it builds and fits the model, else the reference."""
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchReferenceBackend()
    from deepinfer.attention.cpu_paged import CpuPagedBackend

    cfg = model.config
    fits = CpuPagedBackend.supports(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, kv_dtype)
    try:
        if fits or name == "cpu_paged":
            return CpuPagedBackend()
    except RuntimeError:
        if name == "cpu_paged":
            raise
        log.warning("C attention kernel unavailable; falling back to the PyTorch reference backend")
    return TorchReferenceBackend()


def seed_generator(seed: int, index: int) -> torch.Generator:
    """Each choice of a seeded request gets its own stream (mixing the index into the seed)."""
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + index * 7919) % (1 << 63))
    return generator


def prepare_backend(backend: AttentionBackend, meta: ForwardMetadata) -> None:
    """Per-step precomputation of the backend, for every cache group."""
    for group in meta.groups:
        backend.prepare(group)


@dataclass(slots=True)
class StepResult:
    """What a step's forward produced: tokens of the sampling sequences, and what speculative
    verification needs (hidden states of every row, the order the runner laid the items out in,
    and each item's first row)."""

    sampled: dict[int, list[SampledToken]]  # seq_id -> tokens this step
    # request_id -> why this step could not serve one of its sequences (its grammar, its sampling
    # parameters); the engine ends those requests, nothing else.
    failures: dict[str, str] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # [T, hidden]
    items: list[ScheduledSequence] | None = None
    offsets: list[int] | None = None

    def token_ids(self) -> dict[int, list[int]]:
        """seq_id -> the ids of this step's tokens."""
        return {seq_id: [t.token_id for t in tokens] for seq_id, tokens in self.sampled.items()}


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        caches: KVCaches,
        device: torch.device,
        attention_backend: str = "auto",
        grammar_masks: GrammarMasks | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        self.view = caches.view("target")
        self.kv_caches = self.view.tensors
        kv_dtype = self.kv_caches[0].dtype
        self.backend = make_attention_backend(
            attention_backend, model, self.view.groups[0].entries_per_block, device, kv_dtype
        )
        self.sampler = Sampler()
        self.grammar_masks = grammar_masks
        self._generators: dict[int, torch.Generator] = {}

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """The target's hidden states [T, hidden] for `inputs`, writing their KV."""
        prepare_backend(self.backend, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        """How `seq` samples its next token (its generator created on first use)."""
        params = seq.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                generator = self._generators[seq.seq_id] = seed_generator(params.seed, seq.index)
        masked: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            masked = list(params.stop_token_ids) + (
                [] if params.ignore_eos else list(seq.request.eos_token_ids)
            )
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            output_token_ids=seq.output_token_ids,
            masked_token_ids=masked,
            generator=generator,
        )

    def _grammar_bitmask(
        self, owners: list[Sequence], failures: dict[str, str]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """One packed bitmask for the constrained rows (structured output); unconstrained rows pay
        nothing. A matcher that fails ends its request (recorded in `failures`)."""
        constrained = [i for i, seq in enumerate(owners) if seq.grammar is not None]
        if not constrained or self.grammar_masks is None:
            return None, []
        bitmask, failed = self.grammar_masks([owners[i].grammar for i in constrained])
        for row in failed:
            failures[owners[constrained[row]].request_id] = "internal error in the structured-output grammar"
        return bitmask, constrained

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        owners: list[Sequence],
        bitmask: torch.Tensor | None,
        constrained: list[int],
        failures: dict[str, str],
    ) -> list[SampledToken | None]:
        """The sampler over every row; if the batch fails, row by row, so only a row at fault
        (recorded in `failures`, its token None) fails."""
        try:
            return list(self.sampler(logits, rows, bitmask, constrained))
        except Exception:
            log.exception("sampling failed; isolating the row at fault")
        tokens: list[SampledToken | None] = []
        for i, row in enumerate(rows):
            mask = None
            if i in constrained and bitmask is not None:
                j = constrained.index(i)
                mask = bitmask[j : j + 1]
            try:
                tokens.append(
                    self.sampler(logits[i : i + 1], [row], mask, [0] if mask is not None else [])[0]
                )
            except Exception:
                failures[owners[i].request_id] = "internal error while sampling"
                tokens.append(None)
        return tokens

    def _span(self, item: ScheduledSequence) -> RowSpan:
        seq = item.seq
        num_real = item.num_new_tokens - item.num_draft_tokens
        tokens = (
            seq.token_ids[item.start : item.start + num_real] + item.draft_token_ids[: item.num_draft_tokens]
        )
        return RowSpan(self.view.tables(seq), item.start, tokens)

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits [L, V] at every position of a sequence whose blocks are allocated (scoring, tests)."""
        hidden = self.forward(self.view.inputs([RowSpan(self.view.tables(seq), 0, list(seq.token_ids))]))
        return self.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Copy blocks, run the forward of every scheduled item (drafts included), and sample the
        items that end at their last token and carry no drafts (the verifier samples those)."""
        self.caches.copy_blocks(plan.block_copies)
        items = plan.scheduled
        inputs = self.view.inputs([self._span(item) for item in items])
        hidden = self.forward(inputs)  # [T, hidden]

        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[Sequence] = []
        for item, offset in zip(items, inputs.offsets):
            if not item.sample or item.num_draft_tokens:
                continue
            for seq in (item.seq, *item.forks):
                hidden_rows.append(offset + item.num_new_tokens - 1)
                rows.append(self.sampling_row(seq))
                owners.append(seq)
        sampled: dict[int, list[SampledToken]] = {}
        failures: dict[str, str] = {}
        if rows:
            index = torch.tensor(hidden_rows, dtype=torch.long, device=self.device)
            # Forks share their parent's row: compute logits once per distinct row.
            unique, inverse = torch.unique(index, return_inverse=True)
            logits = self.compute_logits(hidden[unique])[inverse]  # [N, V]
            bitmask, constrained = self._grammar_bitmask(owners, failures)
            tokens = self._sample(logits, rows, owners, bitmask, constrained, failures)
            for i in constrained:
                token = tokens[i]
                if token is None or owners[i].request_id in failures:
                    continue
                try:
                    owners[i].grammar.accept_token(token.token_id)
                except Exception:
                    log.exception("the grammar of %s failed", owners[i].request_id)
                    failures[owners[i].request_id] = "internal error in the structured-output grammar"
            sampled = {
                seq.seq_id: [token]
                for seq, token in zip(owners, tokens)
                if token is not None and seq.request_id not in failures
            }
        return StepResult(sampled, failures, hidden, list(items), inputs.offsets)
