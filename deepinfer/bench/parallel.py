"""`deepinfer bench parallel`: one process against two ranks on the same machine, same run.

- The default model: tensor parallelism over 2 ranks of 1 thread each (gloo on loopback) against
  one process with 2 threads, both in fp32 (TP dequantizes the GGUF), and the one process on the
  gguf kernels, the default. Throughput (N random prompts at once) and batch-1 latency (time to
  first token, then time per output token).
- A tiny DeepSeek-V3 MoE (8 experts, built here from random weights in the official format):
  attention data parallelism with the experts sharded over 2 ranks (EP=2) against one process.
- What the communication costs per engine step, measured on rank 0: calls, bytes and seconds in
  the collectives (seconds include waiting for the other rank to arrive), and the seconds spent
  handing the step plan to the other rank (tensor parallel: shared memory + a pipe byte).

    deepinfer bench parallel --result-json bench-results/parallel.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from deepinfer.bench.offline import random_prompts
from deepinfer.bench.report import markdown_table, provenance, write_json


class StepCounter:
    """Counts the engine's steps and times the step-plan hand-off (tensor parallel)."""

    def __init__(self, engine: Any) -> None:
        self.steps = 0
        self.publish_s = 0.0
        core = engine.core
        original_step = core.step

        def step() -> Any:
            self.steps += 1
            return original_step()

        core.step = step
        peers = getattr(getattr(core, "runner", None), "peers", None)
        if peers is not None:
            original_submit = peers.submit

            def submit(work: Any) -> None:
                began = time.perf_counter()
                original_submit(work)
                self.publish_s += time.perf_counter() - began

            peers.submit = submit

    def reset(self) -> None:
        self.steps, self.publish_s = 0, 0.0


def _comm(engine: Any) -> Any:
    core = engine.core
    parallel = getattr(core, "parallel", None) or getattr(getattr(core, "core", None), "parallel", None)
    return parallel.comm if parallel is not None else None


def _measure(llm: Any, counter: StepCounter, run: Any) -> dict[str, Any]:
    """Seconds of `run()`, with the steps and the communication it took."""
    comm = _comm(llm.engine)
    counter.reset()
    if comm is not None:
        comm.stats.reset()
    began = time.perf_counter()
    run()
    seconds = time.perf_counter() - began
    out: dict[str, Any] = {"seconds": seconds, "steps": counter.steps}
    if comm is not None and counter.steps:
        stats = comm.stats
        out["comm_per_step"] = {
            "calls": stats.calls / counter.steps,
            "bytes": stats.bytes / counter.steps,
            "ms": 1e3 * stats.seconds / counter.steps,
            "by_op": {
                op: [v[0] / counter.steps, v[1] / counter.steps, 1e3 * v[2] / counter.steps]
                for op, v in stats.by_op.items()
            },
            "plan_handoff_ms": 1e3 * counter.publish_s / counter.steps,
        }
    return out


