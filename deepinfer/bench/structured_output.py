"""`deepinfer bench structured`: what a JSON-schema constraint costs in throughput.

The same chat requests (16 by default, all submitted at once to the offline engine) run twice:
free, and constrained by a JSON schema through `StructuredOutputs(json=...)`. Both runs use the
same prompts, seeds and max_tokens with ignore_eos, and the schema needs far more tokens than
max_tokens allows (`minItems`), so every sequence generates exactly max_tokens tokens in both runs
and is constrained at every one of them: the batch is the same step after step, and the only
difference is the grammar work. Rounds alternate the order (free first, then constrained first)
to spread the drift of a shared machine; the median of each mode is reported.

Besides output tokens/s both ways and the loss in %, the engine's own counters
(`deepinfer.structured.mask_timing`) give the time per constrained token spent computing masks
(`fill_bitmasks`), applying them to the logits (`apply_bitmask_`) and advancing the matchers
(`accept_token`). The goal is a loss of at most 5%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.structured.mask_timing import MASK_TIMING

GOAL_LOSS = 0.05

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {
            "type": "array",
            "items": {
                "type": "string",
                "enum": ["chess", "hiking", "music", "reading", "cooking", "painting"],
            },
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "active"],
    "additionalProperties": False,
}
# A directory of people: objects, strings, integers, enums and booleans, and more of them than any
# max_tokens here can hold.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": _PERSON, "minItems": 64}},
    "required": ["people"],
    "additionalProperties": False,
}
_TOPICS = [
    "chess club members",
    "hikers from the Alps",
    "musicians in a jazz band",
    "readers of a book club",
    "cooks of a small restaurant",
    "painters of a village",
    "neighbors on one street",
    "students of a night class",
]


@dataclass(slots=True)
class RunResult:
    mode: str  # "free" or "json_schema"
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "structured", help="throughput with JSON-schema constraints vs without (offline engine)"
    )
    p.add_argument("--model", help="a .gguf file or HF directory (default: the embedded model)")
    p.add_argument("--num-requests", type=int, default=16, help="requests submitted at once")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (both modes)")
    p.add_argument("--rounds", type=int, default=3, help="free/constrained pairs, order alternating")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    p.add_argument("--result-json", help="write the full result here")
    return p


def _conversations(count: int) -> list[list[dict[str, str]]]:
    return [
        [
            {
                "role": "user",
                "content": f"List {_TOPICS[i % len(_TOPICS)]} (group {i}) as JSON: for each person a "
                "name, age, city, hobbies and whether they are active.",
            }
        ]
        for i in range(count)
    ]


def _params(count: int, max_tokens: int, temperature: float, constrained: bool) -> list[Any]:
    from deepinfer import SamplingParams, StructuredOutputs

    structured = StructuredOutputs(json=SCHEMA) if constrained else None
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
            ignore_eos=True,
            structured_outputs=structured,
        )
        for i in range(count)
    ]


def _timed(llm: Any, conversations: list[Any], params: list[Any], mode: str, max_tokens: int) -> RunResult:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if any(n != max_tokens for n in lengths):
        # Unequal work would make the comparison meaningless.
        raise RuntimeError(f"{mode}: expected {max_tokens} tokens per request, got {sorted(set(lengths))}")
    return RunResult(mode, seconds, sum(lengths))


def run(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    if args.num_requests < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise ValueError("--num-requests, --max-tokens and --rounds must be at least 1")
    load_before = os.getloadavg()
    options: dict[str, Any] = {} if args.threads is None else {"num_threads": args.threads}
    llm = LLM(args.model, **options)
    conversations = _conversations(args.num_requests)
    free = _params(args.num_requests, args.max_tokens, args.temperature, constrained=False)
    constrained = _params(args.num_requests, args.max_tokens, args.temperature, constrained=True)

    # Warm-up: kernels, allocator, and the schema's compile (cached afterwards, like a server's).
    compile_start = time.perf_counter()
    llm.chat(conversations[:1], [constrained[0]], use_tqdm=False)
    warm_constrained_s = time.perf_counter() - compile_start
    llm.chat(conversations[:2], free[:2], use_tqdm=False)

    runs: list[RunResult] = []
    start = MASK_TIMING.snapshot()
    for round_index in range(args.rounds):
        order = ("free", "json_schema") if round_index % 2 == 0 else ("json_schema", "free")
        for mode in order:
            llm.reset_prefix_cache()  # every run prefills its prompts
            before = MASK_TIMING.snapshot()
            params = constrained if mode == "json_schema" else free
            runs.append(_timed(llm, conversations, params, mode, args.max_tokens))
            if mode == "free" and MASK_TIMING.since(before).rows_filled:
                raise RuntimeError("a free run computed grammar masks")
    timing = MASK_TIMING.since(start)
    load_after = os.getloadavg()

    free_tps = statistics.median(r.tokens_per_s for r in runs if r.mode == "free")
    constrained_tps = statistics.median(r.tokens_per_s for r in runs if r.mode == "json_schema")
    loss = 1.0 - constrained_tps / free_tps
    per_token = timing.per_token_us()
    constrained_seconds = sum(r.seconds for r in runs if r.mode == "json_schema")
    grammar_share = (timing.fill_s + timing.apply_s + timing.accept_s) / constrained_seconds
    rows = [
        ["free", free_tps, "", ""],
        ["json_schema", constrained_tps, f"{loss:.1%}", f"{per_token['mask']:.1f}"],
    ]
    print(
        f"{args.num_requests} concurrent requests x {args.max_tokens} tokens, {args.rounds} rounds, "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} ({os.cpu_count()} CPUs)"
    )
    print(markdown_table(["mode", "output tok/s (median)", "loss", "mask us/token"], rows))
    print(
        f"per constrained token: fill {per_token['fill']:.1f} us + apply {per_token['apply']:.1f} us "
        f"= mask {per_token['mask']:.1f} us; accept {per_token['accept']:.1f} us; "
        f"grammar work {grammar_share:.1%} of the constrained runs' time"
    )
    print(f"goal: loss <= {GOAL_LOSS:.0%}: {'met' if loss <= GOAL_LOSS else 'NOT met'}")
    if args.result_json:
        write_json(
            args.result_json,
            {
                "benchmark": "structured",
                **provenance(),
                "model": llm.engine.core.loaded.name,
                "num_requests": args.num_requests,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "schema": SCHEMA,
                "load_average_before": list(load_before),
                "load_average_after": list(load_after),
                "warmup_constrained_seconds": warm_constrained_s,
                "runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs],
                "free_tokens_per_s": free_tps,
                "constrained_tokens_per_s": constrained_tps,
                "loss": loss,
                "mask_timing": {**asdict(timing), "per_token_us": per_token},
                "grammar_share_of_time": grammar_share,
                "goal_loss": GOAL_LOSS,
            },
        )
        print(f"result: {args.result_json}")
    return 0
