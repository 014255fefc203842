"""The families DeepInfer ships, registered here and nowhere else."""

from __future__ import annotations

from deepinfer.families.record import ModelFamily
from deepinfer.families.registry import register_family

_THINK_OPEN = "<think>"


def _deepseek_v3_encoding(model_type: str, chat_template: str | None) -> str | None:
    """V3.2 speaks its native encoding; V3 / V3.1 / R1 checkpoints are told apart by their chat
    template (a template-less DeepSeek checkpoint gets V3.2's native encoding)."""
    if model_type == "deepseek_v32" or chat_template is None:
        return "deepseek_v32"
    if "<｜tool▁sep｜>" in chat_template and "```json" not in chat_template and "thinking" in chat_template:
        return "deepseek_v31"
    if "```json" in chat_template and _THINK_OPEN in chat_template:
        return "deepseek_r1"
    return None


BUILTIN_FAMILIES = (
    ModelFamily(
        name="llama",
        model_types=("llama", "qwen2", "qwen3", "mistral", "smollm"),
        model_class="deepinfer.model.llama.model:LlamaForCausalLM",
    ),
    ModelFamily(
        name="deepseek_v3",
        model_types=("deepseek_v3", "deepseek_v32", "deepseek_v2"),
        model_class="deepinfer.model.deepseek_v3.model:DeepseekV3ForCausalLM",
        encoding=_deepseek_v3_encoding,
        encoding_model_types=("deepseek2",),  # llama.cpp's GGUF architecture name
    ),
    ModelFamily(
        name="deepseek_v4",
        model_types=("deepseek_v4",),
        model_class="deepinfer.model.deepseek_v4.model:DeepseekV4ForCausalLM",
        encoding="deepseek_v4",
        own_layer_types=True,
    ),
    ModelFamily(
        name="deepseek_v41",
        model_types=("deepseek_v41",),
        model_class="deepinfer.model.deepseek_v4.v41_model:DeepseekV41ForCausalLM",
        encoding="deepseek_v41",
        encoding_prefixes=("deepseek_v4",),  # later V4-family configs: V4.1's encoding
        vision_tower="deepinfer.model.deepseek_v4.vision:VisionEncoderV41",
        own_layer_types=True,
    ),
)

for _family in BUILTIN_FAMILIES:
    register_family(_family)
