"""`python -m deepinfer.bench ...`: the `deepinfer bench` commands without the top-level CLI."""

from __future__ import annotations

import sys

from deepinfer.bench.cli import main

sys.exit(main())
