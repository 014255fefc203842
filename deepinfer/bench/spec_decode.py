"""`bench spec`: what speculative decoding buys, measured on the offline engine.

Two parts, each a set of engines sharing one copy of the weights:

- repeat: batch-1 decoding of requests that repeat or lightly edit a ~500-token code file (the
  case prompt lookup is made for), without speculation and with n-gram speculation (fixed k and
  the dynamic length policy);
- mixed: repetitive and free-form requests interleaved, submitted together at each batch size,
  without speculation, with a fixed verification length k, with the dynamic policy, and (for
  --method draft) with the confidence policy.

Configurations take turns (each runs --repeats times, in rotating order, and its fastest run
counts). Every run reports output tokens/s, per-position acceptance, mean accepted length and the
distribution of verified lengths, whether its greedy outputs equal the plain engine's (they must),
and the load average around it: on a shared machine other work slows every number down, so
compare runs taken under the same load. Results go to JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.config.flags import int_list_argument, size_argument

CODE_FILE = '''"""A small inventory service: items, stock levels and reorder rules."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    unit_price: float
    quantity: int = 0
    reorder_level: int = 10
    tags: list[str] = field(default_factory=list)

    def total_value(self) -> float:
        return self.unit_price * self.quantity

    def needs_reorder(self) -> bool:
        return self.quantity <= self.reorder_level


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def receive(self, sku: str, count: int) -> None:
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[sku].quantity += count

    def ship(self, sku: str, count: int) -> None:
        item = self.items[sku]
        if count > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} in stock")
        item.quantity -= count

    def total_value(self) -> float:
        return sum(item.total_value() for item in self.items.values())

    def reorder_list(self) -> list[Item]:
        return [item for item in self.items.values() if item.needs_reorder()]


def main() -> None:
    inventory = Inventory()
    inventory.add(Item("A-100", "bolt", 0.25, quantity=500, tags=["hardware"]))
    inventory.add(Item("B-200", "hinge", 3.50, quantity=8, tags=["hardware", "doors"]))
    inventory.ship("A-100", 120)
    inventory.receive("B-200", 30)
    for item in inventory.reorder_list():
        print("reorder", item.sku, item.name)
    print("total value", round(inventory.total_value(), 2))


if __name__ == "__main__":
    main()
