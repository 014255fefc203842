"""Command line of `deepinfer bench`.

What users run against an engine ships in the package: `serve` (the load generator for any
OpenAI/Anthropic-compatible server), `throughput` and `latency` (the offline engine). Studies and
peer comparisons (`peers`, `roofline`, `economics`, `prefix`, `kvstore`, `prefill`, `spec`, `structured`,
`router`, `pd`, `parallel`, `vision`, `user-shapes`) are modules of this package too, imported only when
their command runs (some need a checkout's build/ folder or extra packages). `python -m deepinfer.bench ...`
runs the same commands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from deepinfer.bench.client import API_NAMES
from deepinfer.bench.datasets import DATASET_NAMES
from deepinfer.bench.offline import add_offline_parsers, run_latency, run_throughput
from deepinfer.bench.serve import BenchError
from deepinfer.config.flags import int_list_argument

# Study commands: name -> module of this package (each has add_parser, run), imported on use.
REPO_COMMANDS = {
    "prefix": "prefix_cache",
    "kvstore": "kv_store",
    "prefill": "prefill_length",
    "spec": "spec_decode",
    "structured": "structured_output",
    "roofline": "roofline",
    "economics": "economics",
    "peers": "peers",
    "router": "router_cache",
    "pd": "pd_itl",
    "parallel": "parallel",
    "overhead": "step_overhead",
    "soak": "soak",
    "vision": "vision",
    "user-shapes": "user_shapes",
}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def _add_serve(commands: Any) -> None:
    p = commands.add_parser("serve", help="load-test an OpenAI/Anthropic-compatible server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--api", choices=API_NAMES, default="chat")
    p.add_argument("--endpoint", help="path override, e.g. /v1/chat/completions")
    p.add_argument("--model", help="model name to send (default: first id of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or $ANTHROPIC_API_KEY")
    p.add_argument("--dataset", choices=DATASET_NAMES, default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all (turns for agent)")
    p.add_argument("--input-len", type=int, help="prompt words (agent: shared system prompt)")
    p.add_argument("--output-len", type=int, help="max_tokens per request (sharegpt-like: the mean)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: vary lengths by ±ratio")
    p.add_argument("--agent-turns", type=int, default=4, help="agent: turns per session")
    p.add_argument("--agent-user-len", type=int, default=64, help="agent: words per user turn")
    p.add_argument(
        "--agent-context-len",
        type=int,
        default=0,
        help="agent: words of a session's own context in its first turn (files attached to the task)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (default inf)")
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="agent: seconds between a turn's answer and the next turn",
    )
    p.add_argument("--sweep-concurrency", type=int_list_argument, help="e.g. 1,4,16,32: one run per level")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into each body")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--num-cards", type=int, default=1, help="accelerators serving, for per-card numbers")
    p.add_argument("--result-json", help="write the full result here")
    p.add_argument("--plot-dir", help="write PNG plots here")
    p.add_argument("--save-detailed", action="store_true", help="keep every inter-token gap in the JSON")
    p.add_argument("--disable-tqdm", action="store_true")


def _study(module: str) -> Any:
    return importlib.import_module(f"deepinfer.bench.{module}")


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    names = ["serve", "throughput", "latency", *REPO_COMMANDS]
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(names) + "}")
    _add_serve(commands)
    add_offline_parsers(commands)
    for module in REPO_COMMANDS.values():
        _study(module).add_parser(commands)


def add_bench_parser(subparsers: Any) -> None:
    """Add `bench` and its subcommands to the `deepinfer` command's subparsers."""
    add_bench_commands(subparsers.add_parser("bench", help="serving benchmarks, roofline, economics, peers"))


def _run_serve(args: argparse.Namespace) -> int:
    from deepinfer.bench.serve_command import ServeOptions, format_serve_summary, run_serve

    env_key = "ANTHROPIC_API_KEY" if args.api == "messages" else "OPENAI_API_KEY"
    options = ServeOptions(
        base_url=args.base_url,
        api=args.api,
        model=args.model,
        endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get(env_key),
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        agent_turns=args.agent_turns,
        agent_user_len=args.agent_user_len,
        agent_context_len=args.agent_context_len,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        think_time_s=args.think_time,
        sweep_concurrency=args.sweep_concurrency or [],
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_e2e_ms=args.slo_e2e_ms,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        warmup=not args.no_warmup,
        timeout_s=args.timeout_s,
        num_cards=args.num_cards,
        result_json=args.result_json,
        plot_dir=args.plot_dir,
        save_detailed=args.save_detailed,
        show_progress=not args.disable_tqdm,
    )
    result = run_serve(options)
    print(format_serve_summary(result))
    for run in result["runs"]:
        summary = run["summary"]
        if summary["errors"]:
            print(f"errors at concurrency {summary['max_concurrency']}: {summary['errors']}", file=sys.stderr)
    if args.result_json:
        print(f"result: {args.result_json}")
    return 0 if all(run["summary"]["failed"] == 0 for run in result["runs"]) else 1


_HANDLERS = {"serve": _run_serve, "throughput": run_throughput, "latency": run_latency}


def run_bench(args: argparse.Namespace) -> int:
    """Run the parsed `bench` subcommand; bad input or an unreachable server exit 2 with a message."""
    try:
        command = args.bench_command
        if command in REPO_COMMANDS:
            return _study(REPO_COMMANDS[command]).run(args)
        return _HANDLERS[command](args)
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.bench", description=__doc__)
    add_bench_commands(parser)
    return run_bench(parser.parse_args(argv))
