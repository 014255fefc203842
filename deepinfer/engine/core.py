"""The engine core: schedule, run, update. Token ids in, token ids out; no text, no API formats."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from deepinfer.engine.grammar import GrammarManager
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.kv_offload import KVOffloader
from deepinfer.engine.outputs import SequenceOutput, TokenLogprobs
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig, SequenceUpdate
from deepinfer.model.loader.load import LoadedModel, load_model
from deepinfer.runner.model_runner import ModelRunner, StepResult
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.store import KVStoreConfig, build_kv_store

if TYPE_CHECKING:
    from deepinfer.speculative.decoder import SpeculativeDecoder
    from deepinfer.speculative.stats import SpecDecodeStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefix_lookups: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_evictions: int
    prefix_cached_blocks: int
    num_preemptions: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        device, dtype = config.torch_device(), config.torch_dtype()
        self.loaded = loaded or load_model(config.model, dtype, device, config.quantization)
        if self.loaded.quantization != config.quantization:
            raise ValueError(
                f"quantization={config.quantization!r} but the model given was loaded with "
                f"{self.loaded.quantization!r}"
            )
        model_cfg = self.loaded.config
        self.kv_spec = self.loaded.model.kv_cache_spec(self._kv_dtype(dtype))
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings
        )
        self.num_blocks = self._num_blocks(device)
        self.fingerprint = f"{self.loaded.weights_fingerprint}:{self.kv_spec.layout()}"
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_chunk_size=config.prefill_chunk_size,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
            ),
            self.kv,
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_spec,
            self.num_blocks,
            config.block_size,
            device,
            config.attention_backend,
        )
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_method is not None:
            from deepinfer.speculative.build import build_speculative_decoder

            self.spec = build_speculative_decoder(self)
            self.runner.speculator = self.spec
        self.offloader = self._build_offloader()
        # On the CPU the model has every core: masks are computed inline rather than by a pool.
        self.grammars = GrammarManager(
            self.loaded.tokenizer,
            model_cfg.vocab_size,
            config.grammar_compile_timeout,
            mask_threads=0 if device.type == "cpu" else None,
        )
        self.runner.grammars = self.grammars
        self.num_preemptions = 0
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%d bytes/token), attention=%s",
            self.loaded.name,
            self.num_blocks,
            config.block_size,
            self.kv_spec.bytes_per_token,
            self.runner.backend.name,
        )

    def _kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        choice = self.config.kv_cache_dtype
        if choice == "auto":
            return model_dtype
        if choice != "float16":
            raise ValueError(f"kv_cache_dtype: expected 'auto' or 'float16', got {choice!r}")
        if not self.loaded.model.supports_kv_cache_dtype:
            raise ValueError(
                f"kv_cache_dtype={choice!r}: {type(self.loaded.model).__name__} keeps its KV cache "
                "in the model's dtype"
            )
        return torch.float16

    def _build_offloader(self) -> KVOffloader | None:
        c = self.config
        store = build_kv_store(
            KVStoreConfig.from_cli(
                c.kv_store, c.kv_host_cache_bytes, c.kv_retention, c.kv_store_max_bytes, c.kv_chunk_blocks
            )
        )
        if store is None:
            return None
        if not c.enable_prefix_caching:
            raise ValueError("kv_store / kv_host_cache_bytes need prefix caching (enable_prefix_caching)")
        return KVOffloader(store, self.kv, self.runner)

    def close(self) -> None:
        """Flush pending KV-store writes and stop background threads."""
        if self.offloader is not None:
            self.offloader.close()
            self.offloader = None
        self.grammars.close()

    def _num_blocks(self, device: torch.device) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * 0.9)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        return max(budget // (self.config.block_size * self.kv_spec.bytes_per_token), 1)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_spec.bytes_per_token

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        root = namespace_root(self.fingerprint, request.cache_salt)
        seq = self.scheduler.add_request(request, root)
        if request.grammar is not None:
            self.grammars.attach(seq, request.grammar)
        if self.offloader is not None:
            self.offloader.prefetch(seq)

    def abort(self, request_id: str, index: int | None = None) -> list[SequenceOutput]:
        """Abort a request (or one of its sequences); its blocks are free when this returns."""
        seqs = self.scheduler.abort_request(request_id, index)
        if index is None:
            self.grammars.release(request_id)
        self.runner.release([s.seq_id for s in seqs])
        return [
            SequenceOutput(
                request_id, s.index, [], finish_reason="abort", num_prompt_tokens=s.num_prompt_tokens
            )
            for s in seqs
        ]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        began = time.perf_counter()
        failed = self._poll_pending()
        draft_lengths = self.spec.plan(self.scheduler) if self.spec is not None else None
        plan = self.scheduler.schedule(draft_lengths)
        self.num_preemptions += len(plan.preempted)
        for item in plan.scheduled:
            for child in item.forks:
                self.grammars.fork(child)
        if plan.is_empty:
            if self.scheduler.waiting and not failed:
                time.sleep(0.001)  # everything waits on a KV load or a grammar: don't spin a core
            return failed
        result = self.runner.execute(plan)
        updates = self.scheduler.update(plan, {k: [t.token_id for t in v] for k, v in result.sampled.items()})
        outputs = failed + [self._output(update, result) for update in updates]
        if self.spec is not None:
            self.spec.observe_step(time.perf_counter() - began, plan)
        return outputs

    def _poll_pending(self) -> list[SequenceOutput]:
        """Land finished KV loads and grammar compiles; a grammar that failed ends its request."""
        if self.offloader is not None:
            self.offloader.poll()
        outputs = []
        for seq, error in self.grammars.poll():
            for out in self.abort(seq.request_id):
                out.finish_reason, out.error = "error", error
                outputs.append(out)
        return outputs

    def _output(self, update: SequenceUpdate, result: StepResult) -> SequenceOutput:
        seq: Sequence = update.seq
        out = SequenceOutput(
            seq.request_id,
            seq.index,
            update.new_token_ids,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            num_prompt_tokens=seq.num_prompt_tokens,
        )
        if seq.params.logprobs is not None and update.new_token_ids:
            sampled = result.sampled[seq.seq_id][: len(update.new_token_ids)]
            out.logprobs = [
                TokenLogprobs(
                    t.logprob,
                    t.rank,
                    [i for i, _ in t.top_logprobs or []],
                    [lp for _, lp in t.top_logprobs or []],
                )
                for t in sampled
            ]
        if update.finished:
            out.finish_reason = str(seq.finish_reason)
            out.stop_reason = seq.stop_reason
            self.runner.release([seq.seq_id])
            if not self.scheduler.sequences_of(seq.request_id):
                self.grammars.release(seq.request_id)
        return out

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] for every position of `token_ids`, using blocks borrowed from the pool."""
        seq = Sequence(
            -1, EngineRequest("score", token_ids, SamplingParams()), 0, list(token_ids), len(token_ids), b""
        )
        if not self.kv.can_allocate(seq, len(token_ids)):
            raise RuntimeError("not enough free KV blocks to score this sequence")
        self.kv.allocate(seq, len(token_ids))
        try:
            return self.runner.prompt_logits(seq)
        finally:
            self.kv.free(seq)

    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative-decoding counters (None when speculation is off)."""
        return self.spec.stats if self.spec is not None else None

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free,
            num_blocks=pool.num_blocks,
            prefix_lookups=pool.stats.lookups,
            prefix_queried_tokens=pool.stats.queried_tokens,
            prefix_hit_tokens=pool.stats.hit_tokens,
            prefix_evictions=pool.stats.evictions,
            prefix_cached_blocks=pool.num_cached,
            num_preemptions=self.num_preemptions,
        )