'''

REPEAT_TASKS = [
    "Repeat the following file exactly, from the first line to the last:",
    "Rewrite the following file with the class Inventory renamed to Warehouse; change nothing else "
    "and output the whole file:",
]
FREE_FORM_TASKS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, in simple words.",
    "Describe a walk through a busy market on a summer morning.",
    "Give advice to someone starting to learn the piano as an adult.",
]


def chat(text: str) -> str:
    """SmolLM2's chat format (the default model); other models read it as plain text."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def repeat_prompts() -> list[str]:
    return [chat(f"{task}\n\n{CODE_FILE}") for task in REPEAT_TASKS]


def mixed_prompts(count: int) -> list[str]:
    """Alternating repetitive (a slice of the file to repeat) and free-form requests."""
    lines = CODE_FILE.splitlines()
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            start = (i * 7) % max(len(lines) - 30, 1)
            snippet = "\n".join(lines[start : start + 30])
            prompts.append(chat(f"{REPEAT_TASKS[0]}\n\n{snippet}"))
        else:
            prompts.append(chat(FREE_FORM_TASKS[(i // 2) % len(FREE_FORM_TASKS)]))
    return prompts


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "spec",
        help="speculative decoding: n-gram vs none at batch 1, dynamic vs fixed length on a mixed load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--parts", default="repeat,mixed", help="comma-separated: repeat, mixed")
    p.add_argument(
        "--method", choices=["ngram", "draft"], default="ngram", help="proposer for the mixed part"
    )
    p.add_argument(
        "--speculative-model", default=None, help="draft model for --method draft (default: the target)"
    )
    p.add_argument("--fixed-k", type=int, default=5, help="verification length of the fixed baseline")
    p.add_argument("--dynamic-max-k", type=int, default=5, help="upper bound of the dynamic policy")
    p.add_argument("--repeat-output-len", type=int, default=192, help="max tokens of each repeat request")
    p.add_argument("--mixed-output-len", type=int, default=64, help="max tokens of each mixed request")
    p.add_argument(
        "--batch-sizes", type=int_list_argument, default=[1, 4, 16], help="mixed part: e.g. 1,4,16"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per config (interleaved; the fastest counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--kv-cache-memory",
        type=size_argument,
        default=512 << 20,
        help="KV cache per engine (default 512MiB: 16 mixed requests need ~300MiB on the default model)",
    )
    p.add_argument("--result-json", help="write the full result here")
    p.add_argument("--markdown", help="write the markdown tables here")
    return p


def _spec_options(method: str | None, length: str, k: int, speculative_model: str | None) -> dict[str, Any]:
    if method is None:
        return {}
    options: dict[str, Any] = {
        "speculative_method": method,
        "speculative_length": length,
        "num_speculative_tokens": k,
    }
    if method == "draft" and speculative_model is not None:
        options["speculative_model"] = speculative_model
    return options


def _timed(llm: Any, prompts: list[str], params: Any, sequential: bool) -> dict[str, Any]:
    core = llm.engine.core
    if core.spec is not None:
        core.spec.reset_stats()
    load_before = os.getloadavg()[0]
    begin = time.perf_counter()
    if sequential:
        outputs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - begin
    tokens = [o.outputs[0].token_ids for o in outputs]
    num_tokens = sum(len(t) for t in tokens)
    stats = core.spec_stats()
    return {
        "seconds": seconds,
        "output_tokens": num_tokens,
        "output_tok_s": num_tokens / seconds,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "spec": None if stats is None else stats.to_dict(),
        "token_ids": tokens,
    }


def measure_interleaved(
    engines: list[tuple[str, Any]], prompts: list[str], params: Any, sequential: bool, repeats: int
) -> dict[str, dict[str, Any]]:
    """The fastest of `repeats` runs per engine, the engines taking turns in rotating order: on a
    shared machine a burst of other work then slows one run of each rather than all runs of one."""
    warm_up = type(params)(temperature=0.0, max_tokens=8, ignore_eos=True)
    for _, llm in engines:
        llm.generate(prompts[0], warm_up, use_tqdm=False)
    best: dict[str, dict[str, Any]] = {}
    for rep in range(repeats):
        shift = rep % len(engines)
        for name, llm in engines[shift:] + engines[:shift]:
            result = _timed(llm, prompts, params, sequential)
            if name not in best or result["seconds"] < best[name]["seconds"]:
                best[name] = result
    return best


def _row(part: str, batch: int, config: str, result: dict[str, Any], baseline: float) -> list[Any]:
    spec = result["spec"] or {}
    per_position = spec.get("acceptance_per_position")
    chosen = spec.get("chosen_k")
    return [
        part,
        batch,
        config,
        result["output_tok_s"],
        result["output_tok_s"] / baseline if baseline else None,
        spec.get("acceptance_rate"),
        spec.get("mean_accepted_length"),
        " ".join(f"{a:.2f}" for a in per_position) if per_position else None,
        " ".join(str(c) for c in chosen) if chosen else None,
        result["identical"],
        f"{result['load_avg_1m'][0]:.1f}→{result['load_avg_1m'][1]:.1f}",
    ]


HEADERS = [
    "part",
    "batch",
    "config",
    "output tok/s",
    "vs none",
    "acceptance",
    "mean accepted",
    "acceptance per position",
    "k distribution (k=0..)",
    "greedy identical",
    "load avg",
]


def run(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"repeat", "mixed"}
    if unknown:
        print(f"error: --parts: unknown part(s) {sorted(unknown)}; expected repeat, mixed")
        return 2
    engine_args: dict[str, Any] = {"kv_cache_memory": args.kv_cache_memory}
    if args.threads:
        engine_args["num_threads"] = args.threads
    base = LLM(model=args.model, **engine_args)
    loaded = base.engine.core.loaded
    results: list[dict[str, Any]] = []
    rows: list[list[Any]] = []

    def run_configs(
        part: str, batch: int, prompts: list[str], params: Any, configs: list[tuple[str, dict]]
    ) -> None:
        engines = [
            (name, LLM(model=args.model, loaded=loaded, max_num_seqs=max(batch, 1), **engine_args, **options))
            for name, options in configs
        ]
        best = measure_interleaved(engines, prompts, params, batch == 1, args.repeats)
        reference, baseline = best[configs[0][0]]["token_ids"], best[configs[0][0]]["output_tok_s"]
        for name, _ in configs:
            result = best[name]
            result["identical"] = result.pop("token_ids") == reference
            results.append({"part": part, "batch": batch, "config": name, **result})
            rows.append(_row(part, batch, name, result, baseline))
            print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)

    if "repeat" in parts:
        params = SamplingParams(temperature=0.0, max_tokens=args.repeat_output_len, ignore_eos=True)
        run_configs(
            "repeat",
            1,
            repeat_prompts(),
            params,
            [
                ("none", {}),
                (f"ngram fixed k={args.fixed_k}", _spec_options("ngram", "fixed", args.fixed_k, None)),
                (
                    f"ngram dynamic k<={args.dynamic_max_k}",
                    _spec_options("ngram", "dynamic", args.dynamic_max_k, None),
                ),
            ],
        )
    # The confidence policy needs drafts with confidences (not n-gram's).
    confidence = (
        []
        if args.method == "ngram"
        else [
            (
                f"{args.method} confidence k<={args.dynamic_max_k}",
                _spec_options(args.method, "confidence", args.dynamic_max_k, args.speculative_model),
            )
        ]
    )
    if "mixed" in parts:
        params = SamplingParams(temperature=0.0, max_tokens=args.mixed_output_len, ignore_eos=True)
        for batch in args.batch_sizes:
            prompts = mixed_prompts(max(batch, 2))  # batch 1: one repetitive, one free-form, in turn
            run_configs(
                "mixed",
                batch,
                prompts,
                params,
                [
                    ("none", {}),
                    (
                        f"{args.method} fixed k={args.fixed_k}",
                        _spec_options(args.method, "fixed", args.fixed_k, args.speculative_model),
                    ),
                    (
                        f"{args.method} dynamic k<={args.dynamic_max_k}",
                        _spec_options(args.method, "dynamic", args.dynamic_max_k, args.speculative_model),
                    ),
                    *confidence,
                ],
            )
    table = markdown_table(HEADERS, rows)
    print("\n" + table)
    if args.result_json:
        write_json(args.result_json, {"provenance": provenance(), "results": results})
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if not all(r["identical"] for r in results):
        print("error: a speculative run's greedy outputs differ from plain decoding")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.bench.spec_decode")
    commands = parser.add_subparsers(dest="command", required=True)
    add_parser(commands)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
