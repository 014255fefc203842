from __future__ import annotations

import sys

import pytest

from deepinfer.bench import sampling


def test_sampling_bench_times_both_paths(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["sampling", "--rows", "2", "--vocab", "300", "--repeats", "1"])
    sampling.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| ") and "ms" not in line and "---" not in line][1:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == list(sampling.SETTINGS)
    for row in rows:
        torch_ms, ours_ms = (float(cell) for cell in row.split(" | ")[1:3])
        assert torch_ms > 0 and ours_ms > 0
