"""Adding a model family is one folder plus one registration: a toy family defined here (a Llama
subclass under a new model_type, spoken to through its chat template with Hermes tool calls) is
registered with `register_family` and served by the real HTTP app, engine on a thread in this
process. Unregistered, the same checkpoint is refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from deepinfer.config import EngineConfig, ServerConfig
from deepinfer.engine.ipc.transport import EngineStartError
from deepinfer.families import ModelFamily, family_for_model_type, register_family, unregister_family
from deepinfer.model.config import ModelConfig
from deepinfer.model.llama.model import LlamaForCausalLM
from deepinfer.model.parallel import ModelParallel
from deepinfer.model.registry import model_class
from deepinfer.recipe import ModelInfo, Recipe, RecipeError
from deepinfer.recipe.ir import Conversation, Message, TextPart, Tool
from deepinfer.server.app import build_app
from deepinfer.server.serve import start_state
from tests.server.server_process import SMALL_KV
from tests.server.tiny_smollm import write_tiny_smollm

REPO = Path(__file__).resolve().parents[1]
TOY_TYPE = "toy_llama"
SERVED_NAME = "toy-llama-1"


class ToyLlamaForCausalLM(LlamaForCausalLM):
    """The toy family's model: Llama's layers, counted as they are built."""

    built: ClassVar[list[ToyLlamaForCausalLM]] = []

    def __init__(self, cfg: ModelConfig, parallel: ModelParallel | None = None) -> None:
        super().__init__(cfg, parallel)
        ToyLlamaForCausalLM.built.append(self)


TOY_FAMILY = ModelFamily(
    name="toy_llama",
    model_types=(TOY_TYPE,),
    model_class=f"{__name__}:ToyLlamaForCausalLM",
    encoding="chat_template",
    tool_format="hermes",
)

TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time.",
        "parameters": {"type": "object", "properties": {}},
    },
}
# A conversation with a previous call and its result (rendered back into the prompt), then a
# forced call: the answer must be a Hermes call that the parser reads back.
CHAT = {
    "model": SERVED_NAME,
    "messages": [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "And now?"},
    ],
    "tools": [TOOL],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "temperature": 0,
    "max_tokens": 64,
}


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama HF folder (SmolLM2's tokenizer and template) of model_type
    toy_llama."""
    directory = write_tiny_smollm(tmp_path_factory.mktemp("toy_llama"))
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = TOY_TYPE
    (directory / "config.json").write_text(json.dumps(config))
    return directory


async def _serve(checkpoint: Path) -> tuple[httpx.Response, Any]:
    """One forced-call chat completion from the real app, engine on a thread."""
    state = await start_state(
        EngineConfig.from_kwargs(model=str(checkpoint), kv_cache_memory=int(SMALL_KV)),
        ServerConfig(engine_mode="thread", log_level="warning", served_model_names=[SERVED_NAME]),
    )
    try:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://in-process", timeout=300
        ) as client:
            return await client.post("/v1/chat/completions", json=CHAT), state.recipe
    finally:
        await state.client.close()


def test_an_unregistered_family_is_refused(toy_checkpoint: Path) -> None:
    assert family_for_model_type(TOY_TYPE) is None
    with pytest.raises(ValueError, match="unsupported model type 'toy_llama'"):
        model_class(TOY_TYPE)
    with pytest.raises(EngineStartError, match="unsupported model type 'toy_llama'"):
        asyncio.run(_serve(toy_checkpoint))


def test_a_registered_toy_family_is_served(toy_checkpoint: Path) -> None:
    register_family(TOY_FAMILY)
    try:
        assert model_class(TOY_TYPE) is ToyLlamaForCausalLM
        ToyLlamaForCausalLM.built.clear()
        response, recipe = asyncio.run(_serve(toy_checkpoint))
    finally:
        unregister_family(TOY_FAMILY.name)
    assert family_for_model_type(TOY_TYPE) is None
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == SERVED_NAME
    assert ToyLlamaForCausalLM.built, "the engine did not build the toy family's model class"
    assert recipe.family == "chat_template"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {}


def test_the_family_record_names_the_tool_syntax() -> None:
    """A template that takes `tools` in a syntax deepinfer cannot read: the toy record's Hermes
    syntax is what its prompts ask for; without the record the same template refuses tools."""
    info = ModelInfo(
        model_type=TOY_TYPE,
        chat_template="{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    conv = Conversation(
        messages=[Message(role="user", content=[TextPart("hi")])], tools=[Tool(name="get_time")]
    )
    with pytest.raises(RecipeError, match="tool-call syntax"):
        Recipe.for_model(info).render(conv)
    register_family(TOY_FAMILY)
    try:
        recipe = Recipe.for_model(info)
    finally:
        unregister_family(TOY_FAMILY.name)
    assert recipe.family == "chat_template"
    assert recipe.render(conv).parser_spec.tool_format == "hermes"


def test_reading_the_family_records_imports_no_torch() -> None:
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from deepinfer.families import registered_families, family_for_model_type\n"
        "assert family_for_model_type('deepseek_v41').vision_tower\n"
        "assert [f.name for f in registered_families()][:4] == "
        "['llama', 'deepseek_v3', 'deepseek_v4', 'deepseek_v41']\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
