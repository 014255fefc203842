"""Renderers: the conversation IR to prompt text, one module per prompt family."""
