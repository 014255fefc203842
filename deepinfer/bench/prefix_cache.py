"""`deepinfer bench prefix`: prefix caching, TTFT of a hit vs a miss, and its cost at 0% hits."""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepinfer.bench.offline import add_common_arguments, engine_options, random_prompts
from deepinfer.bench.report import markdown_table, provenance, write_json


def ttft(engine: Any, prompt: list[int], cache_salt: str | None = None) -> float:
    from deepinfer import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), cache_salt=cache_salt)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    """Prefix caching: TTFT of a hit vs a miss, and the cost of caching on a workload with no hits."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    tokenizer = llm.get_tokenizer()
    [prefix] = random_prompts(tokenizer, 1, args.prefix_len, args.prefix_len, args.seed)
    suffixes = random_prompts(
        tokenizer, 2 * args.repeats + 1, args.suffix_len, args.suffix_len, args.seed + 1
    )
    ttft(llm.engine, prefix + suffixes[-1], cache_salt="warm-up")
    misses, hits = [], []
    for i in range(args.repeats):
        salt = f"run-{i}"  # a new salt makes the shared prefix a guaranteed miss
        misses.append(ttft(llm.engine, prefix + suffixes[2 * i], cache_salt=salt))
        hits.append(ttft(llm.engine, prefix + suffixes[2 * i + 1], cache_salt=salt))
    miss, hit = min(misses), min(hits)

    # A workload with 0% hits: caching on vs off, alternated so drift hits both equally.
    prompts = random_prompts(
        tokenizer, args.num_prompts, args.input_len_min, args.input_len_max, args.seed + 2
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engines = {
        "on": llm,
        "off": LLM(
            args.model,
            loaded=llm.engine.core.loaded,
            **{**engine_options(args), "enable_prefix_caching": False},
        ),
    }
    best = {"on": float("inf"), "off": float("inf")}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            batch = [{"prompt_token_ids": p} for p in prompts]
            engine.generate(
                batch[:1], SamplingParams(max_tokens=1), use_tqdm=False, cache_salt=f"warm-{round_}"
            )
            start = time.perf_counter()
            engine.generate(batch, params, use_tqdm=False, cache_salt=f"{name}-{round_}")
            best[name] = min(best[name], time.perf_counter() - start)
    output_tokens = args.num_prompts * args.output_len
    result = {
        "benchmark": "prefix",
        **provenance(),
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "ttft_miss_s": miss,
        "ttft_hit_s": hit,
        "hit_over_miss": hit / miss,
        "zero_hit_output_tokens_per_s": {k: output_tokens / v for k, v in best.items()},
        "zero_hit_throughput_ratio_on_over_off": best["off"] / best["on"],
    }
    print(
        markdown_table(
            ["measure", "value"],
            [
                [f"TTFT miss ({args.prefix_len}+{args.suffix_len} tokens)", f"{miss * 1e3:.1f} ms"],
                [f"TTFT hit (prefix of {args.prefix_len} cached)", f"{hit * 1e3:.1f} ms"],
                ["hit / miss", f"{hit / miss:.1%}"],
                ["0%-hit throughput, caching on", f"{output_tokens / best['on']:.1f} tok/s"],
                ["0%-hit throughput, caching off", f"{output_tokens / best['off']:.1f} tok/s"],
                ["on / off", f"{best['off'] / best['on']:.3f}"],
            ],
        )
    )
    if args.result_json:
        write_json(args.result_json, result)
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("prefix", help="prefix caching: TTFT hit vs miss, cost at 0%% hits")
    add_common_arguments(p)
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-min", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    return p
