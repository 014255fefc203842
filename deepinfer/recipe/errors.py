"""The one error the recipe raises for bad client input (the server turns it into a 400)."""

from __future__ import annotations


class RecipeError(ValueError):
    """Invalid input; `param` names the offending field (e.g. "messages[2].tool_call_id")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
