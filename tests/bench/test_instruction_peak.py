"""The instruction-rate benchmark times only what this CPU runs, and times it."""

from __future__ import annotations

import pytest

from deepinfer.bench import instruction_peak
from deepinfer.kernels import isa

pytestmark = pytest.mark.skipif(not isa.is_x86(), reason="the benchmark's kernels are x86 assembly")


def test_every_kind_this_cpu_has_gives_a_rate():
    kinds = instruction_peak.available_kinds()
    assert kinds, "every x86-64 CPU we run on has AVX2 and FMA"
    for kind in kinds:
        # 12,000 instructions per thread: microseconds, at most a few GHz
        rate = instruction_peak.instruction_rate(kind, 1, 1000)
        assert 1e6 < rate < 1e11, (kind.name, rate)


def test_a_kind_the_cpu_lacks_is_refused_not_run(monkeypatch):
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    names = {kind.name for kind in instruction_peak.available_kinds()}
    assert names == {kind.name for kind in instruction_peak.KINDS if kind.cpu_flag in {"avx2", "fma"}}
    with pytest.raises(ValueError, match="avx512_vnni"):
        instruction_peak.instruction_rate(instruction_peak.KINDS[0], 1, 10)
