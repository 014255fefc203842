"""The engine core: schedule, run, update. Token ids in, token ids out; no text, no API formats."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deepinfer.cache_layout import CacheGroup, CacheLayout, plan_cache_layout
from deepinfer.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from deepinfer.config.rope import check_context_length
from deepinfer.engine.grammar import GrammarManager
from deepinfer.engine.image_pull import ImagePuller
from deepinfer.engine.kv_cache.events import KVEvent, KVEventLog
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.kv_connector import ConnectorChain, KVConnector
from deepinfer.engine.kv_offload import KVOffloader, TierEvents
from deepinfer.engine.kv_pd import DecodeReceiver, PrefillHandoff
from deepinfer.engine.outputs import KVHandoff, SequenceOutput, TokenLogprobs
from deepinfer.engine.parallel.context import RankContext, rank_threads
from deepinfer.engine.scheduler import Scheduler, SequenceUpdate
from deepinfer.engine.stats import EngineStats
from deepinfer.image_input import check_images, embeddings_layout
from deepinfer.kernels import isa
from deepinfer.kernels.openmp import release_thread_pool
from deepinfer.model.base import CausalLM
from deepinfer.model.layers.expert_parallel import ExpertBalancer
from deepinfer.model.loader.dtype import engine_dtype, model_dtype
from deepinfer.model.loader.load import LoadedModel, check_model_engine, load_model
from deepinfer.runner.device import torch_device
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import ModelRunner, PreparedStep, StepResult
from deepinfer.sampling_params import SamplingParams
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.speculative.build import build_speculative_decoder, load_draft_model, proposer_cache_groups
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.stats import SpecDecodeStats
from deepinfer.step import SchedulerOutput
from deepinfer.store import build_kv_store

log = logging.getLogger(__name__)


def check_model_options(config: EngineConfig, loaded: LoadedModel) -> None:
    """Options that depend on the model, checked before any cache is allocated."""
    if loaded.quantization != config.quantization:
        raise ValueError(
            f"quantization={config.quantization!r} but the model given was loaded with {loaded.quantization!r}"
        )
    if config.cache.kv_cache_dtype != "auto" and not loaded.model.supports_kv_cache_dtype:
        raise ValueError(
            f"kv_cache_dtype={config.cache.kv_cache_dtype!r}: {type(loaded.model).__name__} keeps its KV "
            "cache in the model's dtype"
        )


def engine_device(config: EngineConfig, parallel: RankContext | None) -> torch.device:
    """The device of this rank (on CUDA, one per rank of the machine)."""
    device = torch_device(config.device)
    if device.type == "cuda" and parallel is not None and device.index is None:
        return torch.device("cuda", parallel.topology.local_rank)
    return device


def kv_cache_dtype(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's element type. `auto`: fp16 for a model running on a GGUF's own blocks, as
    llama.cpp keeps it (batched decode reads the cache more than the weights, and half the bytes
    is most of its time); fp16 for a bf16 model on the CPU too, since the C attention kernel
    reads fp16 (F16C) and not bf16, and every bf16 K/V value in fp16's range (|x| < 65504)
    converts exactly, in the same bytes; the model's dtype otherwise."""
    choice = config.cache.kv_cache_dtype
    if choice == "auto":
        packed = loaded.resolved_quantization == "gguf" and loaded.model.supports_kv_cache_dtype
        bf16_cpu = dtype == torch.bfloat16 and device.type == "cpu" and loaded.model.supports_kv_cache_dtype
        return torch.float16 if packed or bf16_cpu else dtype
    if choice == "float32" and dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype='float32' needs an fp32 model; this one computes in {dtype}")
    return torch.float16 if choice == "float16" else torch.float32


