"""`deepinfer generate` names the chat encoding as `deepinfer serve` does (`--chat-encoding`), and
still takes the old spelling, `--recipe-family`, for the same option."""

from __future__ import annotations

import pytest

from deepinfer.cli import build_parser


@pytest.mark.parametrize("flag", ["--chat-encoding", "--recipe-family"])
def test_generate_takes_both_spellings(flag: str) -> None:
    args = build_parser().parse_args(["generate", "--chat", "hello", flag, "chat_template"])
    assert args.recipe_family == "chat_template"


def test_generate_and_serve_name_it_alike() -> None:
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in ("generate", "serve"):
        assert "--chat-encoding NAME" in " ".join(commands[command].format_help().split())
    assert build_parser().parse_args(["generate", "hello"]).recipe_family is None
