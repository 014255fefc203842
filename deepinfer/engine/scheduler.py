"""Continuous batching with chunked prefill, prefix hits and preemption by recompute.

The scheduler's one verb: "sequence S gets N new tokens this step". A prefill chunk, a decode, a
prefix-cache hit (which simply advances S's computed tokens) and speculative tokens are all that.
Running sequences are served first (decodes and unfinished prefills, in priority/arrival order),
then waiting sequences are admitted while the token budget, `max_num_seqs` and the KV pool allow,
which gives mixed steps. Prefills beside a step's first also share a budget of attended positions
(`max_prefill_attention`): a new turn's short suffix after a long cached prefix costs as much as
its context, and several of them in one step would each wait for all; one per step answers the
first sooner and leaves the sessions' turns staggered, so the next ones arrive apart. When blocks
run out, the lowest-priority, latest-arrived running sequence is preempted: its blocks are freed
and it later recomputes its tokens (often from prefix hits).

With async scheduling, step N+1 is planned before step N's tokens are known: each token a step
will sample counts as a placeholder (`Sequence.num_placeholders`) until `update` lands it, so a
decoding sequence is scheduled for the position of its in-flight token, and one whose in-flight
tokens reach max_tokens or the context is not scheduled again. Stop tokens are seen one step
late: the engine drops the sequences that step N finished from step N+1 before it runs.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.sequence import (
    EngineRequest,
    FinishReason,
    Sequence,
    SequenceStatus,
    draft_room,
    length_room,
    stop_after,
)
from deepinfer.step import ScheduledSequence, SchedulerOutput


@dataclass(slots=True)
class PrefillAttention:
    """The attended positions of one step's prefill chunks, within `cap` beside the first chunk
    (which always fits, so a step always moves some prefill on)."""

    cap: int | None
    used: int = 0
    count: int = 0

    @staticmethod
    def cost(start: int, num_new: int) -> int:
        """Positions attended by prompt tokens start .. start + num_new - 1 (causal)."""
        return num_new * start + num_new * (num_new + 1) // 2

    def fits(self, start: int, num_new: int) -> bool:
        return not self.count or self.cap is None or self.used + self.cost(start, num_new) <= self.cap

    def add(self, start: int, num_new: int) -> None:
        self.used += self.cost(start, num_new)
        self.count += 1


@dataclass(slots=True)
class SequenceUpdate:
    """What one step changed for one sequence: the engine's per-step output unit."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, max_model_len: int, kv: KVCacheManager) -> None:
        if config.max_num_batched_tokens is None:
            raise ValueError("the step budget is set by device: pass config.on_device(...)")
        self.config = config
        self.max_model_len = max_model_len  # the context limit, resolved against the model's
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []
        self._by_request: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self.async_scheduling = config.async_scheduling

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: EngineRequest, prefix_root: bytes) -> Sequence:
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            prefix_root=prefix_root,
            pending_forks=request.params.n - 1,
        )
        self._by_request[request.request_id] = [seq]
        self._enqueue(seq)
        return seq

    def abort_request(self, request_id: str, index: int | None = None) -> list[Sequence]:
        """Finish a request's sequences now (all, or the one with choice `index`) and free their
        blocks. Unknown ids are ignored. Returns the sequences that were still unfinished."""
        seqs = self._by_request.get(request_id, [])
        if index is not None:
            seqs = [s for s in seqs if s.index == index]
        aborted = []
        for seq in seqs:
            seq.pending_forks = 0  # siblings not yet forked never will be
            if seq.is_finished:
                continue
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
            else:
                self.running.remove(seq)
                self.kv.free(seq)
            self._mark_finished(seq, FinishReason.ABORT, None)
            aborted.append(seq)
        self._forget_if_done(request_id)
        return aborted

    def sequences_of(self, request_id: str) -> list[Sequence]:
        return self._by_request.get(request_id, [])

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._by_request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def expected_prefill_tokens(self) -> int:
        """Prompt tokens the next step will likely carry: unfinished prefills of running
        sequences, then waiting ones up to the free seats, within the token budget."""
        config = self.config
        cap = config.prefill_chunk_size or config.max_num_batched_tokens
        total = sum(
            min(s.num_tokens - s.num_computed_tokens, cap)
            for s in self.running
            if s.num_tokens - s.num_computed_tokens > 1
        )
        seats = max(config.max_num_seqs - len(self.running), 0)
        total += sum(min(s.num_tokens, cap) for s in self.waiting[:seats])
        return min(total, config.max_num_batched_tokens)

    # -- one step ------------------------------------------------------------------------------

    def _key(self, seq: Sequence) -> tuple[int, float, int]:
        priority, arrival, seq_id = seq.sort_key()
        return (priority if self.config.scheduling_policy == "priority" else 0, arrival, seq_id)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    @staticmethod
    def _uncomputed(seq: Sequence) -> int:
        """Tokens of `seq` (in-flight placeholders included) whose KV is not yet scheduled."""
        return seq.num_tokens + seq.num_placeholders - seq.num_computed_tokens

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the tokens a step in flight samples for `seq` reach its length limit."""
        return bool(seq.num_placeholders) and seq.num_placeholders >= length_room(seq, self.max_model_len)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = self._uncomputed(seq)
        if seq.num_computed_tokens < seq.num_prompt_tokens and self.config.prefill_chunk_size:
            remaining = min(remaining, self.config.prefill_chunk_size)
        return min(remaining, budget)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_preemptions += 1
        self._enqueue(seq)

    def _scheduled(
        self, seq: Sequence, num_new: int, forks_out: list[Sequence], num_draft: int = 0
    ) -> ScheduledSequence:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_new
        sample = seq.num_computed_tokens == seq.num_tokens + seq.num_placeholders + num_draft
        item = ScheduledSequence(
            seq, num_new, start, sample, num_draft_tokens=num_draft, speculative=num_draft > 0
        )
        if sample and seq.pending_forks:
            item.forks = self._fork(seq)
            forks_out.extend(item.forks)
        if sample and self.async_scheduling:
            for s in (seq, *item.forks):
                s.num_placeholders += 1
        return item

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = Sequence(
                seq_id=next(self._seq_ids),
                request=parent.request,
                index=index,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                prefix_root=parent.prefix_root,
                status=SequenceStatus.RUNNING,
                num_cached_tokens=parent.num_cached_tokens,
            )
            self.kv.fork(parent, child)
            children.append(child)
        parent.pending_forks = 0
        self._by_request[parent.request_id].extend(children)
        return children

    def _draft_slots(self, seq: Sequence, wanted: int, budget: int, later: list[Sequence]) -> int:
        """Draft slots to reserve for a decoding sequence: at most `wanted`, within the context and
        max_tokens, and only out of what the sequences scheduled after it this step leave over
        (tokens and blocks), so speculation never preempts or starves anyone."""
        if wanted <= 0 or seq.num_tokens - seq.num_computed_tokens != 1 or seq.pending_forks:
            return 0
        k = min(wanted, draft_room(seq, self.max_model_len), budget - 1 - len(later))
        if k <= 0:
            return 0
        cap = self.config.prefill_chunk_size or budget
        kv = self.kv
        reserved = [0] * len(kv.groups)
        for s in later:
            for g, need in enumerate(kv.blocks_needed(s, min(s.num_tokens - s.num_computed_tokens, cap))):
                reserved[g] += need
        base = kv.blocks_needed(seq, 1)
        spare = [max(group.pool.num_free - b - r, 0) for group, b, r in zip(kv.groups, base, reserved)]
        while k > 0 and any(n - b > room for n, b, room in zip(kv.blocks_needed(seq, 1 + k), base, spare)):
            k -= 1
        return k

    def schedule(self, draft_lengths: dict[int, int] | None = None) -> SchedulerOutput:
        """One step's plan. `draft_lengths` (seq_id -> k) asks for k draft slots after a decoding
        sequence's last token (speculative decoding); they are granted only out of spare room."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        forks: list[Sequence] = []
        prefill = PrefillAttention(self.config.max_prefill_attention)

        # Decodes before unfinished prefills, so a long prompt never stalls running generations.
        order = sorted(self.running, key=lambda s: (self._uncomputed(s) > 1, self._key(s)))
        done: set[int] = set()
        for position, seq in enumerate(order):
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING or self._ends_in_flight(seq):
                continue  # preempted earlier in this step, or finishing with the step in flight
            num_new = self._chunk(seq, budget)
            is_prefill = self._uncomputed(seq) > 1
            if is_prefill and not prefill.fits(seq.num_computed_tokens, num_new):
                continue  # a later step's first prefill
            while not self.kv.can_allocate(seq, num_new):
                victim = max((s for s in self.running if s.seq_id not in done), key=self._key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            num_draft = 0
            if draft_lengths and seq.seq_id in draft_lengths:
                later = [s for s in order[position + 1 :] if s.status == SequenceStatus.RUNNING]
                num_draft = self._draft_slots(seq, draft_lengths[seq.seq_id], budget, later)
            if is_prefill:
                prefill.add(seq.num_computed_tokens, num_new)
            self.kv.allocate(seq, num_new + num_draft)
            scheduled.append(self._scheduled(seq, num_new + num_draft, forks, num_draft))
            done.add(seq.seq_id)
            budget -= num_new + num_draft

        for seq in list(self.waiting):
            if budget <= 0 or preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.num_pending:
                continue  # waiting for a grammar, a KV load or images; later arrivals may go first
            hits = self.kv.find_cached_prefix(seq)
            num_hit_tokens = hits.num_tokens
            remaining = seq.num_tokens - num_hit_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens and self.config.prefill_chunk_size:
                remaining = min(remaining, self.config.prefill_chunk_size)
            num_new = min(remaining, budget)
            if not prefill.fits(num_hit_tokens, num_new) or not self.kv.can_allocate(seq, num_new, hits):
                break
            prefill.add(num_hit_tokens, num_new)
            self.waiting.remove(seq)
            self.kv.allocate(seq, num_new, hits)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new, forks))
            budget -= num_new

        self.running.extend(forks)
        return SchedulerOutput(scheduled, self.kv.take_copies(), preempted)

    # -- after the forward ---------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]]) -> list[SequenceUpdate]:
        """Append sampled tokens (seq_id -> tokens), apply stop rules, free finished sequences.

        With async scheduling this lands a step after the next one was planned: its placeholders
        become tokens, only the blocks this step computed are indexed in the prefix cache (the
        next step's tokens are counted as computed already), and a sequence preempted meanwhile
        keeps its token (it recomputes it with the rest)."""
        updates: list[SequenceUpdate] = []
        for item in output.scheduled:
            for seq in (item.seq, *item.forks):
                if item.sample and self.async_scheduling:
                    seq.num_placeholders -= 1
                if seq.is_finished:  # aborted while the step ran
                    continue
                new_tokens = sampled.get(seq.seq_id, []) if item.sample else []
                if item.speculative:
                    self._roll_back_rejected(item, len(new_tokens))
                accepted = self._append(seq, new_tokens)
                # A sequence this step finished is indexed too (a KV connector saves its blocks
                # through the index after they are freed); one preempted meanwhile has no blocks.
                if seq.status != SequenceStatus.WAITING:
                    computed = min(seq.num_computed_tokens, item.start + item.num_new_tokens)
                    self.kv.cache_computed_blocks(seq, computed)
                if accepted or seq.is_finished:
                    updates.append(SequenceUpdate(seq, accepted, seq.is_finished))
                if seq.is_finished:
                    self._finish(seq)
        return updates

    def _roll_back_rejected(self, item: ScheduledSequence, num_new_tokens: int) -> None:
        """Only the accepted drafts (all but the last new token) stay computed; the slots of the
        rejected ones are overwritten later, and blocks past the computed tokens go back to the
        pool, so no block holding unverified tokens is ever registered in the prefix cache."""
        seq = item.seq
        accepted = max(num_new_tokens - 1, 0)
        seq.num_computed_tokens = item.start + item.num_new_tokens - item.num_draft_tokens + accepted
        self.kv.trim(seq)

    def _append(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """Append tokens to `seq` up to the first that ends it (marked finished then); returns
        the tokens appended."""
        accepted: list[int] = []
        for token in new_tokens:
            seq.token_ids.append(token)
            accepted.append(token)
            stop = stop_after(seq, token, self.max_model_len)
            if stop is not None:
                self._mark_finished(seq, *stop)
                break
        return accepted

    @staticmethod
    def _mark_finished(seq: Sequence, reason: FinishReason, stop_reason: int | str | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last step was in flight
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._forget_if_done(seq.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._by_request.get(request_id)
        if seqs is not None and all(s.is_finished and not s.pending_forks for s in seqs):
            del self._by_request[request_id]
