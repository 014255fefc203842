"""The `deepinfer` command: serve | generate | bench.

Every EngineConfig field is a flag of `serve` and `generate` (`--kv-cache-memory 256MiB`,
`--max-num-seqs 64`, `--no-enable-prefix-caching`, ...), derived from the dataclass so a new
engine option is a new flag without touching this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

_HELP = {
    "dtype": "weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    "device": "auto, cpu or cuda[:N]",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "bytes for the KV cache, e.g. 268435456, 256MiB or 2GiB (default: 2 GiB on CPU, 90%% of free memory on GPU)",
    "num_blocks": "number of KV-cache blocks (overrides --kv-cache-memory)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one step",
    "prefill_chunk_size": "most prompt tokens of one sequence per step",
    "max_model_len": "context length (default: the model's)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "scheduling_policy": "fcfs, or priority (lower value first)",
    "attention_backend": "attention implementation",
    "num_threads": "CPU threads for torch (default: all cores)",
    "speculative_method": "speculative decoding: ngram (prompt lookup), draft (a draft model) or mtp (DeepSeek MTP)",
    "num_speculative_tokens": "most draft tokens verified per step",
    "speculative_length": "dynamic: per-step length from expected acceptance and the profiled step cost; fixed: always the most",
    "speculative_model": "draft model for --speculative-method draft (default: the target model itself)",
    "speculative_ngram_min": "shortest suffix n-gram prompt lookup matches",
    "speculative_ngram_max": "longest suffix n-gram prompt lookup tries first",
    "grammar_compile_timeout": "seconds a structured-output grammar (JSON schema, forced tool call) may take to compile; slower ones are refused (400)",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`268435456`, `256MiB`, `256M`, `1.5GiB` -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 268435456, 256MiB or 2GiB, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1024 ** " kmgt".index(unit or " ")))


def positive_int_list(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16]; every value must be a positive integer."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _is_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    from deepinfer.config import EngineConfig

    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind, _ = _is_optional(hints[f.name])
        help_text = _HELP.get(f.name, f"engine option {f.name}")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=f.default, help=help_text)
        else:
            convert: Callable[[str], Any] = parse_size if f.name.endswith("_memory") else kind
            group.add_argument(flag, type=convert, default=f.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace, model: str | None) -> Any:
    from deepinfer.config import EngineConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    return EngineConfig.from_kwargs(model=model, **values)


# ------------------------------------------------------------------------------------- serve


def _add_serve(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI- and Anthropic-compatible)",
        description="Serve a model: OpenAI Chat Completions, Completions and Responses, Anthropic "
        "Messages, plus /health, /metrics, /tokenize and /detokenize.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at startup)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this key (Authorization: Bearer or x-api-key); repeat for several",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="a name clients use in `model` (default: the model's); repeat for several",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=512,
        help="requests waiting for their first token before new ones get 429 (Anthropic: 529)",
    )
    p.add_argument("--max-body-bytes", type=parse_size, default=32 << 20, help="larger bodies get 413")
    p.add_argument(
        "--cache-salt-per-key",
        action="store_true",
        help="isolate the prefix cache between API keys (on top of any cache_salt in bodies)",
    )
    p.add_argument(
        "--chat-encoding",
        "--recipe-family",
        dest="recipe_family",
        metavar="ENCODING",
        help="the chat encoding (prompt format and output parser), overriding the one detected from the "
        "model: deepseek_v41, deepseek_v4, deepseek_v32, deepseek_v31, deepseek_r1 or chat_template",
    )
    p.add_argument(
        "--hosted-tools",
        choices=("drop", "reject"),
        default="drop",
        help="Responses tools the server cannot run (web_search, file_search, ...): drop them from the "
        "prompt (default) or answer 400",
    )
    p.add_argument(
        "--reasoning-key",
        help="key for the Responses API's encrypted reasoning (64 hex digits); default: a new key at "
        "every start (blobs from before a restart then fail to decrypt)",
    )
    p.add_argument(
        "--engine-mode",
        choices=("process", "thread"),
        default="process",
        help="run the engine core in its own process (default) or on a thread of the server",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_options(p)
    p.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from deepinfer.server.serve import run_server
    from deepinfer.server.state import ServerConfig

    if args.max_waiting_requests < 1:
        raise SystemExit("error: --max-waiting-requests must be at least 1")
    if not args.grammar_compile_timeout > 0:
        raise SystemExit("error: --grammar-compile-timeout must be a positive number of seconds")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_config = engine_config_from_args(args, args.model)
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_keys=list(args.api_key),
        served_model_names=list(args.served_model_name),
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        cache_salt_per_key=args.cache_salt_per_key,
        recipe_family=args.recipe_family,
        hosted_tools=args.hosted_tools,
        reasoning_key=args.reasoning_key,
        engine_mode=args.engine_mode,
        log_level=args.log_level,
    )
    run_server(engine_config, server_config)
    return 0


# ---------------------------------------------------------------------------------- generate


def _add_generate(commands: Any) -> None:
    p = commands.add_parser(
        "generate",
        help="generate once, offline, and print the text",
        description="Continue PROMPT (or, with --chat, answer it as a user message through the "
        "model's chat template) and print the text as it is generated.",
    )
    p.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    p.add_argument(
        "--model", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--show-reasoning", action="store_true", help="print the model's reasoning to stderr")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    p.add_argument("--recipe-family", help="override the detected prompt family")
    add_engine_options(p)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.model.loader.source import resolve_model_path
    from deepinfer.recipe import RecipeError
    from deepinfer.recipe.events import ReasoningDelta, TextDelta, ToolCallEnd
    from deepinfer.sampling_params import InvalidRequestError, SamplingParams
    from deepinfer.server.generation import check_prompt, max_tokens_for

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = LLMEngine(engine_config_from_args(args, args.model))
    tokenizer, max_model_len = engine.tokenizer, engine.core.max_model_len
    parser = None
    try:
        if args.chat:
            rendered = _render_chat(resolve_model_path(args.model), args, prompt_text, tokenizer)
            token_ids, parser = rendered.token_ids or [], rendered.new_parser()
        else:
            token_ids = tokenizer.encode(prompt_text)
        check_prompt(token_ids, engine.vocab_size, max_model_len, "prompt")
        params = SamplingParams(
            max_tokens=max_tokens_for(args.max_tokens, len(token_ids), max_model_len),
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            skip_special_tokens=parser is None,
        )
        request_id = engine.add_request(token_ids, params)
    except (InvalidRequestError, RecipeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            if parser is None:
                sys.stdout.write(delta.text)
                if delta.finish_reason is not None:
                    engine.processor.drop(request_id)
                sys.stdout.flush()
                continue
            events = parser.feed(delta.text, delta.token_ids)
            if delta.finish_reason is not None:
                reason = delta.finish_reason if delta.finish_reason in ("stop", "length") else "abort"
                events += parser.finish(reason)
                engine.processor.drop(request_id)
            for event in events:
                if isinstance(event, TextDelta):
                    sys.stdout.write(event.text)
                elif isinstance(event, ReasoningDelta) and args.show_reasoning:
                    sys.stderr.write(event.text)
                elif isinstance(event, ToolCallEnd):
                    sys.stdout.write(
                        "\n" + json.dumps({"tool_call": event.index, "arguments": event.arguments})
                    )
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _render_chat(path: Any, args: argparse.Namespace, text: str, tokenizer: Any) -> Any:
    from deepinfer.recipe import Recipe
    from deepinfer.recipe.ir import Conversation, Message, TextPart
    from deepinfer.server.serve import load_model_info

    messages = [Message(role="system", content=[TextPart(args.system)])] if args.system else []
    messages.append(Message(role="user", content=[TextPart(text)]))
    recipe = Recipe.for_model(load_model_info(path, args.recipe_family))
    return recipe.render(Conversation(messages=messages), tokenizer=tokenizer.backend)


# ------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from deepinfer import __version__
    from deepinfer.bench.cli import add_bench_parser, run_bench

    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: an LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    _add_serve(commands)
    _add_generate(commands)
    add_bench_parser(commands)
    commands.choices["bench"].set_defaults(handler=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
