"""The one place where a step's plan becomes tensors: inputs, attention metadata, forward, sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Protocol

import torch

from deepinfer.attention.backend import AttentionBackend, OwnAttention, TorchReferenceBackend
from deepinfer.attention.float32_boundary import Float32Boundary
from deepinfer.attention.metadata import ForwardMetadata
from deepinfer.image_input import images_in
from deepinfer.kernels.triton import triton_installed
from deepinfer.model.base import CausalLM
from deepinfer.model.layers.device_kernels import use_triton_kernels
from deepinfer.model.layers.expert_parallel import ExpertBalancer
from deepinfer.model.loader.dtype import model_dtype
from deepinfer.runner.graphs import DecodeGraphs, GraphCapture
from deepinfer.runner.image_embeds import ImageEmbeddings
from deepinfer.runner.inputs import ForwardInputs, ForwardWork, RowSpan, span_offsets
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.sampler import SampledToken, Sampler, SamplingRow
from deepinfer.sequence import Sequence
from deepinfer.step import ScheduledSequence, SchedulerOutput
from deepinfer.structured.backend import GrammarMatcher

log = logging.getLogger(__name__)

# One packed allowed-token bitmask row per matcher (structured output), and the rows whose
# matcher failed.
GrammarMasks = Callable[[list[GrammarMatcher]], tuple[torch.Tensor, list[int]]]


def triton_chosen(name: str, device: torch.device) -> bool:
    """Whether the attention backend named `name` on `device` is Triton's (`auto`: on CUDA when
    Triton is installed); the loader asks it too, before the runner exists (FP8 weights kept)."""
    return name == "triton" or (name == "auto" and device.type == "cuda" and triton_installed())


def cpu_kernel_chosen(name: str, device: torch.device) -> bool:
    """Whether the attention backend named `name` on `device` is the C kernel's (`auto`: on the
    CPU), once Triton's is ruled out; the engine asks it too, before the runner exists (the KV
    cache's dtype)."""
    return name == "cpu_paged" or (name == "auto" and device.type == "cpu")


