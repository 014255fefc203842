"""Decode CUDA graphs (runner/graphs.py) in the engine: a tiny Llama on the Triton backend decodes
the same greedy tokens with graphs as without them and as the C kernel backend, batches padded
to a captured size, a batch past the largest size falling back to eager, and the padding rows
writing only the scratch block.

On the CPU (Triton interpreted) the capture is `ReplayByCall`: it records the step and replays
it by calling it again on the same static buffers, which is what a graph replay does, so
everything but torch.cuda.CUDAGraph itself runs here. Under DEEPINFER_TEST_DEVICE=cuda
(deepinfer/bench/device_check.sh) the engine captures real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.runner import graphs as graphs_module
from tests.triton.replay import ReplayByCall
from tests.triton.tiny_llama import CONFIGS, greedy, write_checkpoint


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory, default_model_path):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), default_model_path)


def test_decode_graphs_greedy_equals_eager_and_cpu(checkpoint, device, monkeypatch):
    prompts = [[(13 * i + 7 * j) % 48000 + 100 for j in range(4 + 5 * i)] for i in range(5)]
    options = dict(
        model=str(checkpoint), dtype="float32", block_size=4, num_blocks=96, num_threads=1,
        enable_prefix_caching=False,
    )  # fmt: skip
    cpu = LLM(attention_backend="cpu_paged", device="cpu", **options)
    eager = LLM(attention_backend="triton", device=device, enforce_eager=True, **options)
    assert eager.engine.core.runner.graphs is None
    stand_in = ReplayByCall()
    if device == "cpu":
        monkeypatch.setattr(graphs_module, "decode_graph_capture", lambda *_: stand_in)
    graphed = LLM(attention_backend="triton", device=device, cuda_graph_sizes="1,2,4", **options)
    runner = graphed.engine.core.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    steps: list[tuple[int, bool]] = []  # (rows, replayed) of every step the graphs were offered
    run = graphs.run

    def counted(work):
        result = run(work)
        steps.append((len(work.spans), result is not None))
        return result

    monkeypatch.setattr(graphs, "run", counted)

    # three rows pad to four; prompts of different lengths end their prefill apart
    three = prompts[:3]
    assert greedy(graphed, three, 6) == greedy(eager, three, 6) == greedy(cpu, three, 6)
    assert (3, True) in steps and 4 in graphs.graphs
    # five rows are past the largest size: eager
    steps.clear()
    assert greedy(graphed, prompts, 4) == greedy(eager, prompts, 4) == greedy(cpu, prompts, 4)
    assert (5, False) in steps and all(replayed == (rows <= 4) for rows, replayed in steps)
    if device == "cpu":
        assert stand_in.captures == len(graphs.graphs)

    # Both engines placed the same blocks: every real slot holds the eager engine's K/V (the
    # padding rows wrote none of them), and the scratch block past them holds the padding's.
    # On CUDA the padded batch may take other GEMM kernels than the eager one (rounding apart); a
    # padding row writing into a real slot would differ by the values themselves.
    tol = 1e-5 if device == "cpu" else 1e-3
    real = eager.engine.core.runner.kv_caches[0].shape[0]
    for mine, theirs in zip(runner.kv_caches, eager.engine.core.runner.kv_caches):
        torch.testing.assert_close(mine[:real], theirs, atol=tol, rtol=tol)
        assert mine[real:].abs().sum() > 0


def test_size_for_pads_up_and_refuses_what_it_cannot_replay():
    from deepinfer.runner.inputs import ForwardWork, RowSpan

    graphs = graphs_module.DecodeGraphs.__new__(graphs_module.DecodeGraphs)
    graphs.sizes, graphs.max_context = [1, 2, 4, 8], 64

    def decode(rows: int, start: int = 10) -> ForwardWork:
        return ForwardWork([RowSpan([[0, 1]], start, [5]) for _ in range(rows)], [], list(range(rows)))

    assert [graphs.size_for(decode(n)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.size_for(decode(9)) is None  # past the largest size
    assert graphs.size_for(decode(2, start=64)) is None  # past the captured context
    mixed = decode(2)
    mixed.spans.append(RowSpan([[0, 1]], 0, [5, 6, 7]))
    mixed.logit_rows = [0, 1, 4]
    assert graphs.size_for(mixed) is None  # a prefill chunk in the step
    unsampled = decode(2)
    unsampled.logit_rows = [1]
    assert graphs.size_for(unsampled) is None


def test_default_sizes_follow_max_num_seqs():
    assert graphs_module.default_sizes(1) == [1]
    assert graphs_module.default_sizes(6) == [1, 2, 4, 6]
    assert graphs_module.default_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graphs_module.decode_graph_capture(torch.device("cpu"), False) is None


class FailingCapture:
    def capture(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_the_engine_eager(checkpoint, device, monkeypatch):
    options = dict(model=str(checkpoint), dtype="float32", block_size=4, num_blocks=32, num_threads=1)
    monkeypatch.setattr(graphs_module, "decode_graph_capture", lambda *_: FailingCapture())
    graphed = LLM(attention_backend="triton", device=device, cuda_graph_sizes="2", **options)
    cpu = LLM(attention_backend="cpu_paged", device="cpu", **options)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    assert greedy(graphed, prompts, 3) == greedy(cpu, prompts, 3)
    graphs = graphed.engine.core.runner.graphs
    assert graphs.sizes == [] and not graphs.graphs
