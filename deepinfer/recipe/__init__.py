"""The recipe: DeepInfer's codec between the conversation IR and the model's prompt and output.

Importable without torch or transformers, so another server can reuse it for the same prompts
and the same parses:

    recipe = Recipe.for_model(ModelInfo.from_gguf(path))
    prompt = recipe.render(conversation, tokenizer=tokenizer)   # text, token ids, family
    parser = prompt.new_parser()                                  # matching state and syntax
    for piece in stream: events += parser.feed(piece.text, piece.token_ids)
    events += parser.finish("stop")

A recipe family is a chat encoding (deepinfer.recipe.encodings: one record each, and
`register_encoding` for a new one); the model family of a checkpoint (deepinfer.families)
chooses it.
"""

from __future__ import annotations

from deepinfer.recipe.encodings import Encoding, PromptDefaults, encoding_names, register_encoding
from deepinfer.recipe.errors import RecipeError
from deepinfer.recipe.family import FAMILIES, Recipe, RenderedPrompt, parse_completion, resolve_family
from deepinfer.recipe.model_info import ModelInfo
from deepinfer.recipe.parse.result import CompletionBuilder, ParsedCompletion
from deepinfer.recipe.parse.stream import ParserSpec, StreamParser, new_call_id

__all__ = [
    "FAMILIES",
    "CompletionBuilder",
    "Encoding",
    "ModelInfo",
    "ParsedCompletion",
    "ParserSpec",
    "PromptDefaults",
    "Recipe",
    "RecipeError",
    "RenderedPrompt",
    "StreamParser",
    "encoding_names",
    "new_call_id",
    "parse_completion",
    "register_encoding",
    "resolve_family",
]
