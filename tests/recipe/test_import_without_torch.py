"""The recipe is a codec another server can reuse: it must import without torch or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
sys.modules["transformers"] = None
import deepinfer.recipe
from deepinfer.recipe import Recipe, ModelInfo
from deepinfer.recipe.ir import Conversation, Message, TextPart
import deepinfer.recipe.render.chat_template, deepinfer.recipe.render.deepseek_v32
import deepinfer.recipe.render.deepseek_v31, deepinfer.recipe.parse, deepinfer.recipe.images
recipe = Recipe("deepseek_v32")
prompt = recipe.render(Conversation(messages=[Message(role="user", content=[TextPart("hi")])]))
assert prompt.parse_completion("hello").content == "hello"
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") and sys.modules[m] is not None)
assert not loaded, loaded
print("ok")
"""


def test_recipe_imports_and_works_without_torch_or_transformers():
    """Importing and using deepinfer.recipe never imports torch or transformers."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
