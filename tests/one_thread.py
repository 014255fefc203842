"""An autouse fixture for test packages of tiny models: torch on one thread (imported by their
conftest), since threads only add synchronisation on tiny matrices and the shared cores."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
