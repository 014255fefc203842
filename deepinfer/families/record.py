"""One model family's record: everything the engine, the recipe and the server need to know about
an architecture, as plain data (strings and small pure functions), so reading it imports no torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (model_type, chat template or None) -> the recipe encoding's name; None: the model's own
# chat template (the `chat_template` encoding).
EncodingChooser = Callable[[str, str | None], str | None]


@dataclass(slots=True, frozen=True)
class ModelFamily:
    """A family of checkpoints served by one model class and spoken to in one way.

    `model_class` and `vision_tower` are lazy "module:Class" paths: they are imported only when a
    model is built, never when the record is read (the API process, the router and the recipe
    read records without torch).
    """

    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values its model class serves
    model_class: str  # "module:Class" of its CausalLM; the class declares its own cache groups
    # The recipe encoding: a fixed name, or a chooser that reads the model type and chat template.
    encoding: str | EncodingChooser = "chat_template"
    # Names that choose this family's encoding without selecting its class (a GGUF architecture
    # that has no loader here), and prefixes for later model types of the family (V4.1's
    # encoding for later V4-family configs).
    encoding_model_types: tuple[str, ...] = ()
    encoding_prefixes: tuple[str, ...] = ()
    # The tool-call syntax of its chat template where the template does not say (None: the
    # encoding's own, or read from the template).
    tool_format: str | None = None
    vision_tower: str | None = None  # "module:Class" of its image encoder (None: takes no images)
    # Its config module reads its own `layer_types` (hybrid attention kinds), so the generic
    # sliding-window reading of ModelConfig leaves them alone.
    own_layer_types: bool = False

    def __post_init__(self) -> None:
        for path in (self.model_class, self.vision_tower):
            if path is not None and ":" not in path:
                raise ValueError(f"family {self.name!r}: {path!r} is not a 'module:Class' path")
        if not self.model_types:
            raise ValueError(f"family {self.name!r} serves no model type")

    def choose_encoding(self, model_type: str, chat_template: str | None) -> str | None:
        """The recipe encoding for a checkpoint of this family (None: its own chat template)."""
        if isinstance(self.encoding, str):
            return None if self.encoding == "chat_template" else self.encoding
        return self.encoding(model_type, chat_template)

    def load_model_class(self) -> Any:
        """The model class, importing its module (and torch) on first use."""
        return load_object(self.model_class)

    def load_vision_tower(self) -> Any:
        """The image encoder's class; a ValueError for a family that takes no images."""
        if self.vision_tower is None:
            raise ValueError(f"the {self.name} family has no vision tower")
        return load_object(self.vision_tower)


def load_object(path: str) -> Any:
    """The object a "module:attribute" path names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
