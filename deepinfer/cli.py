"""The `deepinfer` command: serve | generate | bench | router.

Every EngineConfig field is a flag of `serve` and `generate` (`--kv-cache-memory 256MiB`,
`--max-num-seqs 64`, `--no-enable-prefix-caching`, ...), derived from the dataclass so a new
engine option is a new flag without touching this file.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every engine option as a flag (the model is the command's positional argument)."""
    from deepinfer.config import EngineConfig
    from deepinfer.config.flags import add_config_flags

    add_config_flags(parser, EngineConfig, "engine options", skip=("model",))


def engine_config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: str | None
) -> Any:
    """The validated EngineConfig of the parsed flags; a bad value is a usage error naming its flag."""
    from deepinfer.config import EngineConfig
    from deepinfer.config.flags import build_config, given_options

    return build_config(
        parser, EngineConfig, {"model": model, **given_options(args, EngineConfig, skip=("model",))}
    )


# ------------------------------------------------------------------------------------- serve


def _add_serve(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI- and Anthropic-compatible)",
        usage="%(prog)s [options] [model]",  # every flag is listed below, by group
        description="Serve a model: OpenAI Chat Completions, Completions and Responses, Anthropic "
        "Messages, plus /health, /metrics, /tokenize and /detokenize.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    from deepinfer.config import ServerConfig
    from deepinfer.config.flags import add_config_flags

    add_config_flags(p, ServerConfig, "server options")
    add_engine_options(p)
    p.set_defaults(handler=_run_serve, parser=p)


def _run_serve(args: argparse.Namespace) -> int:
    from deepinfer.config import ConfigError, EngineConfig, ServerConfig
    from deepinfer.config.flags import build_config, flag_message, given_options
    from deepinfer.engine.ipc.transport import EngineStartError
    from deepinfer.model.loader.preflight import check_context, check_model_source
    from deepinfer.recipe import RecipeError

    # Every option is validated here, before the engine process starts loading weights.
    server_config = build_config(args.parser, ServerConfig, given_options(args, ServerConfig))
    engine_config = engine_config_from_args(args.parser, args, args.model)
    _check_cluster_key(args.parser, engine_config.disaggregation.cluster_key_file)
    if engine_config.disaggregation.role in ("prefill", "decode"):
        _require_cluster_key(args.parser, engine_config.disaggregation, "--role")
    logging.basicConfig(
        level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A start that fails says why in one line; the traceback is for --log-level debug.
    try:
        path = check_model_source(engine_config.model)
        try:
            check_context(path, engine_config.scheduler.max_model_len, engine_config.rope_scaling)
        except ConfigError as error:
            args.parser.error(flag_message(EngineConfig, error))
        return _serve(args, engine_config, server_config)
    except (OSError, ValueError, EngineStartError, RecipeError) as error:
        if server_config.log_level == "debug":
            raise
        print(f"deepinfer serve: error: {error} (--log-level debug shows where)", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace, engine_config: Any, server_config: Any) -> int:
    from deepinfer.server.serve import run_server

    if engine_config.disaggregation.role == "encode":
        from deepinfer.config import ConfigError
        from deepinfer.encoder.serve import run_encoder

        try:
            run_encoder(engine_config, server_config)
        except ConfigError as error:
            args.parser.error(str(error))
        return 0
    if engine_config.parallel.world_size > 1:
        from deepinfer.distributed.topology import resolve_topology
        from deepinfer.engine.parallel.worker import run_node

        try:
            rank = resolve_topology(engine_config.parallel).rank
        except ValueError as error:
            args.parser.error(str(error))
        if rank != 0:  # another machine (--node-rank N) or a launcher's rank: no HTTP here
            return run_node(engine_config, server_config.log_level)
    run_server(engine_config, server_config)
    return 0


def _check_cluster_key(parser: argparse.ArgumentParser, path: str | None) -> None:
    """A key file that is missing, short or not private is a usage error before anything starts."""
    if path is None:
        return
    from deepinfer.security import ClusterKeyError, read_cluster_key

    try:
        read_cluster_key(path)
    except ClusterKeyError as error:
        parser.error(str(error))


def _require_cluster_key(parser: argparse.ArgumentParser, config: Any, what: str) -> None:
    """Prefill/decode handoffs are signed with the cluster key: without one they cannot work."""
    if config.cluster_key_file is None:
        parser.error(
            f"{what}: prefill/decode handoffs are signed with the deployment's secret; give the "
            "router and every prefill and decode engine the same --cluster-key-file"
        )


# ------------------------------------------------------------------------------------ router


def _add_router(commands: Any) -> None:
    p = commands.add_parser(
        "router",
        help="one HTTP entry point in front of several replicas (cache-aware, prefill/decode)",
        description="Route OpenAI and Anthropic requests across `deepinfer serve` replicas (--replica, "
        "repeated) or across prefill and decode replicas (--prefill / --decode): round robin, least "
        "load, or cache-aware from the KV events the replicas publish (--kv-events-endpoint).",
    )
    from deepinfer.config.flags import add_config_flags
    from deepinfer.config.router import RouterConfig

    add_config_flags(p, RouterConfig, "router options")
    p.set_defaults(handler=_run_router, parser=p)


def _run_router(args: argparse.Namespace) -> int:
    from deepinfer.config.flags import build_config, given_options
    from deepinfer.config.router import RouterConfig
    from deepinfer.router.main import run_router

    config = build_config(args.parser, RouterConfig, given_options(args, RouterConfig))
    _check_cluster_key(args.parser, config.cluster_key_file)
    if config.prefill:
        _require_cluster_key(args.parser, config, "--prefill/--decode")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_router(config)
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
        "--model",
        default=None,
        metavar="PATH",
        help="a .gguf file or a HF directory (default: the embedded model)",
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
    p.add_argument(
        "--chat-encoding",
        "--recipe-family",  # the old spelling, still accepted
        dest="recipe_family",
        metavar="NAME",
        help="the chat encoding (prompt format and output parser) of --chat, overriding the one detected "
        "from the model: deepseek_v41, deepseek_v4, deepseek_v32, deepseek_v31, deepseek_r1 or chat_template",
    )
    add_engine_options(p)
    p.set_defaults(handler=_run_generate, parser=p)


def _run_generate(args: argparse.Namespace) -> int:
    from deepinfer.entrypoints.llm_engine import LLMEngine
    from deepinfer.model.loader.preflight import check_model_source
    from deepinfer.model.loader.source import resolve_model_path
    from deepinfer.recipe import RecipeError
    from deepinfer.recipe.events import ReasoningDelta, TextDelta, ToolCallEnd
    from deepinfer.sampling_params import InvalidRequestError, SamplingParams
    from deepinfer.validation import check_prompt, max_tokens_for

    config = engine_config_from_args(args.parser, args, args.model)
    try:
        check_model_source(config.model)  # a path that is no model: one line, before torch loads it
    except (OSError, ValueError) as error:
        print(f"deepinfer generate: error: {error}", file=sys.stderr)
        return 1
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = LLMEngine(config)
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,router}")
    _add_serve(commands)
    _add_router(commands)
    _add_generate(commands)
    add_bench_parser(commands)
    commands.choices["bench"].set_defaults(handler=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
