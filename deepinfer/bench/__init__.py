"""Benchmarks: the serving load generator, peer comparison, roofline and economics.

Shared reporting helpers for other benchmarks live in ``deepinfer.bench.stats`` (percentiles,
summaries, TPOT, goodput) and ``deepinfer.bench.report`` (provenance, JSON, markdown tables).
"""

from __future__ import annotations
