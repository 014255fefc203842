"""Our own offline engine as a peer: the same prompts as the HTTP run, no server in between.

Set beside `deepinfer serve` in `bench peers`, it measures what the HTTP layer, the IPC to the
engine process and detokenization on the API side cost. Conversations are rendered exactly as
the server renders them (`LLM.render_chat`), at most ``max_concurrency`` requests are in the
engine at once (a finished one lets the next in, like a concurrency-capped client), decoding is
greedy with exactly ``output_len`` tokens, and every step that gives a request new tokens is
timestamped, which yields TTFT, inter-token gaps and end-to-end times in the same form as the
HTTP benchmark.
"""

from __future__ import annotations

import time
from pathlib import Path

from deepinfer.bench.client import RequestResult
from deepinfer.bench.datasets import BenchRequest, Dataset
from deepinfer.bench.serve import RunOutcome


def _messages(request: BenchRequest) -> list[dict[str, str]]:
    system = [{"role": "system", "content": request.system}] if request.system else []
    return system + request.messages


def run_offline(gguf_path: Path, dataset: Dataset, max_concurrency: int, threads: int) -> RunOutcome:
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(gguf_path), num_threads=threads)
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, not measured
    waiting = list(dataset.requests)
    prompts = {r.request_id: llm.render_chat(_messages(r)) for r in waiting}
    results: dict[str, RequestResult] = {}
    last_token_at: dict[str, float] = {}
    run_start = time.perf_counter()
    while waiting or engine.has_unfinished_requests():
        while waiting and len(results) - sum(r.success for r in results.values()) < max_concurrency:
            request = waiting.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            engine.add_request(prompts[request.request_id], params, request_id=request.request_id)
            results[request.request_id] = RequestResult(
                request_id=request.request_id,
                session_id=request.session_id,
                turn=request.turn,
                start_s=time.perf_counter() - run_start,
                prompt_tokens=len(prompts[request.request_id]),
                approx_input_tokens=request.approx_input_tokens,
                requested_output_tokens=request.output_len,
            )
        outputs = engine.step()
        now = time.perf_counter() - run_start
        for output in outputs:
            result = results[output.request_id]
            tokens = len(output.outputs[0].token_ids)
            if tokens > result.output_tokens:
                if result.ttft_s is None:
                    result.ttft_s = now - result.start_s
                else:
                    result.itl_s.append(now - last_token_at[output.request_id])
                last_token_at[output.request_id] = now
                result.output_tokens = result.content_chunks = tokens
            if output.finished:
                result.success = True
                result.e2e_s = now - result.start_s
                result.output_tokens_source = "usage"
                result.cached_tokens = output.num_cached_tokens
    duration = time.perf_counter() - run_start
    llm.close()
    return RunOutcome(max_concurrency, float("inf"), duration, list(results.values()))
