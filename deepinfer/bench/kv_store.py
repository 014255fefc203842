"""`deepinfer bench kvstore`: TTFT of a prefix loaded from the persistent KV store after a restart."""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepinfer.bench.offline import add_common_arguments, engine_options, random_prompts
from deepinfer.bench.prefix_cache import ttft
from deepinfer.bench.report import markdown_table, provenance, write_json

_STORE_WRITER = """
import json, sys
from deepinfer import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["model"], kv_store=args["store"], **args["options"])
llm.generate([{"prompt_token_ids": args["prompt"]}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
llm.close()
"""


def _timed(engine: Any, prompt: list[int]) -> tuple[float, float]:
    """TTFT and the process's CPU seconds over it: on a shared machine the CPU time moves less
    with the neighbours than the wall clock."""
    cpu = time.process_time()
    seconds = ttft(engine, prompt)
    return seconds, time.process_time() - cpu


def run(args: argparse.Namespace) -> int:
    """A restart: one process prefills a long prompt into the store and exits; a new process
    measures TTFT on that prefix (a store hit) followed by `suffix_len` new tokens (an agent's next
    turn: 3,328 stored + 427 new in issue 29) against a cold prefill of the same length, and
    against the same prefix found in device memory (where the prefix is whole chunks, 256 tokens
    by default, both compute the same rows, so the difference is the restore)."""
    import json
    import subprocess
    import sys
    import tempfile

    from deepinfer import LLM

    store = args.kv_store or tempfile.mkdtemp(prefix="deepinfer-kv-")
    options = engine_options(args)  # the writer's too: a store keeps chunks per KV dtype and block size
    llm = LLM(args.model, kv_store=store, **options)
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(tokenizer, 2 * args.repeats, args.prefix_len, args.prefix_len, args.seed)
    suffixes = random_prompts(tokenizer, 2 * args.repeats, args.suffix_len, args.suffix_len, args.seed + 1)
    others = random_prompts(tokenizer, args.repeats, args.suffix_len, args.suffix_len, args.seed + 2)
    for prompt in prompts[: args.repeats]:
        payload = {"model": args.model, "store": store, "prompt": prompt, "options": options}
        subprocess.run([sys.executable, "-c", _STORE_WRITER, json.dumps(payload)], check=True)
    ttft(llm.engine, prompts[-1][:64])  # warm-up
    hits = [_timed(llm.engine, p + s) for p, s in zip(prompts[: args.repeats], suffixes)]
    # The same prefix again, now in device memory, before another suffix: the same computation
    # without the store, so hit - device is what restoring from the store costs.
    devices = [_timed(llm.engine, p + s) for p, s in zip(prompts[: args.repeats], others)]
    colds = [_timed(llm.engine, p + s) for p, s in zip(prompts[args.repeats :], suffixes[args.repeats :])]
    (hit, hit_cpu), (cold, cold_cpu), (device, _) = min(hits), min(colds), min(devices)
    metrics = llm.engine.core.connector.metrics()
    llm.close()
    result = {
        "benchmark": "kvstore",
        **provenance(),
        "store": store,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "ttft_cold_s": cold,
        "ttft_store_hit_s": hit,
        "hit_over_cold": hit / cold,
        "ttft_device_hit_s": device,
        "cpu_cold_s": cold_cpu,
        "cpu_store_hit_s": hit_cpu,
        "store_metrics": metrics,
    }
    print(
        markdown_table(
            ["measure", "value"],
            [
                [f"TTFT cold prefill ({args.prefix_len + args.suffix_len} tokens)", f"{cold * 1e3:.0f} ms"],
                [f"TTFT after restart, {args.prefix_len} from the store", f"{hit * 1e3:.0f} ms"],
                ["hit / cold", f"{hit / cold:.1%}"],
                [
                    f"TTFT with the {args.prefix_len} in device memory (another suffix)",
                    f"{device * 1e3:.0f} ms",
                ],
                ["the store's part: hit - device", f"{(hit - device) * 1e3:.0f} ms"],
                ["process CPU: hit / cold", f"{hit_cpu:.1f} s / {cold_cpu:.1f} s = {hit_cpu / cold_cpu:.1%}"],
                ["bytes read from the store", f"{metrics['bytes_read'] / 2**20:.0f} MiB"],
            ],
        )
    )
    if args.result_json:
        write_json(args.result_json, result)
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("kvstore", help="TTFT of a prefix loaded from the KV store after a restart")
    add_common_arguments(p)
    p.add_argument("--kv-store", help="store URL or directory (default: a fresh temp dir)")
    p.add_argument("--prefix-len", type=int, default=4000)
    p.add_argument("--suffix-len", type=int, default=0, help="new tokens after the stored prefix")
    p.add_argument("--repeats", type=int, default=2)
    return p