def plan_engine_caches(
    config: EngineConfig, groups: list[CacheGroup], device: torch.device, parallel: RankContext | None = None
) -> CacheLayout:
    """One budget for every cache of the engine (target, draft model, MTP). The ranks of a
    tensor-parallel group hold different shares of the KV heads, but one scheduler addresses
    their blocks: they all take the smallest block count any of them can afford."""
    cache, scheduler = config.cache, config.scheduler
    budget = cache.kv_cache_memory
    if budget is None and cache.num_blocks is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.9)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES

    def plan(num_blocks: int | None) -> CacheLayout:
        return plan_cache_layout(
            groups,
            cache.block_size,
            budget_bytes=budget,
            num_blocks=num_blocks,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
        )

    layout = plan(cache.num_blocks)
    if parallel is not None and parallel.topology.tp_size > 1:
        agreed = parallel.comm.all_reduce_min(layout.groups[0].num_blocks)
        if agreed != layout.groups[0].num_blocks:
            layout = plan(agreed)
    return layout


def build_expert_balancer(
    config: EngineConfig, model: CausalLM, parallel: RankContext | None
) -> ExpertBalancer | None:
    """EPLB over the model's expert-parallel layers (--enable-eplb)."""
    layers = model.expert_layers()
    if parallel is None or not config.parallel.enable_eplb or not layers:
        return None
    ep = layers[0].ep
    router = getattr(getattr(model, "arch", None), "router", None)
    return ExpertBalancer(
        layers,
        ep,
        config.parallel.eplb_interval,
        num_groups=router.num_groups if router is not None else 1,
        num_nodes=parallel.topology.nnodes,
        policy=config.parallel.eplb_policy,
    )


@dataclass(slots=True)
class InFlightStep:
    """Async scheduling: a step whose forward runs on the forward thread."""

    plan: SchedulerOutput
    result: Future[StepResult]


