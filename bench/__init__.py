"""Benchmark scripts of the repository: peers, roofline, economics and studies.

`deepinfer bench <command>` runs them from a checkout (see deepinfer/bench/cli.py).
"""
