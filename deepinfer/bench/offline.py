"""`bench throughput` and `bench latency`: the offline engine, measured the way users measure it.

throughput: N random prompts (lengths uniform in [min, max]), a fixed number of output tokens
each (ignore_eos), all submitted at once. Reports output and total tokens/s, and model-FLOPs
utilization against the fp32 GEMM peak measured on the same machine in the same run. With
--compare-hf, HF transformers' batched `generate` runs the same prompts (left-padded batches,
greedy, fixed length) in the same process afterwards, and the ratio is reported.

Model FLOPs of a run are the work the workload needs, nothing padded or wasted: every prompt and
generated position costs 2 x (non-embedding matmul weights) plus attention at its context length,
and every sampled position also pays the LM head (2 x hidden x vocab). Prefill positions whose
logits are never used pay no LM head.

latency: batch-1 time to first token for a prompt of --input-len tokens, and the per-token
decode time after it.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from deepinfer.bench.peak import DEFAULT_GEMM_SIZES, measure_gemm_flops, measure_int8_gemm_ops
from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.engine.parallel.cores import usable_cpus


def _model_dims(config: Any) -> dict[str, int]:
    return {
        "hidden": config.hidden_size,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "inter": config.intermediate_size,
        "vocab": config.vocab_size,
    }


def workload_flops(config: Any, prompt_lens: list[int], output_len: int) -> float:
    """FLOPs the workload needs (see the module docstring)."""
    d = _model_dims(config)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    per_layer = d["hidden"] * (q + 2 * kv) + q * d["hidden"] + 3 * d["hidden"] * d["inter"]
    dense = 2.0 * d["layers"] * per_layer
    attention_per_position = 4.0 * d["layers"] * q  # QK^T and PV, per attended position
    head = 2.0 * d["hidden"] * d["vocab"]
    total = 0.0
    for prompt_len in prompt_lens:
        positions = prompt_len + output_len - 1  # the last sampled token is never fed back
        total += dense * positions
        total += attention_per_position * positions * (positions + 1) / 2  # position p attends p + 1 keys
        total += head * output_len
    return total


def random_prompts(tokenizer: Any, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Token ids drawn from ordinary (non-special) tokens."""
    rng = random.Random(seed)
    special = tokenizer.special_token_ids
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"num_threads": args.threads}
    forwarded = (
        "max_num_batched_tokens",
        "max_num_seqs",
        "kv_cache_memory",
        "block_size",
        "quantization",
        "kv_cache_dtype",
    )
    for name in forwarded:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return options


