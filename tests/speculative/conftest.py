"""A tiny random DeepSeek-V3 checkpoint with an MTP module, built once per session."""

from __future__ import annotations

import pytest

from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint


@pytest.fixture(scope="session")
def v3_mtp_ckpt(tmp_path_factory) -> TinyCheckpoint:
    return build_checkpoint(tmp_path_factory.mktemp("spec_v3"), {}, fp8=False, seed=0)


@pytest.fixture(scope="session")
def v3_ckpt_path(v3_mtp_ckpt):
    return v3_mtp_ckpt.path