def make_attention_backend(
    name: str,
    model: CausalLM,
    block_size: int,
    device: torch.device,
    kv_dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """`auto` picks the C kernel backend on CPU when it builds and fits the model, Triton on CUDA
    when it is installed, else the reference.

    For a model that rounds its activations, every prompt row goes through the per-row kernel:
    the tiled prefill's GEMMs sum in an order that depends on the chunk's shape (differences of
    ~1e-6), which the rounding can turn into another token once a prompt is chunked or cached."""
    triton = triton_chosen(name, device)
    if not model.uses_attention_backend:
        return OwnAttention("triton" if triton else "model")
    if triton:
        from deepinfer.attention.triton_backend import TritonBackend

        return TritonBackend(device)
    if not cpu_kernel_chosen(name, device):
        return TorchReferenceBackend()
    from deepinfer.attention.cpu_paged import CpuPagedBackend

    num_heads, num_kv_heads, head_dim = model.attention_shape()
    fits = CpuPagedBackend.supports(num_heads, num_kv_heads, head_dim, block_size, kv_dtype)
    try:
        if fits or name == "cpu_paged":
            backend = CpuPagedBackend(row_kernel_only=model.rounds_activations)
            # The kernels compute in fp32: a bf16 model's q/k/v cross into fp32 and back.
            return backend if model_dtype(model) == torch.float32 else Float32Boundary(backend)
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
class RebalanceExperts:
    """Re-place the experts by their recorded load (EPLB), on every rank at once."""


class Peers(Protocol):
    """The other ranks of rank 0's tensor-parallel group."""

    def submit(self, work: ForwardWork | RebalanceExperts) -> None:
        """Hand `work` to every other rank, which runs it with this one (never waits for them)."""
        ...


@dataclass(slots=True)
class PreparedStep:
    """A step's plan read off its sequences: the forward's work and the sampling rows, copies that
    stay as they are while the scheduler plans the next step (async scheduling)."""

    items: list[ScheduledSequence]
    work: ForwardWork
    rows: list[SamplingRow]
    owners: list[Sequence]  # the sequence of each sampling row
    # [N] each sampling row's index into work.logit_rows; None when row i is logit row i (no forks)
    inverse: torch.Tensor | None


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
    # [T, len(feature_layers) * hidden]: the target features the runner was asked for (DSpark's)
    features: torch.Tensor | None = None

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
        peers: Peers | None = None,
        experts: ExpertBalancer | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        """`peers`: on rank 0 of a tensor-parallel group, the other ranks every forward runs on;
        `experts`: the expert-load balancer of an expert-parallel MoE model; `feature_layers`: the
        layers whose features every step keeps, concatenated in this order, for a proposer that
        drafts from them (DSpark); the model fills a `features` dict when given one."""
        self.model = model
        self.peers = peers
        self.experts = experts
        # A forward that meets other ranks in collectives (rank 0 of a group, an expert-parallel rank).
        self._collective = peers is not None or bool(model.expert_layers())
        self.failed: str | None = None  # set when a forward over several ranks failed
        self.caches = caches
        self.device = device
        self.view = caches.view("target")
        self.kv_caches = self.view.tensors
        kv_dtype = self.kv_caches[0].dtype
        self.backend = make_attention_backend(
            attention_backend, model, self.view.groups[0].entries_per_block, device, kv_dtype
        )
        on_triton = self.backend.name == "triton"
        if on_triton:
            use_triton_kernels(model)  # norms and rotary on the device kernels, like attention
        self.sampler = Sampler(on_triton=on_triton)
        self.grammar_masks = grammar_masks
        self._generators: dict[int, torch.Generator] = {}
        self.feature_layers = feature_layers
        # The vision tower's outputs by image (a model with one), spliced in at image positions.
        self.images = ImageEmbeddings(model.embed_images) if model.accepts_images else None
        self.graphs: DecodeGraphs | None = None  # pure-decode steps as CUDA graphs (graphs.py)

    def graphs_unsupported(self) -> str | None:
        """Why this runner's decode steps cannot be captured as graphs (None: they can). This
        runner captures a model that declares it can be (`captures_decode_graphs`) on the Triton
        backend on one rank."""
        if self.backend.name != "triton":
            return f"the {self.backend.name} attention backend"
        if not self.model.captures_decode_graphs or self.model.accepts_images:
            return type(self.model).__name__
        if self._collective:
            return "a forward over several ranks"
        if self.feature_layers:
            return "a step that keeps the target's features"
        return None

    def use_decode_graphs(self, capture: GraphCapture, sizes: list[int], max_context: int) -> bool:
        """Replay pure-decode steps of up to max(sizes) rows and `max_context` positions as graphs
        captured by `capture`, when the model and backend allow (the caches need their scratch
        block); whether they will be."""
        why = self.graphs_unsupported()
        if why is not None:
            log.info("CUDA graphs off: not captured for %s", why)
            return False
        if not self.caches.scratch_block:
            raise ValueError("decode graphs need the KV caches' scratch block (KVCaches(scratch_block=True))")
        self.graphs = DecodeGraphs(self.view, self._graph_step, capture, sizes, max_context)
        return True

    def _graph_step(self, inputs: ForwardInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode graph records: the forward ([B, hidden]) and the logits ([B, V])."""
        prepare_backend(self.backend, inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)
        return hidden, self.compute_logits(hidden)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    def forward(
        self,
        inputs: ForwardInputs,
        spans: list[RowSpan],
        features: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The target's hidden states [T, hidden] for `inputs` (laid out from `spans`), writing
        their KV, with the images the spans reach put at their positions; `features`, when
        given, receives the model's per-layer features (a model that has some: DeepSeek-V4.1)."""
        prepare_backend(self.backend, inputs.meta)
        kwargs: dict[str, Any] = {}
        if features is not None:
            kwargs["features"] = features
        spliced = self.images.splice(spans, inputs.offsets, len(inputs.input_ids)) if self.images else None
        if spliced is not None:
            kwargs["image_mask"], kwargs["image_embeds"] = spliced
        return self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend, **kwargs
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] in fp32 whatever the model computes in: sampling, logprobs and scores
        read them as fp32 (a bf16 model's logits widen exactly)."""
        return self.model.compute_logits(hidden).float()

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
        images = (
            images_in(seq.request.images, item.start, item.start + num_real) if seq.request.images else []
        )
        return RowSpan(
            [list(table) for table in self.view.tables(seq)],
            item.start,
            tokens,
            seq.num_prompt_tokens,
            images,
        )

    @torch.inference_mode()
    def run(
        self, work: ForwardWork, features: dict[int, torch.Tensor] | None = None
    ) -> tuple[ForwardInputs, torch.Tensor, torch.Tensor | None]:
        """What every rank of the group runs: block copies, the forward (filling `features` when
        given), and the logits of `work.logit_rows` ([N, V], None without rows). Rank 0 hands
        `work` to its peers first."""
        if self.failed is not None:
            raise RuntimeError(f"the ranks are out of step since an earlier failure: {self.failed}")
        try:
            if self.peers is not None:
                self.peers.submit(work)
            self.caches.copy_blocks(work.block_copies)
            replayed = self.graphs.run(work) if self.graphs is not None and features is None else None
            if replayed is not None:
                inputs, hidden, logits = replayed
            else:
                inputs, hidden, logits = self._run_eager(work, features)
            if self.experts is not None:
                self.experts.step_done()
        except Exception as error:
            # With other ranks, a forward that failed half way leaves their collectives waiting
            # on this one: no later forward may pair with them.
            if self._collective:
                self.failed = f"{type(error).__name__}: {error}"
            raise
        return inputs, hidden, logits

    def _run_eager(
        self, work: ForwardWork, features: dict[int, torch.Tensor] | None
    ) -> tuple[ForwardInputs, torch.Tensor, torch.Tensor | None]:
        """The forward launched kernel by kernel, and the logits of `work.logit_rows`."""
        inputs = self.view.inputs(work.spans)
        hidden = self.forward(inputs, work.spans, features)  # [T, hidden]
        logits = None
        if work.logit_rows:
            first, count = work.logit_rows[0], len(work.logit_rows)
            if work.logit_rows == list(range(first, first + count)):
                selected = hidden[first : first + count]  # a view: no gather (decode steps)
            else:
                selected = hidden[torch.tensor(work.logit_rows, dtype=torch.long, device=self.device)]
            logits = self.compute_logits(selected)
        return inputs, hidden, logits

    def run_empty(self) -> None:
        """A forward over no tokens: a rank without work steps through the MoE layers' all-to-alls
        with the ranks that have some."""
        self.run(ForwardWork([], [], []))

    def handle(self, work: ForwardWork | RebalanceExperts) -> None:
        """A message from rank 0 (on the other ranks of a tensor-parallel group)."""
        if isinstance(work, RebalanceExperts):
            self.rebalance_experts()
        else:
            self.run(work)

    @torch.inference_mode()
    def rebalance_experts(self) -> None:
        """EPLB: every rank re-places its experts from the load recorded since the last time."""
        if self.experts is None:
            raise RuntimeError("expert-load balancing needs an expert-parallel MoE model with --enable-eplb")
        if self.peers is not None:
            self.peers.submit(RebalanceExperts())
        self.experts.rebalance()

    def prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits [L, V] at every position of a sequence whose blocks are allocated (scoring, tests)."""
        span = RowSpan(self.view.tables(seq), 0, list(seq.token_ids))
        _, _, logits = self.run(ForwardWork([span], [], list(range(len(span.token_ids)))))
        assert logits is not None
        return logits

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Copy blocks, run the forward of every scheduled item (drafts included), and sample the
        items that end at their last token and carry no drafts (the verifier samples those)."""
        return self.run_prepared(self.prepare(plan))

    def prepare(self, plan: SchedulerOutput) -> PreparedStep:
        """Read the plan off its sequences (their tokens, block tables, sampling state); mutates
        nothing. The sequences may change afterwards without affecting the prepared step."""
        items = list(plan.scheduled)
        spans = [self._span(item) for item in items]
        offsets, _ = span_offsets(spans)
        hidden_rows: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[Sequence] = []
        for item, offset in zip(items, offsets):
            if not item.sample or item.num_draft_tokens:
                continue
            for seq in (item.seq, *item.forks):
                hidden_rows.append(offset + item.num_new_tokens - 1)
                rows.append(self.sampling_row(seq))
                owners.append(seq)
        # Forks share their parent's row: compute logits once per distinct row.
        inverse = None
        if any(a >= b for a, b in pairwise(hidden_rows)):
            unique, inverse = torch.unique(torch.tensor(hidden_rows, dtype=torch.long), return_inverse=True)
            hidden_rows = unique.tolist()
        work = ForwardWork(spans, list(plan.block_copies), hidden_rows)
        return PreparedStep(items, work, rows, owners, inverse)

    @torch.inference_mode()
    def run_prepared(self, step: PreparedStep) -> StepResult:
        """The forward of a prepared step and its sampling (grammar masks applied, the sampled
        tokens accepted by the grammars). Mutates the KV caches, the grammar matchers and the
        seeded generators."""
        rows, owners = step.rows, step.owners
        features: dict[int, torch.Tensor] | None = {} if self.feature_layers else None
        inputs, hidden, unique_logits = self.run(step.work, features)
        sampled: dict[int, list[SampledToken]] = {}
        failures: dict[str, str] = {}
        if rows:
            assert unique_logits is not None
            # [N, V]; without forks the rows are already in order (a gather of the vocabulary
            # per row costs tens of microseconds at batch 1)
            logits = unique_logits if step.inverse is None else unique_logits[step.inverse.to(self.device)]
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
        kept = (
            torch.cat([features[layer] for layer in self.feature_layers], dim=-1)
            if features is not None
            else None
        )
        return StepResult(sampled, failures, hidden, step.items, inputs.offsets, kept)
