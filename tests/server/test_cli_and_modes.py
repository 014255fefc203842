"""The `deepinfer` command line, and the same greedy answer from every way of running the engine:
the HTTP server (engine process), the app with the engine on a thread, and `deepinfer generate`."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from deepinfer.cli import build_parser, engine_config_from_args, main
from deepinfer.config import (
    CacheConfig,
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
    ],
)
def test_bad_options_fail_before_anything_loads(flags: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/nonexistent/model.gguf", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


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
