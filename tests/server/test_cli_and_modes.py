"""The `deepinfer` command line, and the same greedy answer from every way of running the engine:
the HTTP server (engine process), the app with the engine on a thread, and `deepinfer generate`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from deepinfer.cli import build_parser, engine_config_from_args, main
from deepinfer.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    StoreConfig,
    parse_size,
)
from deepinfer.config.flags import flag_name
from tests.server.conftest import MODEL
from tests.server.server_process import SMALL_KV

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("serve", "generate", "bench"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "roofline" in capsys.readouterr().out


def test_every_engine_option_is_a_flag() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "model.gguf",
            "--kv-cache-memory",
            "256MiB",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "4096",
        ]
    )
    config = engine_config_from_args(args.parser, args, args.model)
    assert config.model == "model.gguf"
    assert config.cache.kv_cache_memory == 256 << 20
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.scheduling_policy == "priority"
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len) == (8, 4096)
    # Untouched options keep the engine's defaults.
    defaults = EngineConfig()
    assert config.cache.block_size == defaults.cache.block_size
    assert config.cache.num_blocks == defaults.cache.num_blocks
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for name in EngineConfig().to_kwargs():
        if name != "model":
            flag = "--encoder" if name == "encoders" else "--" + name.replace("_", "-")  # a repeated flag
            assert flag in help_text


ENGINE_PARTS = (CacheConfig, SchedulerConfig, SpeculativeConfig, StoreConfig)
SIZE_FIELDS = [
    (cls, f)
    for cls in (*ENGINE_PARTS, ServerConfig)
    for f in dataclasses.fields(cls)
    if f.metadata.get("size")
]
SIZES = {"2GiB": 2 << 30, "2GB": 2 * 10**9, "512MiB": 512 << 20, "1e9": 10**9, "2G": 2 << 30}


@pytest.mark.parametrize(("text", "size"), sorted(SIZES.items()))
def test_every_size_flag_reads_units_the_same_way(text: str, size: int) -> None:
    names = {f.name for _, f in SIZE_FIELDS}
    assert names >= {"kv_cache_memory", "kv_host_cache_bytes", "kv_store_max_bytes", "max_body_bytes"}
    for cls, field in SIZE_FIELDS:
        args = build_parser().parse_args(["serve", flag_name(field), text])
        if cls is ServerConfig:
            assert getattr(ServerConfig(**{field.name: getattr(args, field.name)}), field.name) == size
            assert getattr(ServerConfig(**{field.name: text}), field.name) == size
        else:
            assert engine_config_from_args(args.parser, args, None).to_kwargs()[field.name] == size
            assert EngineConfig.from_kwargs(**{field.name: text}).to_kwargs()[field.name] == size


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-retention", "chat=7x"], "--kv-retention"),
        (["--kv-host-cache-bytes", "lots"], "--kv-host-cache-bytes"),
        (["--kv-store", "s3://bucket"], "--kv-store"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--max-waiting-requests", "0"], "--max-waiting-requests"),
        (["--block-size", "0"], "--block-size"),
        (["--rope-scaling", "yarn"], "--rope-scaling"),
        (["--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'], "--rope-scaling"),
        (["--rope-scaling", '{"rope_type": "yarn", "factor": 4, "beta": 1}'], "--rope-scaling"),
    ],
)
def test_bad_options_fail_before_anything_loads(flags: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/nonexistent/model.gguf", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_help_names_values_as_a_user_types_them() -> None:
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())  # type: ignore[union-attr]
    for shown in ("--api-key KEY", "--chat-encoding NAME", "--max-body-bytes SIZE", "--rope-scaling JSON"):
        assert shown in help_text
    assert "(default: 32MiB)" in help_text and "(default: 1GiB)" in help_text
    assert "33554432" not in help_text and "API_KEYS" not in help_text and "RECIPE_FAMILY" not in help_text


# Runs `deepinfer serve` in a fresh interpreter and reports whether torch was imported: a model
# path that is no model must be refused before the engine (and torch with it) starts.
_SERVE_REPORTING_TORCH = (
    "import sys\n"
    "from deepinfer.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    "sys.exit(code)\n"
)


def _serve_in_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SERVE_REPORTING_TORCH, "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({}, "it has no config.json and no *.safetensors weights"),
        ({"config.json": "{}", "model.safetensors": ""}, "is not a model's config: it has no"),
        ({"config.json": "{not json", "model.safetensors": ""}, "is not valid JSON"),
        ({"notes.txt": "hi"}, "it has no config.json"),
        (None, "does not exist"),
    ],
)
def test_a_path_that_is_no_model_fails_in_one_line_before_the_engine_starts(
    tmp_path: Path, layout: dict[str, str] | None, named: str
) -> None:
    model = tmp_path / "model"
    if layout is not None:
        model.mkdir()
        for name, text in layout.items():
            (model / name).write_text(text)
    result = _serve_in_subprocess(str(model))
    assert result.returncode == 1
    assert result.stdout.strip() == "torch not imported"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and str(model) in lines[0], result.stderr
    assert lines[0].startswith("deepinfer serve: error: ")


def test_a_file_that_is_no_gguf_is_named_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    model = tmp_path / "model.bin"
    model.write_bytes(b"\0" * 16)
    result = _serve_in_subprocess(str(model))
    assert result.returncode == 1 and "is a file but not a .gguf file" in result.stderr
    assert "Traceback" not in result.stderr
    debug = _serve_in_subprocess(str(model), "--log-level", "debug")
    assert (
        debug.returncode == 1 and "Traceback" in debug.stderr and "is a file but not a .gguf" in debug.stderr
    )


YARN_X4 = '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}'


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-model-len", "16384"], ("16384 tokens", "trained context of 8192 tokens", "--rope-scaling")),
        (
            ["--max-model-len", "65536", "--rope-scaling", YARN_X4],
            ("65536 tokens", "the 32768 tokens this --rope-scaling reaches"),
        ),
    ],
)
def test_a_context_past_what_the_model_places_is_refused_before_it_loads(
    flags: list[str], named: tuple[str, ...], capsys
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("deepinfer serve: error: --max-model-len: ")
    assert all(text in err for text in named), err


def test_the_engine_refuses_a_context_past_the_trained_one_and_takes_rope_scaling() -> None:
    from deepinfer import LLM

    with pytest.raises(ConfigError, match="16384 tokens is beyond the model's trained context of 8192"):
        LLM(max_model_len=16384, kv_cache_memory=SMALL_KV)
    scaling = json.loads(YARN_X4)
    llm = LLM(max_model_len=32768, kv_cache_memory=SMALL_KV, rope_scaling=scaling)
    try:
        core = llm.engine.core
        assert core.max_model_len == 32768
        assert core.loaded.config.max_position_embeddings == 32768
        assert core.loaded.config.rope_scaling == {"original_max_position_embeddings": 8192, **scaling}
        attention = core.loaded.model.layers[0].self_attn
        cos, _ = attention.rotary.tables(torch.device("cpu"), torch.float32)
        assert cos.shape[0] == 32768  # a position past 8192 has its own rotation
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("text", "size"),
    [("268435456", 268435456), ("256MiB", 256 << 20), ("2G", 2 << 30), ("1.5KiB", 1536), ("2GB", 2 * 10**9)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.fixture(scope="module")
def http_greedy(http: httpx.Client) -> dict[str, str]:
    completion = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    )
    chat = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    )
    return {
        "completion": completion.json()["choices"][0]["text"],
        "chat": chat.json()["choices"][0]["message"]["content"],
    }


def _generate(capsys, *args: str) -> str:
    # In this process (torch is imported already): the command's own code path, minus a restart.
    assert main(["generate", *args, "--temperature", "0", "--kv-cache-memory", SMALL_KV]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_generate_matches_the_server(http_greedy: dict[str, str], capsys) -> None:
    assert _generate(capsys, PROMPT, "--max-tokens", "5") == http_greedy["completion"]
    assert _generate(capsys, "--chat", CHAT[0]["content"], "--max-tokens", "24") == http_greedy["chat"]


def test_engine_on_a_thread_serves_the_same_app(http_greedy: dict[str, str]) -> None:
    from deepinfer.server.app import build_app
    from deepinfer.server.serve import start_state

    async def run() -> dict[str, str]:
        state = await start_state(
            EngineConfig.from_kwargs(kv_cache_memory=int(SMALL_KV)),
            ServerConfig(engine_mode="thread", log_level="warning"),
        )
        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://in-process", timeout=300
            ) as client:
                completion = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                )
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0},
                )
                health = await client.get("/health")
            assert health.json()["engine"]["pid"] == state.client.transport.engine_pid
            return {
                "completion": completion.json()["choices"][0]["text"],
                "chat": chat.json()["choices"][0]["message"]["content"],
            }
        finally:
            await state.client.close()

    assert asyncio.run(run()) == http_greedy
