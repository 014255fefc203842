"""The engine core: schedule, run, update. Token ids in, token ids out; no text, no API formats.
Its collaborators are built by build.py (build_engine_core)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deepinfer.cache_layout import CacheLayout
from deepinfer.config import EngineConfig
from deepinfer.engine.connectors.connector import KVConnector
from deepinfer.engine.grammar import GrammarManager
from deepinfer.engine.image_pull import ImagePuller
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.outputs import KVHandoff, SequenceOutput, TokenLogprobs
from deepinfer.engine.parallel.context import RankContext
from deepinfer.engine.scheduler import Scheduler, SequenceUpdate
from deepinfer.engine.stats import EngineStats
from deepinfer.image_input import check_images
from deepinfer.kernels.openmp import release_thread_pool
from deepinfer.model.loader.load import LoadedModel
from deepinfer.runner.model_runner import ModelRunner, StepResult
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.stats import SpecDecodeStats
from deepinfer.step import SchedulerOutput
from deepinfer.store import TieredKVStore
from deepinfer.structured import GrammarSpec
from deepinfer.transport.kv_event_log import KVEvent, KVEventLog


@dataclass(slots=True)
class KVConnection:
    """The engine's seam to KV held elsewhere: its connector (None without a store, a host tier
    or a prefill/decode role), the store under it, the prefill role's transfer listener and the
    chunks a direct handoff moves."""

    connector: KVConnector | None = None
    store: TieredKVStore | None = None
    transfer_address: str | None = None
    transfer_layout: str | None = None


@dataclass(slots=True)
class InFlightStep:
    """Async scheduling: a step whose forward runs on the forward thread."""

    plan: SchedulerOutput
    result: Future[StepResult]


class EngineCore:
    """Steps the collaborators it is given (build.build_engine_core builds them from one
    validated config): schedule -> execute -> update -> outputs.

    With async scheduling, the forward of step N runs on a forward thread while this thread
    plans step N+1 and, once step N has landed and N+1 started, while the caller turns step N's
    tokens into text or messages.

    With `parallel`, this core is rank 0 of a tensor-parallel group (its runner hands every
    forward to the other ranks) or one data-parallel rank (its own requests and KV cache); its
    model is this rank's shard."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel,
        max_model_len: int,
        layout: CacheLayout,
        kv: KVCacheManager,
        kv_events: KVEventLog | None,
        grammars: GrammarManager,
        runner: ModelRunner,
        spec: SpeculativeDecoder | None,
        connection: KVConnection,
        image_puller: ImagePuller | None,
        scheduler: Scheduler,
        parallel: RankContext | None = None,
    ) -> None:
        self.config = config
        self.parallel = parallel
        self.loaded = loaded
        self.max_model_len = max_model_len
        self.layout = layout
        self.fingerprint = f"{loaded.weights_fingerprint}:{layout.fingerprint()}"
        self.kv_events = kv_events
        self.kv = kv
        self.grammars = grammars
        self.runner = runner
        self.spec = spec
        self.connector = connection.connector
        self.kv_store = connection.store
        self.kv_transfer_address = connection.transfer_address
        self.kv_transfer_layout = connection.transfer_layout
        self.image_puller = image_puller
        self.scheduler = scheduler
        self.num_preemptions = 0
        self._forward_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="forward") if config.scheduler.async_scheduling else None
        )
        if self._forward_thread is not None:
            release_thread_pool()  # from now on the forward thread leads every parallel region
        self._in_flight: InFlightStep | None = None

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
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

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

    def validate_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` (cached for the request that will carry it); raises if unsupported."""
        self.grammars.validate(spec)

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
        """One step: land what arrived (KV loads, grammars, images), plan, run the forward and
        apply its tokens (stop rules, finished sequences freed). Mutates the scheduler's
        sequences, the KV pool, the grammar matchers and the KV connector."""
        if self._forward_thread is not None:
            return self._step_async()
        began = time.perf_counter()
        outputs, plan = self._schedule()
        if plan.is_empty:
            self.idle_forward()
            return self._idle(outputs)
        result = self._execute(plan)
        outputs += self._apply(plan, result)
        outputs += self._fail(self._after_step(plan, time.perf_counter() - began))
        return outputs

    def _step_async(self) -> list[SequenceOutput]:
        """Plan step N+1 while step N's forward runs; land step N (tokens, stop rules, outputs);
        drop from N+1 the sequences N finished; start N+1 and return N's outputs. (No KV
        connector or speculation runs in this mode: the config refuses them.)"""
        outputs, plan = self._schedule()
        if self._in_flight is not None:
            # The forward's failure is the engine's, as in a synchronous step.
            outputs += self._apply(self._in_flight.plan, self._in_flight.result.result())
            self._in_flight = None
        plan.drop_finished()
        if plan.is_empty:
            return self._idle(outputs)
        self._fork_grammars(plan)
        prepared = self.runner.prepare(plan)
        self._in_flight = InFlightStep(plan, self._forward_thread.submit(self.runner.run_prepared, prepared))
        return outputs

    def _schedule(self) -> tuple[list[SequenceOutput], SchedulerOutput]:
        """Land pending KV loads, grammar compiles and image pulls (the requests they failed end
        here: the outputs), then plan the next step and count its preemptions."""
        outputs = self._poll_pending()
        plan = self.scheduler.schedule(self._draft_lengths())
        self.num_preemptions += len(plan.preempted)
        return outputs, plan

    def _fork_grammars(self, plan: SchedulerOutput) -> None:
        """The sequences a step forks (n > 1) get copies of their parent's grammar matcher."""
        for item in plan.scheduled:
            for child in item.forks:
                self.grammars.fork(child)

    def _apply(self, plan: SchedulerOutput, result: StepResult) -> list[SequenceOutput]:
        """Apply a step's result: end the requests whose grammar or sampling failed, append the
        tokens (stop rules, finished sequences freed) and turn each update into an output."""
        outputs = self._fail(result.failures)
        updates = self.scheduler.update(plan, result.token_ids())
        return outputs + [self._output(update, result) for update in updates]

    def _draft_lengths(self) -> dict[int, int] | None:
        if self.spec is None:
            return None
        s = self.scheduler
        return self.spec.plan(s.running, s.max_model_len, s.expected_prefill_tokens())

    def idle_forward(self) -> None:
        """A data-parallel rank without work of its own still runs an (empty) forward when the
        ranks meet in the MoE layers' all-to-alls; otherwise nothing."""
        if self.parallel is not None and self.parallel.lockstep:
            self.runner.run_empty()

    def _idle(self, outputs: list[SequenceOutput]) -> list[SequenceOutput]:
        if self.scheduler.waiting and not outputs:
            time.sleep(0.001)  # everything waits on a KV load, a grammar or images: don't spin a core
        return outputs

    def _execute(self, plan: SchedulerOutput) -> StepResult:
        """Forks get their grammar matchers; drafts are proposed into the reserved slots, the
        target runs the step, and the drafts are verified."""
        self._fork_grammars(plan)
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
