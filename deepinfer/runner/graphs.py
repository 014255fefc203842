"""CUDA graphs for decode steps: a pure-decode step (every row one token) replays a graph
captured for the next batch size up, instead of launching each layer's kernels from Python.

A graph replays fixed device addresses, so the step's inputs and attention metadata live in
static buffers sized for the largest batch: the step is laid out on the host as usual
(RowSpans -> ForwardInputs), padded with scratch rows to the captured size, copied into the
buffers, and the graph replays; the real rows' hidden states and logits are read back. A padding
row is token 0 at position 0 of its own block, the caches' scratch block (KVCaches), which no
sequence owns: it writes its K/V there and attends to that one slot, and its logits are dropped.

The decode kernel's number of parts per row (a host-side launch size) is fixed at capture for
the longest context a graph serves (`max_context`); a longer row, a mixed step (prefill chunks,
drafts), a batch past the largest size and a step that keeps features or splices images run
eagerly. Graphs are captured lazily, on a size's first step: capturing every size at start would
cost a warm-up forward and the Triton compilations of each, most of them for batch sizes a
server may never see.

The capture itself is a `GraphCapture`: `CudaGraphCapture` on CUDA; the CPU tests give one that
replays by calling the step again on the same static buffers, which is what a replay does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.attention.metadata import AttentionMetadata, ForwardMetadata
from deepinfer.runner.inputs import ForwardInputs, ForwardWork, RowSpan
from deepinfer.runner.kv_caches import CacheView

log = logging.getLogger(__name__)

# The forward of a step and its logits: hidden [B, hidden], logits [B, V].
GraphStep = Callable[[ForwardInputs], tuple[torch.Tensor, torch.Tensor]]
# Contexts past this many positions decode eagerly: the captured decode splits every row into
# max_context / 128 parts, and its partial sums grow with the batch times that.
DEFAULT_MAX_CONTEXT = 8192


class GraphCapture(Protocol):
    def capture(
        self, step: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable[[], None]]:
        """Record `step`: the tensors it returns (rewritten by every replay) and the replay."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every size's graph in one memory pool (they never run at once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: tuple[int, int] | None = None

    def capture(
        self, step: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable[[], None]]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        # Warm-up off the capture stream, as torch asks: compiles the Triton kernels and lets the
        # allocator settle. It runs the step on the real inputs already in the static buffers,
        # rewriting the same K/V to the same slots, so it changes nothing the replay then reads.
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the engine (grammar masks) may use CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = step()
        if self._pool is None:
            self._pool = graph.pool()
        return outputs, graph.replay


def decode_graph_capture(device: torch.device, enforce_eager: bool) -> GraphCapture | None:
    """The capture the engine uses on `device`: CUDA graphs on CUDA unless --enforce-eager;
    None (every step eager) elsewhere."""
    if device.type != "cuda" or enforce_eager:
        return None
    return CudaGraphCapture(device)


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's spacing), and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


@dataclass(slots=True)
class _Graph:
    hidden: torch.Tensor  # [B, hidden]
    logits: torch.Tensor  # [B, V]
    replay: Callable[[], None]


class DecodeGraphs:
    def __init__(
        self,
        view: CacheView,
        step: GraphStep,
        capture: GraphCapture,
        sizes: list[int],
        max_context: int,
    ) -> None:
        """`view`: the target's caches, allocated with a scratch block; `step`: the forward and
        logits over given inputs; `sizes`: the batch sizes graphs are captured for."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph sizes must be positive batch sizes, got {sizes}")
        self.view = view
        self.step = step
        self.capture = capture
        self.sizes = sorted(set(sizes))
        self.max_context = max_context
        self.graphs: dict[int, _Graph] = {}
        largest, device = self.sizes[-1], view.device
        self._scratch = [layout.num_blocks for layout in view.groups]
        self._ids = torch.zeros(largest, dtype=torch.long, device=device)
        self._positions = torch.zeros(largest, dtype=torch.long, device=device)
        self._slots, self._tables, self._lens = [], [], []
        for layout in view.groups:
            entries = math.ceil(max_context / layout.group.tokens_per_entry)
            width = math.ceil(entries / layout.entries_per_block)
            self._slots.append(torch.zeros(largest, dtype=torch.long, device=device))
            self._tables.append(torch.zeros(largest, width, dtype=torch.long, device=device))
            self._lens.append(torch.ones(largest, dtype=torch.long, device=device))

    def size_for(self, work: ForwardWork) -> int | None:
        """The captured size a step pads to; None when it runs eagerly."""
        spans, count = work.spans, len(work.spans)
        if not count or not self.sizes or count > self.sizes[-1] or work.logit_rows != list(range(count)):
            return None
        for span in spans:
            if len(span.token_ids) != 1 or span.images or span.start + 1 > self.max_context:
                return None
        return next(size for size in self.sizes if size >= count)

    def run(self, work: ForwardWork) -> tuple[ForwardInputs, torch.Tensor, torch.Tensor] | None:
        """(inputs, hidden [N, hidden], logits [N, V]) of the step's N rows from a graph, or None
        (the step runs eagerly). The inputs are the padded step's: its offsets are the real
        rows' (padding comes after them)."""
        size = self.size_for(work)
        if size is None:
            return None
        pad = RowSpan([[block] for block in self._scratch], 0, [0])
        inputs = self.view.inputs(work.spans + [pad] * (size - len(work.spans)))
        self._load(inputs, size)
        graph = self.graphs.get(size)
        if graph is None:
            try:
                graph = self.graphs[size] = self._capture(size)
            except Exception:
                # A step that cannot be captured still runs, eagerly, and so do the next ones.
                log.exception("capturing the decode step of %d rows failed: CUDA graphs off", size)
                self.sizes = []
                return None
        graph.replay()
        count = len(work.spans)
        inputs.offsets = inputs.offsets[:count]
        # The hidden states outlive the step (speculative decoding reads them): a copy, since the
        # next replay rewrites the graph's; the logits are sampled before that.
        return inputs, graph.hidden[:count].clone(), graph.logits[:count]

    def _load(self, inputs: ForwardInputs, size: int) -> None:
        """The padded step's inputs into the first `size` rows of the static buffers."""
        self._ids[:size].copy_(inputs.input_ids)
        self._positions[:size].copy_(inputs.positions)
        for g, meta in enumerate(inputs.meta.groups):
            self._slots[g][:size].copy_(meta.slot_mapping)
            self._lens[g][:size].copy_(meta.seq_lens)
            # Columns past a row's context are never read: stale ones may stay.
            width = min(meta.block_tables.shape[1], self._tables[g].shape[1])
            self._tables[g][:size, :width].copy_(meta.block_tables[:, :width])

    def _capture(self, size: int) -> _Graph:
        groups = [
            AttentionMetadata(
                slot_mapping=self._slots[g][:size],
                block_tables=self._tables[g][:size],
                seq_lens=self._lens[g][:size],
                query_lens=[1] * size,
                # The longest context served: the decode kernel's parts are fixed by it.
                seq_lens_list=[self.max_context] * size,
                num_decodes=size,
                block_size=layout.entries_per_block,
                window=layout.group.window,
            )
            for g, layout in enumerate(self.view.groups)
        ]
        static = ForwardInputs(
            self._ids[:size], self._positions[:size], ForwardMetadata(groups, [0] * size), list(range(size))
        )
        (hidden, logits), replay = self.capture.capture(lambda: self.step(static))
        return _Graph(hidden, logits, replay)
