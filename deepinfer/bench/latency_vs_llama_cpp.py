"""Batch-1 latency of our engine and llama.cpp side by side, in one run, on the same prompt ids.

    .venv/bin/python -m deepinfer.bench.latency_vs_llama_cpp [--llama-server PATH] [--rounds 3]

The measurement of `deepinfer bench latency` (one random prompt of --input-len tokens, then
--output-len tokens greedy with EOS ignored; TTFT = time to the first output token, TPOT = the
rest divided by output-len - 1; best of the rounds), for each of our configurations in process,
and for `llama-server` (one slot, prompt cache off) the timings it reports for the same prompt
ids: prompt_ms as TTFT and predicted_per_token_ms as TPOT, both without HTTP, as ours are.
Engines alternate round by round, so a load change on this shared machine hits all of them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass, field

import httpx

from deepinfer.bench.offline import random_prompts
from deepinfer.bench.report import markdown_table, provenance
from deepinfer.bench.server_process import running_server
from deepinfer.model.loader.source import default_model_path

OURS = {
    "deepinfer gguf (the default: bf16 KV with bf16 instructions, else fp16)": {},
    "deepinfer gguf, fp16 KV": {"kv_cache_dtype": "float16"},
    "deepinfer gguf, fp32 KV": {"kv_cache_dtype": "float32"},
    "deepinfer fp32 (quantization=none)": {"quantization": "none"},
}


@dataclass(slots=True)
class Best:
    ttft_s: float = float("inf")
    tpot_s: float = float("inf")
    loads: list[float] = field(default_factory=list)

    def update(self, ttft: float, tpot: float) -> None:
        self.ttft_s, self.tpot_s = min(self.ttft_s, ttft), min(self.tpot_s, tpot)
        self.loads.append(os.getloadavg()[0])


def ours_once(engine, prompt: list[int], output_len: int) -> tuple[float, float]:
    from deepinfer import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
    return first - start, (time.perf_counter() - first) / (output_len - 1)


def llama_once(base: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    body = {
        "prompt": prompt,
        "n_predict": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    timings = httpx.post(f"{base}/completion", json=body, timeout=600).json()["timings"]
    if timings["predicted_n"] != output_len or timings["prompt_n"] != len(prompt):
        raise RuntimeError(f"llama-server did not run the whole request: {timings}")
    return timings["prompt_ms"] / 1e3, timings["predicted_per_token_ms"] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--llama-server", default=shutil.which("llama-server") or "build/llama-bin/llama-server"
    )
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18792)
    args = parser.parse_args()

    from deepinfer import LLM

    engines = {
        name: LLM(kv_cache_memory=256 << 20, num_threads=args.threads, **o) for name, o in OURS.items()
    }
    [prompt] = random_prompts(
        next(iter(engines.values())).get_tokenizer(), 1, args.input_len, args.input_len, 0
    )
    results = {name: Best() for name in [*OURS, "llama.cpp"]}
    base = f"http://127.0.0.1:{args.port}"
    command = [args.llama_server, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(args.port),
               "-np", "1", "-c", str(args.input_len + args.output_len + 64), "-t", str(args.threads),
               "-tb", str(args.threads), "--no-webui"]  # fmt: skip
    header = provenance()
    with running_server(command, base, 300, ready_path="/health"):
        llama_once(base, prompt[:16], 4)  # warm-up
        for llm in engines.values():
            ours_once(llm.engine, prompt[:16], 4)
        for _ in range(args.rounds):
            results["llama.cpp"].update(*llama_once(base, prompt, args.output_len))
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                results[name].update(*ours_once(llm.engine, prompt, args.output_len))
    llama = results["llama.cpp"]
    rows = []
    for name, best in results.items():
        rows.append([
            name, f"{best.ttft_s * 1e3:.1f}", f"{best.tpot_s * 1e3:.2f}", f"{1 / best.tpot_s:.1f}",
            f"{llama.tpot_s / best.tpot_s:.2f}×", f"{args.input_len / best.ttft_s:.0f}",
            f"{llama.ttft_s / best.ttft_s:.2f}×", " ".join(f"{x:.1f}" for x in best.loads),
        ])  # fmt: skip
    print(f"{header['date']} {header['machine']['cpu']}, {args.threads} threads; prompt {args.input_len} tokens, "
          f"{args.output_len} out, best of {args.rounds}; `{' '.join(command)}`")  # fmt: skip
    columns = ["engine", "TTFT ms", "TPOT ms", "decode tok/s", "decode vs llama.cpp", "prefill tok/s",
               "prefill vs llama.cpp", "load avg per round"]  # fmt: skip
    print(markdown_table(columns, rows))


if __name__ == "__main__":
    main()
