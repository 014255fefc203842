"""The one place where a step's plan becomes tensors: inputs, attention metadata, forward, sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.attention.backend import AttentionBackend, TorchReferenceBackend
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.engine.grammar import GrammarManager
from deepinfer.model.base import CausalLM, KVCacheSpec
from deepinfer.runner.sampler import SampledToken, Sampler, SamplingRow
from deepinfer.sequence import Sequence
from deepinfer.step import ScheduledSequence, SchedulerOutput
from deepinfer.structured.bitmask import allocate_bitmask

if TYPE_CHECKING:
    from deepinfer.speculative.decoder import SpeculativeDecoder

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class StepResult:
    sampled: dict[int, list[SampledToken]]  # seq_id -> tokens this step


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        # Zeroed, not empty: masked attention weights multiply unused slots, and NaN * 0 is NaN.
        self.kv_caches = [
            torch.zeros((num_slots, *kv_spec.slot_shape), dtype=kv_spec.dtype, device=device)
            for _ in range(kv_spec.num_layers)
        ]
        self.backend = make_attention_backend(attention_backend, model, block_size, device, kv_spec.dtype)
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}
        self.grammars: GrammarManager | None = None  # set by the engine core
        # Speculative decoding (deepinfer.speculative.decoder.SpeculativeDecoder), set by the engine core:
        # drafts the reserved slots before the forward and verifies them after it.
        self.speculator: SpeculativeDecoder | None = None

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)
        if self.speculator is not None:
            self.speculator.release(seq_ids)

    def _block_slots(self, block_ids: list[int]) -> torch.Tensor:
        offsets = torch.arange(self.block_size)
        return (
            (torch.tensor(block_ids, dtype=torch.long)[:, None] * self.block_size + offsets)
            .flatten()
            .to(self.device)
        )

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """KV of whole blocks as a host array [layers, tokens, *slot_shape] (for the KV store)."""
        slots = self._block_slots(block_ids)
        return torch.stack([cache[slots] for cache in self.kv_caches]).cpu().numpy()

    def write_blocks(self, block_ids: list[int], kv: np.ndarray) -> None:
        """Inverse of read_blocks: fill whole blocks from a host array."""
        slots = self._block_slots(block_ids)
        data = torch.from_numpy(np.array(kv)).to(self.device)  # a writable copy: store buffers are read-only
        if data.shape != (len(self.kv_caches), len(slots), *self.kv_caches[0].shape[1:]):
            raise ValueError(f"KV chunk of shape {tuple(data.shape)} does not fit {len(block_ids)} blocks")
        for layer, cache in enumerate(self.kv_caches):
            cache[slots] = data[layer].to(cache.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        bs = self.block_size
        src = torch.tensor([s * bs + o for s, _ in copies for o in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + o for _, d in copies for o in range(bs)], device=self.device)
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    def _prepare(
        self, items: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for item in items:
            seq = item.seq
            num_real = item.num_new_tokens - item.num_draft_tokens
            token_ids.extend(seq.token_ids[item.start : item.start + num_real])
            token_ids.extend(item.draft_token_ids[: item.num_draft_tokens])
            pos = np.arange(item.start, item.start + item.num_new_tokens, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        max_blocks = max(len(item.seq.block_table) for item in items)
        tables = np.zeros((len(items), max_blocks), dtype=np.int64)
        for i, item in enumerate(items):
            tables[i, : len(item.seq.block_table)] = item.seq.block_table
        seq_lens = [item.start + item.num_new_tokens for item in items]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
            block_tables=torch.from_numpy(tables).to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            query_lens=[item.num_new_tokens for item in items],
            seq_lens_list=seq_lens,
            num_decodes=sum(1 for item in items if item.num_new_tokens == 1),
            block_size=bs,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, torch.from_numpy(np.concatenate(positions)).to(self.device), meta

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
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

    def _grammar_bitmask(self, owners: list[Sequence]) -> tuple[torch.Tensor | None, list[int]]:
        """One packed bitmask for the constrained rows (structured output); unconstrained rows pay nothing."""
        constrained = [i for i, seq in enumerate(owners) if seq.grammar is not None]
        if not constrained or self.grammars is None:
            return None, []
        backend = self.grammars.backend
        bitmask = allocate_bitmask(len(constrained), backend.tokenizer_info.vocab_size)
        backend.fill_bitmasks([(owners[i].grammar, row) for row, i in enumerate(constrained)], bitmask)
        return bitmask, constrained

    @torch.inference_mode()
    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits [L, V] at every position of a sequence whose blocks are allocated (scoring, tests)."""
        item = ScheduledSequence(seq, seq.num_tokens, 0, sample=False)
        input_ids, positions, meta = self._prepare([item])
        self.backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.copy_blocks(plan.block_copies)
        if self.speculator is not None:
            self.speculator.propose(self, plan)  # fills the reserved draft slots
        # Decodes (query length 1) first: the attention backend batches them in one kernel call.
        items = sorted(plan.scheduled, key=lambda item: item.num_new_tokens != 1)
        input_ids, positions, meta = self._prepare(items)
        self.backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)  # [T, hidden]

        ends = np.cumsum(meta.query_lens) - 1
        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[Sequence] = []
        for i, item in enumerate(items):
            if not item.sample or item.num_draft_tokens:  # drafted rows are verified below
                continue
            for seq in (item.seq, *item.forks):
                hidden_rows.append(int(ends[i]))
                rows.append(self._sampling_row(seq))
                owners.append(seq)
        sampled: dict[int, list[SampledToken]] = {}
        if rows:
            index = torch.tensor(hidden_rows, dtype=torch.long, device=self.device)
            # Forks share their parent's row: compute logits once per distinct row.
            unique, inverse = torch.unique(index, return_inverse=True)
            logits = self.model.compute_logits(hidden[unique])[inverse]  # [N, V]
            bitmask, constrained = self._grammar_bitmask(owners)
            tokens = self.sampler(logits, rows, bitmask, constrained)
            for i in constrained:
                owners[i].grammar.accept_token(tokens[i].token_id)
            sampled = {seq.seq_id: [token] for seq, token in zip(owners, tokens)}
        if self.speculator is not None:
            sampled |= self.speculator.verify(self, items, hidden, meta.query_lens, sampled)
        return StepResult(sampled)