class EngineCore:
    """Builds every collaborator from one validated config (or takes weights already loaded),
    then steps: schedule -> execute -> update -> outputs.

    With async scheduling, the forward of step N runs on a forward thread while this thread
    plans step N+1 and, once step N has landed and N+1 started, while the caller turns step N's
    tokens into text or messages.

    With `parallel`, this core is rank 0 of a tensor-parallel group (its runner hands every
    forward to the other ranks) or one data-parallel rank (its own requests and KV cache); its
    model is this rank's shard."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, parallel: RankContext | None = None
    ) -> None:
        self.config = config
        self.parallel = parallel
        torch.set_num_threads(rank_threads(config, parallel.topology if parallel else None))
        device = engine_device(config, parallel)
        if parallel is not None and loaded is not None:
            raise ValueError("an engine over several ranks loads its own shards: `loaded` cannot be given")
        if loaded is None:
            check_model_engine(config)
            dtype = engine_dtype(config, device)
        else:
            type(loaded.model).check_engine(loaded.config, config)
            dtype = model_dtype(loaded.model)  # weights already loaded: what they compute in
        self.loaded = loaded or load_model(
            config.model,
            dtype,
            device,
            config.quantization,
            parallel.model_parallel() if parallel else None,
            config.rope_scaling,
        )
        check_model_options(config, self.loaded)
        self.loaded.model.configure(config)
        model = self.loaded.model
        kv_dtype = kv_cache_dtype(config, self.loaded, dtype, device)
        max_positions = self.loaded.config.max_position_embeddings
        # Past the positions the model places (trained, or stretched by --rope-scaling): refused.
        check_context_length(config.scheduler.max_model_len, max_positions, config.rope_scaling)
        self.max_model_len = config.scheduler.max_model_len or max_positions

        draft = load_draft_model(config, self.loaded, self.max_model_len, dtype, device)
        declared: dict[str, list[CacheGroup]] = {
            "target": model.cache_groups(kv_dtype),
            **proposer_cache_groups(config.speculative.speculative_method, model, draft, kv_dtype),
        }
        self.layout = plan_engine_caches(
            config, [g for groups in declared.values() for g in groups], device, parallel
        )
        self.fingerprint = f"{self.loaded.weights_fingerprint}:{self.layout.fingerprint()}"
        # KV events are logged only when someone publishes them (a router reads them).
        self.kv_events = KVEventLog() if config.disaggregation.kv_events_endpoint else None
        self.kv = KVCacheManager(self.layout, config.cache.enable_prefix_caching, self.kv_events)
        caches = KVCaches(self.layout, declared, device)
        # On the CPU the model has every core: masks are computed inline rather than by a pool.
        self.grammars = GrammarManager(
            self.loaded.tokenizer,
            self.loaded.config.vocab_size,
            config.grammar_compile_timeout,
            mask_threads=0 if device.type == "cpu" else None,
        )
        self.runner = ModelRunner(
            model,
            caches,
            device,
            config.attention_backend,
            self.grammars.bitmask,
            peers=parallel.peers if parallel else None,
            experts=build_expert_balancer(config, model, parallel),
        )
        self.spec: SpeculativeDecoder | None = (
            build_speculative_decoder(config, self.runner, caches, draft)
            if config.speculative.enabled
            else None
        )
        self.kv_transfer_address: str | None = None  # the prefill role's transfer listener
        self.kv_transfer_layout: str | None = None  # the chunks a direct handoff moves
        self.connector: KVConnector | None = self._build_connector(caches)
        pd = config.disaggregation
        # Images an encode-role server encoded: their embeddings are pulled as requests arrive.
        self.image_puller = (
            ImagePuller(
                embeddings_layout(self.loaded.config.raw),
                pd.kv_transfer_timeout,
                cluster_key_of(pd.cluster_key_file),
            )
            if pd.encoders and model.accepts_images
            else None
        )
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, self.kv)
        self.num_preemptions = 0
        self._forward_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="forward") if config.scheduler.async_scheduling else None
        )
        if self._forward_thread is not None:
            release_thread_pool()  # from now on the forward thread leads every parallel region
        self._in_flight: InFlightStep | None = None
        log.info(
            "engine ready: %s in %s, %d KV blocks in %d cache group(s) (%.0f bytes/token), "
            "attention=%s, C kernels for %s",
            self.loaded.name,
            str(dtype).removeprefix("torch."),
            self.kv.num_blocks,
            len(self.layout.groups),
            self.layout.bytes_per_token,
            self.runner.backend.name,
            isa.describe(),
        )

    def _build_connector(self, caches: KVCaches) -> KVConnector | None:
        """The store connector (if a store or host tier is configured), then the role's."""
        tier_events = TierEvents(self.kv_events) if self.kv_events is not None else None
        store = build_kv_store(
            self.config.store.settings(),
            on_host_evict=tier_events.host_evicted if tier_events is not None else None,
            cluster_key=cluster_key_of(self.config.disaggregation.cluster_key_file),
        )
        self.kv_store = store
        connectors: list[KVConnector] = []
        if store is not None:
            connectors.append(KVOffloader(store, self.kv, caches, tier_events))
        pd = self.config.disaggregation
        if pd.role == "prefill":
            handoff = PrefillHandoff(self.kv, caches, pd, store, self.config.store.kv_chunk_blocks)
            self.kv_transfer_address = handoff.address
            connectors.append(handoff)
            if pd.kv_transfer == "direct":
                self.kv_transfer_layout = handoff.chunks.describe()
        elif pd.role == "decode" and pd.kv_transfer == "direct":
            receiver = DecodeReceiver(self.kv, caches, pd, self.config.store.kv_chunk_blocks)
            self.kv_transfer_layout = receiver.layout
            connectors.append(receiver)
        if not connectors:
            return None
        return connectors[0] if len(connectors) == 1 else ConnectorChain(connectors)

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush pending KV-store writes (for at most `timeout_s`), stop background threads and
        (rank 0) the other ranks. Idempotent."""
        if self.connector is not None:
            self.connector.close(timeout_s)
            self.connector = None
        if self._forward_thread is not None:
            self._forward_thread.shutdown(wait=True)
        self.grammars.close()
        if self.image_puller is not None:
            self.image_puller.close()
        if self.parallel is not None:
            self.parallel.close()

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layout.bytes_per_token

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Images an encoder holds are pulled while it waits: `request.images`
        is replaced by the images carrying their embeddings when they land (at once for those
        the encoder-output cache holds); if they do not, a later step ends the request."""
        encoded = False
        if request.images:
            if not self.loaded.model.accepts_images:
                raise ValueError(f"{type(self.loaded.model).__name__} takes no images (no vision tower)")
            check_images(request.images, len(request.prompt_token_ids))
            encoded = any(image.encoded is not None for image in request.images)
            if encoded and self.image_puller is None:
                raise ValueError("an image encoded elsewhere reached an engine without --encoder")
        root = namespace_root(self.fingerprint, request.cache_salt)
        seq = self.scheduler.add_request(request, root)
        if encoded:
            self.image_puller.attach(seq, self._cached_embeddings)
        if request.grammar is not None:
            self.grammars.attach(seq, request.grammar)
        if self.connector is not None:
            self.connector.prefetch(seq)

    def _cached_embeddings(self, content_hash: bytes) -> bytes | None:
        embeds = self.runner.images.get(content_hash) if self.runner.images is not None else None
        return embeds.numpy().tobytes() if embeds is not None else None

    def abort(self, request_id: str, index: int | None = None) -> list[SequenceOutput]:
        """Abort a request (or one of its sequences); its blocks are free when this returns."""
        seqs = self.scheduler.abort_request(request_id, index)
        if index is None:
            self.grammars.release(request_id)
        if self.image_puller is not None:
            self.image_puller.forget(seqs)
        self._release([s.seq_id for s in seqs])
        return [
            SequenceOutput(
                request_id, s.index, [], finish_reason="abort", num_prompt_tokens=s.num_prompt_tokens
            )
            for s in seqs
        ]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    @property
    def connector_busy(self) -> bool:
        """Whether the KV connector needs polling while no sequence runs (leases, writes)."""
        return self.connector is not None and self.connector.busy

    def housekeeping(self) -> list[SequenceOutput]:
        """What an idle engine still owes its KV connector: land loads, release lent blocks."""
        return self._poll_pending()

    def take_handoffs(self) -> list[KVHandoff]:
        """Prompts whose KV is ready for a decode engine (prefill role), since the last call."""
        return self.connector.take_handoffs() if self.connector is not None else []

    def take_kv_events(self) -> list[KVEvent]:
        """What the prefix caches gained and lost since the last call (empty unless logged)."""
        return self.kv_events.drain() if self.kv_events is not None else []

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        if self._forward_thread is not None:
            return self._step_async()
        began = time.perf_counter()
        outputs = self._poll_pending()
        plan = self.scheduler.schedule(self._draft_lengths())
        self.num_preemptions += len(plan.preempted)
        if plan.is_empty:
            if self.parallel is not None and self.parallel.lockstep:
                self.runner.run_empty()  # the other data-parallel ranks need this rank in the MoE layers
            return self._idle(outputs)
        result = self._execute(plan)
        outputs += self._fail(result.failures)
        updates = self.scheduler.update(plan, result.token_ids())
        outputs += [self._output(update, result) for update in updates]
        outputs += self._fail(self._after_step(plan, time.perf_counter() - began))
        return outputs

    def _step_async(self) -> list[SequenceOutput]:
        """Plan step N+1 while step N's forward runs; land step N (tokens, stop rules, outputs);
        drop from N+1 the sequences N finished; start N+1 and return N's outputs. (No KV
        connector or speculation runs in this mode: the config refuses them.)"""
        outputs = self._poll_pending()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if self._in_flight is not None:
            outputs += self._land(self._in_flight)
            self._in_flight = None
        plan.drop_finished()
        if plan.is_empty:
            return self._idle(outputs)
        for item in plan.scheduled:
            for child in item.forks:
                self.grammars.fork(child)
        prepared: PreparedStep = self.runner.prepare(plan)
        self._in_flight = InFlightStep(plan, self._forward_thread.submit(self.runner.run_prepared, prepared))
        return outputs

    def _land(self, step: InFlightStep) -> list[SequenceOutput]:
        """Wait for a step's forward (its failure is the engine's, as in a synchronous step) and
        apply its tokens."""
        result = step.result.result()
        outputs = self._fail(result.failures)
        updates = self.scheduler.update(step.plan, result.token_ids())
        return outputs + [self._output(update, result) for update in updates]

    def _draft_lengths(self) -> dict[int, int] | None:
        if self.spec is None:
            return None
        s = self.scheduler
        return self.spec.plan(s.running, s.max_model_len, s.expected_prefill_tokens())

    def _idle(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        if self.scheduler.waiting and not outputs:
            time.sleep(0.001)  # everything waits on a KV load, a grammar or images: don't spin a core
        return outputs

    def _execute(self, plan: SchedulerOutput) -> StepResult:
        """Forks get their grammar matchers; drafts are proposed into the reserved slots, the
        target runs the step, and the drafts are verified."""
        for item in plan.scheduled:
            for child in item.forks:
                self.grammars.fork(child)
        if self.spec is not None:
            self.spec.propose(plan)
        result = self.runner.execute(plan)
        if self.spec is not None:
            self.spec.verify(result)
        return result

    def _after_step(self, plan: SchedulerOutput, seconds: float) -> dict[str, str]:
        """Hand newly computed chunks to the KV connector (returns the requests it failed for);
        calibrate speculation's cost model."""
        failures = {}
        if self.connector is not None:
            failures = self.connector.save_completed(
                [s for item in plan.scheduled for s in (item.seq, *item.forks)]
            )
        if self.spec is not None:
            self.spec.observe_step(seconds, plan)
        return failures

    def _fail(self, failures: dict[str, str]) -> list[SequenceOutput]:
        """End requests one step could not serve (its grammar, sampling, KV save failed for
        them), with their error; everything else runs on."""
        outputs = []
        for request_id, error in failures.items():
            for out in self.abort(request_id):
                out.finish_reason, out.error = "error", error
                outputs.append(out)
        return outputs

    def _poll_pending(self) -> list[SequenceOutput]:
        """Land finished KV loads, grammar compiles and image-embedding pulls; a grammar that
        failed, KV that had to come from elsewhere and did not (with kv_transfer_failure=fail),
        or image embeddings that did not arrive from their encoder end their request."""
        failures = self.connector.poll() if self.connector is not None else {}
        failures.update({seq.request_id: error for seq, error in self.grammars.poll()})
        if self.image_puller is not None:
            failures.update(self.image_puller.poll())
        return self._fail(failures)

    def _release(self, seq_ids: list[int]) -> None:
        self.runner.release(seq_ids)
        if self.spec is not None:
            self.spec.release(seq_ids)

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
            self._release([seq.seq_id])
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
            if self._forward_thread is not None:  # after the step in flight, on its thread
                return self._forward_thread.submit(self.runner.prompt_logits, seq).result()
            return self.runner.prompt_logits(seq)
        finally:
            self.kv.free(seq)

    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative-decoding counters (None when speculation is off)."""
        return self.spec.stats if self.spec is not None else None

    def stats(self) -> EngineStats:
        kv = self.kv
        store = self.kv_store.metrics if self.kv_store is not None else None
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            prefix_lookups=kv.stats.lookups,
            prefix_queried_tokens=kv.stats.queried_tokens,
            prefix_hit_tokens=kv.stats.hit_tokens,
            prefix_evictions=kv.num_evictions,
            prefix_cached_blocks=kv.num_cached_blocks,
            num_preemptions=self.num_preemptions,
            images_encoded=self.runner.images.num_encoded if self.runner.images is not None else 0,
            kv_store_errors=store.errors if store is not None else 0,
            kv_store_corrupt_chunks=store.corrupt_objects if store is not None else 0,
            kv_store_forged_chunks=store.forged_objects if store is not None else 0,
            kv_store_write_drops=store.write_drops if store is not None else 0,
        )