def _engine_run(
    name: str, llm: Any, prompts: list[list[int]], args: argparse.Namespace, latency_prompt: list[int] | None
) -> dict[str, Any]:
    from deepinfer import SamplingParams

    counter = StepCounter(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(
        batch[:2],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
        cache_salt="warm-up",
    )
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {"engine": name}
    throughput = _measure(
        llm, counter, lambda: llm.generate(batch, params, use_tqdm=False, cache_salt="throughput")
    )
    output_tokens = len(prompts) * args.output_len
    prompt_tokens = sum(map(len, prompts))
    throughput["output_tokens_per_s"] = output_tokens / throughput["seconds"]
    throughput["total_tokens_per_s"] = (output_tokens + prompt_tokens) / throughput["seconds"]
    result["throughput"] = throughput
    if latency_prompt is not None:
        one = [{"prompt_token_ids": latency_prompt}]
        first = SamplingParams(temperature=0.0, max_tokens=1)
        ttft = min(
            _measure(
                llm, counter, lambda i=i: llm.generate(one, first, use_tqdm=False, cache_salt=f"ttft-{i}")
            )["seconds"]
            for i in range(args.repeats)
        )
        decode_params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
        decode = _measure(
            llm, counter, lambda: llm.generate(one, decode_params, use_tqdm=False, cache_salt="decode")
        )
        decode["ttft_s"] = ttft
        decode["tpot_s"] = (decode["seconds"] - ttft) / args.decode_tokens
        result["latency"] = decode
    result["load_average_1m"] = [load_before, os.getloadavg()[0]]
    return result


def _tiny_moe(directory: Path) -> Path:
    from tests.deepseek.tiny_checkpoint import build_checkpoint

    if not (directory / "config.json").exists():
        build_checkpoint(directory, {}, fp8=False, seed=0)
    return directory


def run(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    results: list[dict[str, Any]] = []
    # Tensor parallelism runs the GGUF dequantized (fp32), so the like-for-like single process is
    # fp32 too; the single process on the gguf kernels (the default) is shown beside them.
    default_model = {
        "tp1 fp32 (1 process, 2 threads)": {"num_threads": 2, "quantization": "none"},
        "tp2 fp32 (2 ranks x 1 thread)": {"tensor_parallel_size": 2, "num_threads": 1},
        "tp1 gguf (1 process, 2 threads)": {"num_threads": 2, "quantization": "gguf"},
    }
    prompts = latency_prompt = None
    for name, options in default_model.items():
        llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, **options)
        if prompts is None:
            tokenizer = llm.get_tokenizer()
            prompts = random_prompts(
                tokenizer, args.num_prompts, args.input_len_min, args.input_len_max, args.seed
            )
            [latency_prompt] = random_prompts(
                tokenizer, 1, args.latency_input_len, args.latency_input_len, args.seed + 1
            )
        results.append({"model": "default", **_engine_run(name, llm, prompts, args, latency_prompt)})
        llm.close()
    with tempfile.TemporaryDirectory() as scratch:
        moe = str(_tiny_moe(Path(args.moe_model) if args.moe_model else Path(scratch) / "tiny-v3"))
        import torch

        generator = torch.Generator().manual_seed(args.seed)
        moe_prompts = [
            torch.randint(3, 400, (int(n),), generator=generator).tolist()
            for n in torch.randint(32, 129, (args.num_prompts,), generator=generator)
        ]
        sparse = {
            "ep1 (1 process, 2 threads)": {"num_threads": 2},
            "dp2+ep2 (2 ranks x 1 thread)": {
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "num_threads": 1,
            },
            "tp2+ep2 (2 ranks x 1 thread)": {
                "tensor_parallel_size": 2,
                "enable_expert_parallel": True,
                "num_threads": 1,
            },
        }
        for name, options in sparse.items():
            llm = LLM(moe, num_blocks=512, **options)
            results.append({"model": "tiny-deepseek-v3", **_engine_run(name, llm, moe_prompts, args, None)})
            llm.close()
    rows = []
    for r in results:
        t = r["throughput"]
        lat = r.get("latency", {})
        comm = (lat or t).get("comm_per_step")
        rows.append(
            [
                r["model"],
                r["engine"],
                f"{t['output_tokens_per_s']:.1f}",
                f"{t['total_tokens_per_s']:.1f}",
                f"{lat['ttft_s'] * 1e3:.0f} ms" if lat else "-",
                f"{lat['tpot_s'] * 1e3:.1f} ms" if lat else "-",
                (
                    f"{comm['calls']:.0f} calls, {comm['bytes'] / 1024:.0f} KiB, {comm['ms']:.1f} ms + plan {comm['plan_handoff_ms']:.2f} ms"
                    if comm
                    else "-"
                ),
                f"{r['load_average_1m'][0]:.1f}-{r['load_average_1m'][1]:.1f}",
            ]
        )
    print(
        markdown_table(
            [
                "model",
                "engine",
                "output tok/s",
                "total tok/s",
                "TTFT",
                "TPOT",
                "comm per step (rank 0)",
                "load avg",
            ],
            rows,
        )
    )
    if args.result_json:
        write_json(args.result_json, {"benchmark": "parallel", **provenance(), "results": results})
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("parallel", help="tensor / data / expert parallelism over 2 ranks vs 1 process")
    p.add_argument("--model", default=None, help="dense model (default: the embedded SmolLM2)")
    p.add_argument(
        "--moe-model", default=None, help="a DeepSeek-V3 directory (default: a tiny one built here)"
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--latency-input-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json")
    return p
