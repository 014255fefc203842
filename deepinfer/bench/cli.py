"""Command line of `deepinfer bench {serve,throughput,latency,prefix,kvstore,spec,structured,roofline,economics,peers}`.

The lead wires it into `deepinfer` with ``add_bench_parser(subparsers)`` and dispatches parsed
arguments to ``run_bench(args)``; ``python -m deepinfer.bench`` runs the same commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from deepinfer.bench import spec_decode as spec_bench
from deepinfer.bench import structured as structured_bench
from deepinfer.bench.client import API_NAMES
from deepinfer.bench.datasets import DATASET_NAMES
from deepinfer.bench.offline import add_offline_parsers, run_kvstore, run_latency, run_prefix, run_throughput
from deepinfer.bench.report import markdown_table, provenance, read_json, write_json
from deepinfer.bench.serve import BenchError
from deepinfer.cli import positive_int_list


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (default inf)")
    p.add_argument("--sweep-concurrency", type=positive_int_list, help="e.g. 1,4,16,32: one run per level")
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


def _add_roofline(commands: Any) -> None:
    p = commands.add_parser("roofline", help="measure FLOP/s and memory bandwidth; MFU/MBU of a result")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", type=positive_int_list, default=[256, 512, 1024, 2048], help="GEMM sizes")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="buffer size for copy/add")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result", help="a `bench serve` result JSON to convert into MFU/MBU")
    p.add_argument("--run-index", type=int, help="which run of the result (default: best throughput)")
    p.add_argument("--model-gguf", help="GGUF whose header gives the config (default: embedded model)")
    p.add_argument("--model-config", help="HF config.json instead of a GGUF")
    p.add_argument("--weight-bytes", type=float, help="bytes of weights read per step (default: GGUF size)")
    p.add_argument("--kv-bytes", type=float, default=4.0, help="bytes per KV cache element")
    p.add_argument("--json-out", help="write the measurement here")


def _add_economics(commands: Any) -> None:
    from deepinfer.bench.prices import PRESETS

    p = commands.add_parser("economics", help="revenue, cost and margin per card-hour")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--result", help="a `bench serve` result JSON")
    source.add_argument("--output-tokens-per-s", type=float, help="per card, instead of a result")
    p.add_argument("--input-tokens-per-s", type=float, default=0.0, help="per card, with the above")
    p.add_argument("--run-index", type=int)
    p.add_argument(
        "--prices", required=True, help=f"preset ({', '.join(PRESETS)}) or in_miss,in_hit,out USD/1M"
    )
    p.add_argument("--card-cost-per-hour", type=float, required=True, help="USD per card-hour")
    p.add_argument("--hit-ratio", type=float, help="override the measured prefix-cache hit ratio")
    p.add_argument("--json-out")


def _add_peers(commands: Any) -> None:
    from deepinfer.bench.peers import PEER_NAMES

    p = commands.add_parser("peers", help="us vs llama.cpp vs HF transformers, same model and prompts")
    p.add_argument("--peers", default=",".join(PEER_NAMES), help=f"subset of {','.join(PEER_NAMES)}")
    p.add_argument("--model-gguf", help="default: the embedded default model")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=18731, help="port for the servers started")
    p.add_argument("--llama-server", help="a llama-server binary (default: on PATH, else llama-cpp-python)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--doc", default="docs/benchmarks.md", help="markdown file whose marked section is replaced"
    )
    p.add_argument("--result-json", help="write every peer's full result here")
    p.add_argument("--disable-tqdm", action="store_true")


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(
        dest="bench_command",
        required=True,
        metavar="{serve,throughput,latency,prefix,kvstore,spec,structured,roofline,economics,peers}",
    )
    _add_serve(commands)
    add_offline_parsers(commands)
    spec_bench.add_parser(commands)
    structured_bench.add_parser(commands)
    _add_roofline(commands)
    _add_economics(commands)
    _add_peers(commands)


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
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
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


def _load_model_config(args: argparse.Namespace) -> tuple[dict[str, Any], float | None]:
    from deepinfer.bench.roofline import default_model_path, llama_config_from_gguf

    if args.model_config:
        return read_json(args.model_config), args.weight_bytes
    config, gguf_bytes = llama_config_from_gguf(args.model_gguf or default_model_path())
    return config, args.weight_bytes if args.weight_bytes is not None else float(gguf_bytes)


def _run_roofline(args: argparse.Namespace) -> int:
    from deepinfer.bench.economics import throughput_from_result
    from deepinfer.bench.roofline import measure_roofline, utilization

    roofline = measure_roofline(args.sizes, args.threads, args.bandwidth_mib, args.repeats)
    rows = [
        [f"GEMM {n}×{n} fp32", flops / 1e9, "GFLOP/s"] for n, flops in roofline.gemm_flops_by_size.items()
    ]
    rows += [
        ["memory copy", roofline.copy_bytes_per_s / 1e9, "GB/s"],
        ["memory add", roofline.add_bytes_per_s / 1e9, "GB/s"],
    ]
    print(f"threads: {roofline.threads}")
    print(markdown_table(["measurement", "value", "unit"], rows))
    record: dict[str, Any] = {"benchmark": "roofline", **provenance(), "roofline": roofline.to_dict()}
    if args.result:
        result = read_json(args.result)
        _, _, index = throughput_from_result(result, args.run_index)
        summary = result["runs"][index]["summary"]
        config, weight_bytes = _load_model_config(args)
        # A decoded token sees its prompt plus, on average, half of its reply.
        context = (summary["mean_input_tokens"] or 0) + (summary["mean_output_tokens"] or 0) / 2
        used = utilization(
            roofline,
            config,
            summary["total_token_throughput"] / summary["num_cards"],
            summary["output_throughput"] / summary["num_cards"],
            context,
            max(summary["mean_concurrency"], 1.0),
            weight_bytes,
            args.kv_bytes,
        )
        record["utilization"] = {**used.to_dict(), "context_len": context, "run_index": index}
        print(
            markdown_table(
                ["model FLOPs/token", "bytes/token", "MFU", "MBU"],
                [[used.flops_per_token, used.bytes_per_token, f"{used.mfu:.2%}", f"{used.mbu:.2%}"]],
            )
        )
    if args.json_out:
        write_json(args.json_out, record)
    return 0


def _run_economics(args: argparse.Namespace) -> int:
    from deepinfer.bench.economics import (
        CardThroughput,
        card_economics,
        format_economics,
        hit_ratio_table,
        throughput_from_result,
    )
    from deepinfer.bench.prices import parse_prices

    prices = parse_prices(args.prices)
    if args.result:
        throughput, measured_hit, index = throughput_from_result(read_json(args.result), args.run_index)
        print(f"using run {index} of {args.result}")
    else:
        throughput, measured_hit = CardThroughput(args.input_tokens_per_s, args.output_tokens_per_s), None
    hit = args.hit_ratio if args.hit_ratio is not None else measured_hit
    if hit is None:
        hit = 0.0
        source = "the result reports no cached tokens" if args.result else "no --hit-ratio given"
        print(f"{source}: hit ratio taken as 0")
    headline = card_economics(throughput, prices, hit, args.card_cost_per_hour)
    table = hit_ratio_table(throughput, prices, args.card_cost_per_hour)
    print(format_economics(headline, table, prices))
    if args.json_out:
        write_json(
            args.json_out,
            {
                "benchmark": "economics",
                **provenance(),
                "prices": {
                    "name": prices.name,
                    "as_of": prices.as_of,
                    "input_miss": prices.input_miss,
                    "input_hit": prices.input_hit,
                    "output": prices.output,
                },
                "headline": headline.to_dict(),
                "hit_ratio_table": [row.to_dict() for row in table],
            },
        )
    return 0


def _run_peers(args: argparse.Namespace) -> int:
    from deepinfer.bench.peers import PeersOptions, run_peers

    options = PeersOptions(
        peers=[name.strip() for name in args.peers.split(",") if name.strip()],
        model_gguf=args.model_gguf,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        threads=args.threads,
        port=args.port,
        llama_server=args.llama_server,
        startup_timeout_s=args.startup_timeout_s,
        doc=args.doc,
        result_json=args.result_json,
        show_progress=not args.disable_tqdm,
    )
    report = run_peers(options)
    print(report.markdown)
    return 0 if report.any_measured else 1


_HANDLERS = {
    "serve": _run_serve,
    "throughput": run_throughput,
    "latency": run_latency,
    "prefix": run_prefix,
    "kvstore": run_kvstore,
    "spec": spec_bench.run,
    "structured": structured_bench.run,
    "roofline": _run_roofline,
    "economics": _run_economics,
    "peers": _run_peers,
}


def run_bench(args: argparse.Namespace) -> int:
    """Run the parsed `bench` subcommand; bad input or an unreachable server exit 2 with a message."""
    try:
        return _HANDLERS[args.bench_command](args)
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.bench", description=__doc__)
    add_bench_commands(parser)
    return run_bench(parser.parse_args(argv))
