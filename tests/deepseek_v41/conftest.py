"""Shared setup of the DeepSeek-V4.1 tests."""

from __future__ import annotations

from tests.one_thread import one_thread  # noqa: F401  (autouse)
