"""`deepinfer bench router`: prefix-cache hit rate and TTFT of agent sessions through the router,
round robin against cache-aware and least-work, on 2 and 3 replicas of the default model, without and with a
shared KV store; and one replica holding everything, the hit rate cache-aware routing aims at.

The workload is `bench serve`'s agent dataset: sessions resending one shared system prompt and a
growing history, each turn sent when the session's previous one finished; all sessions start at
once, or at Poisson times with `--session-rate` (then their turns no longer arrive together).
Every configuration is one run on fresh caches (prefix caches reset, the store emptied). Replicas
run one thread each; the router, the load generator and the replicas share the machine.

The default workload is sized to finish in a few minutes on two cores: 6 sessions of 5 turns, a
~350-token system prompt, ~100 new tokens of history per turn (last prompts ~870 tokens), 16-token
answers. Each of the 2 or 3 replicas has a KV cache of 182 blocks (64 MiB of 16-bit KV): enough for the
system prompt and the histories of the sessions one replica gets when sessions stay where their
prefix is (3 or 2), not for all six (~250 blocks), which round robin makes every replica hold;
the single replica has room for everything (192 MiB, 546 blocks), the hit rate to aim at. With
caches that hold every session on every replica, round robin on 2 replicas misses only the last
~2 turns of a history (a turn lands where the one before the last went), and no routing can beat
it by 2x: `--kv-cache-memory 192MiB` shows that case. `--context-len` opens every session with a
context of its own (the files an agent attaches): round robin then recomputes it on the replica
that has not seen the session yet.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from deepinfer.bench.cluster import Child, peer_get, replica, reset_caches, router, running
from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.bench.serve_command import ServeOptions, run_serve


def _empty(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _router_metrics(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    decisions: dict[str, float] = {}
    per_replica: dict[str, float] = {}
    estimate = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "deepinfer_router_routing_decisions_total":
                reason = sample.labels["reason"]
                decisions[reason] = decisions.get(reason, 0.0) + sample.value
                replica = sample.labels["replica"]
                per_replica[replica] = per_replica.get(replica, 0.0) + sample.value
            elif sample.name == "deepinfer_router_hit_rate_estimate":
                estimate = sample.value
    return {"decisions": decisions, "requests_per_replica": per_replica, "hit_rate_estimate": estimate}


def _one_run(args: argparse.Namespace, name: str, replicas: list[Child], policy: str) -> dict[str, Any]:
    reset_caches(replicas)
    urls = [a for r in replicas for a in ("--replica", r.url)]
    thresholds = ("--cache-threshold", str(args.cache_threshold)) if args.cache_threshold is not None else ()
    with running([router(name, *urls, "--policy", policy, *thresholds)]) as (front,):
        options = ServeOptions(
            base_url=front.url,
            api="chat",
            dataset="agent",
            num_prompts=args.sessions * args.turns,
            agent_turns=args.turns,
            input_len=args.system_len,
            agent_user_len=args.user_len,
            agent_context_len=args.context_len,
            output_len=args.output_len,
            max_concurrency=args.sessions,
            request_rate=args.session_rate,
            think_time_s=args.think_time,
            seed=args.seed,
            show_progress=False,
        )
        result = run_serve(options)
        routed = _router_metrics(front.url)
    split = routed["requests_per_replica"]
    routed["split"] = "/".join(f"{split.get(r.url, 0.0):.0f}" for r in replicas)
    summary = result["runs"][0]["summary"]
    blocks = [peer_get(r.url, "/v1/engine_info", 30).json().get("num_blocks") for r in replicas]
    return {
        "kv_blocks_per_replica": blocks,
        "name": name,
        "replicas": len(replicas),
        "policy": policy,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "hit_rate": summary["prefix_cache_hit_rate"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "duration_s": summary["duration_s"],
        "output_throughput": summary["output_throughput"],
        "router": routed,
    }


POLICIES = ("round_robin", "cache_aware", "least_work")


def _replica_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or any(n < 2 or n > 3 for n in counts):
        raise SystemExit(f"--replica-counts: a comma-separated list of 2 and/or 3, not {text!r}")
    return counts


def _policies(text: str) -> list[str]:
    policies = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise SystemExit(f"--policies: a comma-separated list of {', '.join(POLICIES)}, not {text!r}")
    return policies


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    counts, policies = _replica_counts(args.replica_counts), _policies(args.policies)
    plain = [replica(f"replica{i}", kv_cache_memory=args.kv_cache_memory) for i in range(max(counts))]
    single = replica("single", kv_cache_memory=args.single_kv_cache_memory)
    with running([single, *plain]):
        runs.append(_one_run(args, "single replica", [single], "cache_aware"))
        for n in counts:
            for policy in policies:
                runs.append(_one_run(args, f"{n} replicas, {policy}", plain[:n], policy))
    store = Path(tempfile.mkdtemp(prefix="deepinfer-bench-store-"))
    shared = ("--kv-store", str(store), "--kv-chunk-blocks", str(args.chunk_blocks))
    with_store = [
        replica(f"stored{i}", *shared, kv_cache_memory=args.kv_cache_memory) for i in range(max(counts))
    ]
    with running(with_store):
        for n in counts:
            for policy in policies:
                _empty(store)
                runs.append(_one_run(args, f"{n} replicas + shared store, {policy}", with_store[:n], policy))
    shutil.rmtree(store, ignore_errors=True)

    rows = [
        [
            r["name"],
            f"{r['completed']}/{r['failed']}",
            f"{r['hit_rate']:.1%}" if r["hit_rate"] is not None else "n/a",
            f"{r['router']['hit_rate_estimate']:.1%}",
            r["router"]["split"],
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['duration_s']:.0f}",
        ]
        for r in runs
    ]
    print(
        markdown_table(
            [
                "configuration",
                "ok/failed",
                "hit rate",
                "router's estimate",
                "requests per replica",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "run s",
            ],
            rows,
        )
    )
    if args.result_json:
        write_json(
            args.result_json, {"benchmark": "router", **provenance(), "options": vars_of(args), "runs": runs}
        )
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    """The options as JSON can hold them (an infinite session rate, "all at once", as null)."""
    plain = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))}
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in plain.items()}


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("router", help="agent sessions through the router: hit rate and TTFT by policy")
    p.add_argument("--sessions", type=int, default=6, help="agent sessions, all in flight at once")
    p.add_argument(
        "--session-rate",
        type=float,
        default=math.inf,
        help="sessions started per second (Poisson); default: all at once, so their turns arrive together",
    )
    p.add_argument("--turns", type=int, default=5, help="turns per session")
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds a session waits after an answer before its next turn (an agent's tool run)",
    )
    p.add_argument(
        "--system-len",
        type=int,
        default=128,
        help="words of the shared system prompt (its tool list alone is ~180 words, the floor)",
    )
    p.add_argument("--user-len", type=int, default=64, help="words per user turn")
    p.add_argument(
        "--context-len",
        type=int,
        default=0,
        help="words of a session's own context in its first turn (the files an agent attaches)",
    )
    p.add_argument(
        "--output-len", type=int, default=16, help="tokens per answer (and per synthetic history turn)"
    )
    p.add_argument("--kv-cache-memory", default="64MiB", help="per replica of the 2- and 3-replica runs")
    p.add_argument(
        "--single-kv-cache-memory", default="192MiB", help="the single replica's (room for every session)"
    )
    p.add_argument("--replica-counts", default="2,3", help="replica counts to run, from 2 and 3")
    p.add_argument("--policies", default=",".join(POLICIES), help="routing policies to run, comma-separated")
    p.add_argument(
        "--cache-threshold",
        type=float,
        help="the router's --cache-threshold for cache_aware (default: the router's, SGLang's 0.3)",
    )
    p.add_argument("--chunk-blocks", type=int, default=4, help="blocks per stored chunk (shared store runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the full result here")
    return p
