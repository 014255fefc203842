"""The step's token budget: 1024 by default on the CPU, 2048 on a GPU, whatever is asked kept."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.config.engine import SchedulerConfig
from deepinfer.engine.scheduler import Scheduler

from .helpers import kv_manager


def test_the_default_budget_follows_the_device_and_an_asked_one_is_kept() -> None:
    assert SchedulerConfig().on_device("cpu").max_num_batched_tokens == 1024
    assert SchedulerConfig().on_device("cuda").max_num_batched_tokens == 2048
    asked = SchedulerConfig(max_num_batched_tokens=4096)
    assert asked.on_device("cpu") is asked
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.from_kwargs(max_num_batched_tokens=0)


def test_a_scheduler_refuses_a_budget_not_yet_set_by_device() -> None:
    with pytest.raises(ValueError, match="on_device"):
        Scheduler(SchedulerConfig(), 8192, kv_manager(16, 4, True))


def test_an_engine_on_the_cpu_steps_1024_tokens(default_llm) -> None:
    assert default_llm.engine.core.config.scheduler.max_num_batched_tokens == 1024
