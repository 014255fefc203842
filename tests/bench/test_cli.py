from __future__ import annotations

import argparse

import pytest

from deepinfer.bench.cli import add_bench_parser, main, run_bench


def test_the_lead_can_mount_bench_under_the_deepinfer_command(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="deepinfer")
    subparsers = parser.add_subparsers(dest="command", required=True)
    subparsers.add_parser("serve")
    add_bench_parser(subparsers)
    args = parser.parse_args(
        ["bench", "economics", "--output-tokens-per-s", "1000", "--prices", "deepseek-v3.2",
         "--card-cost-per-hour", "2"]
    )  # fmt: skip
    assert args.command == "bench" and args.bench_command == "economics"
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    # 3.6M output tokens per card-hour at $0.42/1M: $1.512 of revenue against $2 of cost.
    assert "| revenue / card-hour (USD) | 1.5120 |" in out
    assert "| gross margin | -32% |" in out
    assert "deepseek-v3.2, as of 2025-09-29" in out


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("serve", "roofline", "economics", "peers"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--help"])
        assert stop.value.code == 0
        assert "usage: python -m deepinfer.bench " + command in capsys.readouterr().out


def test_bad_arguments_name_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--base-url", "http://x", "--sweep-concurrency", "1,zero"])
    assert "--sweep-concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--base-url", "http://x", "--extra-body", "[1]"])
    assert "--extra-body must be a JSON object" in capsys.readouterr().err
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset", "random",
                 "--num-prompts", "0", "--disable-tqdm", "--no-warmup"]) == 2  # fmt: skip
    assert "num_prompts must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--api", "chat",
                 "--max-concurrency", "0", "--disable-tqdm"]) == 2  # fmt: skip
    assert "max_concurrency must be >= 1" in capsys.readouterr().err
