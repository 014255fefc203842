"""The HF transformers peer: the same prompts through batched ``generate`` on the GGUF (fp32).

There is no server, so the load shape is reproduced in process: prompts go in batches of
``max_concurrency`` (the whole batch arrives together, like a concurrency-capped client at
time zero), with greedy decoding and exactly ``output_len`` new tokens. A stopping criterion
timestamps every step, which gives TTFT (first step), inter-token gaps and end-to-end time per
request in the same RequestResult form the HTTP benchmark uses.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from deepinfer.bench.client import RequestResult
from deepinfer.bench.datasets import Dataset
from deepinfer.bench.serve import RunOutcome


def _chat_messages(request: Any) -> list[dict[str, str]]:
    system = [{"role": "system", "content": request.system}] if request.system else []
    return system + request.messages


def run_transformers(gguf_path: Path, dataset: Dataset, max_concurrency: int, threads: int) -> RunOutcome:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        """Records when each decoding step finished; never stops generation."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    torch.set_num_threads(threads)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()

    requests = dataset.requests
    results: list[RequestResult] = []
    run_start = time.perf_counter()
    for first in range(0, len(requests), max_concurrency):
        batch = requests[first : first + max_concurrency]
        output_len = max(r.output_len for r in batch)
        texts = [
            tokenizer.apply_chat_template(_chat_messages(r), add_generation_prompt=True, tokenize=False)
            for r in batch
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        clock = StepClock()
        sent_at = time.perf_counter()
        with torch.inference_mode():
            generated = model.generate(
                **encoded,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        done = time.perf_counter()
        new_tokens = generated.shape[1] - encoded["input_ids"].shape[1]
        gaps = [later - earlier for earlier, later in itertools.pairwise(clock.times)]
        for row, request in enumerate(batch):
            results.append(
                RequestResult(
                    request_id=request.request_id,
                    session_id=request.session_id,
                    turn=request.turn,
                    success=True,
                    start_s=sent_at - run_start,
                    ttft_s=clock.times[0] - sent_at,
                    e2e_s=done - sent_at,
                    itl_s=list(gaps),
                    output_tokens=new_tokens,
                    output_tokens_source="usage",
                    content_chunks=new_tokens,
                    prompt_tokens=int(encoded["attention_mask"][row].sum()),
                    approx_input_tokens=request.approx_input_tokens,
                    requested_output_tokens=request.output_len,
                )
            )
    return RunOutcome(max_concurrency, float("inf"), time.perf_counter() - run_start, results)