def run_hf(
    model_path: str | None, prompts: list[list[int]], output_len: int, batch_size: int, threads: int
) -> float:
    """Seconds for HF transformers' batched greedy generate over the same prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from deepinfer.model.loader.source import resolve_model_path

    torch.set_num_threads(threads)
    path = resolve_model_path(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent if kwargs else path), dtype=torch.float32, **kwargs
    )
    model.eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False, pad_token_id=0
            )
    return time.perf_counter() - start


def run_throughput(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    fp32_peak = max(measure_gemm_flops(DEFAULT_GEMM_SIZES, args.threads).values())
    # int8 linears run against the int8 GEMM peak, not the fp32 one.
    peak = (
        measure_int8_gemm_ops(DEFAULT_GEMM_SIZES, args.threads) if args.quantization == "int8" else fp32_peak
    )
    llm = LLM(args.model, **engine_options(args))
    prompts = random_prompts(
        llm.get_tokenizer(), args.num_prompts, args.input_len_min, args.input_len_max, args.seed
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up: kernels, allocator
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start

    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    config = llm.engine.core.loaded.config
    flops = workload_flops(config, [len(p) for p in prompts], args.output_len)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        **provenance(),
        "model": llm.engine.core.loaded.name,
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
        "model_flops": flops,
        "achieved_flops_per_s": flops / seconds,
        "peak_gemm_flops_per_s": peak,
        "peak_kind": "int8" if args.quantization == "int8" else "fp32",
        "mfu": flops / seconds / peak,
        "engine_options": engine_options(args),
        "preemptions": llm.engine.core.num_preemptions,
    }
    rows = [
        [
            "deepinfer",
            f"{result['output_tokens_per_s']:.1f}",
            f"{result['total_tokens_per_s']:.1f}",
            f"{result['mfu']:.1%}",
            "1.00",
        ]
    ]
    if args.compare_hf:
        del llm
        hf_seconds = run_hf(args.model, prompts, args.output_len, args.hf_batch_size, args.threads)
        hf_out = len(prompts) * args.output_len / hf_seconds
        result["hf"] = {
            "batch_size": args.hf_batch_size,
            "seconds": hf_seconds,
            "output_tokens_per_s": hf_out,
            "total_tokens_per_s": (prompt_tokens + len(prompts) * args.output_len) / hf_seconds,
            "mfu": flops / hf_seconds / fp32_peak,  # fp32 weights
        }
        result["speedup_vs_hf"] = hf_seconds / seconds
        rows.append(
            [
                f"HF transformers generate (batch {args.hf_batch_size})",
                f"{hf_out:.1f}",
                f"{result['hf']['total_tokens_per_s']:.1f}",
                f"{result['hf']['mfu']:.1%}",
                f"{1 / result['speedup_vs_hf']:.2f}",
            ]
        )
    print(markdown_table(["engine", "output tok/s", "total tok/s", "MFU", "time ratio to deepinfer"], rows))
    print(f"fp32 GEMM peak measured: {fp32_peak / 1e9:.1f} GFLOP/s on {args.threads} threads")
    if args.quantization == "int8":
        print(f"int8 GEMM peak measured: {peak / 1e9:.1f} GOP/s (the MFU of int8 runs is against it)")
    if args.result_json:
        write_json(args.result_json, result)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    [prompt] = random_prompts(llm.get_tokenizer(), 1, args.input_len, args.input_len, args.seed)
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    engine = llm.engine
    ttfts, per_token = [], []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        )
        first = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - start)
        per_token.append((end - first) / max(args.output_len - 1, 1))
    best_ttft, best_tpot = min(ttfts), min(per_token)
    result = {
        "benchmark": "latency",
        **provenance(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ttft_s": best_ttft,
        "tpot_s": best_tpot,
        "decode_tokens_per_s": 1.0 / best_tpot,
        "prefill_tokens_per_s": args.input_len / best_ttft,
        "repeats": args.repeats,
    }
    print(
        markdown_table(
            ["input", "TTFT ms", "TPOT ms", "decode tok/s", "prefill tok/s"],
            [
                [
                    args.input_len,
                    f"{best_ttft * 1e3:.1f}",
                    f"{best_tpot * 1e3:.1f}",
                    f"{1 / best_tpot:.1f}",
                    f"{args.input_len / best_ttft:.0f}",
                ]
            ],
        )
    )
    if args.result_json:
        write_json(args.result_json, result)
    return 0


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine options every offline benchmark takes."""
    parser.add_argument("--model", default=None, help="GGUF file or HF dir (default: the embedded model)")
    parser.add_argument(
        "--threads",
        type=int,
        default=usable_cpus(),
        help="default: the CPUs this process may use (affinity, quota)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--kv-cache-memory", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--quantization",
        choices=["none", "int8", "gguf"],
        help="gguf: a GGUF's own blocks (the default for a GGUF); none: fp32; int8: W8A8 linears",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="default: 16 bits for a GGUF (bf16 where the CPU has bf16 instructions, else fp16), else the model dtype",
    )
    parser.add_argument("--result-json")
    parser.add_argument("--quiet", action="store_true")


def add_offline_parsers(commands: Any) -> None:
    """`throughput` and `latency`."""
    throughput = commands.add_parser("throughput", help="offline engine throughput (vs HF transformers)")
    add_common_arguments(throughput)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--input-len-min", type=int, default=128)
    throughput.add_argument("--input-len-max", type=int, default=512)
    throughput.add_argument("--output-len", type=int, default=128)
    throughput.add_argument(
        "--compare-hf", action="store_true", help="also run HF transformers' batched generate"
    )
    throughput.add_argument("--hf-batch-size", type=int, default=32)

    latency = commands.add_parser("latency", help="batch-1 prefill and decode latency")
    add_common_arguments(latency)
    latency.add_argument("--input-len", type=int, default=512)
    latency.add_argument("--output-len", type=int, default=64)
    latency.add_argument("--repeats", type=int, default=3)
