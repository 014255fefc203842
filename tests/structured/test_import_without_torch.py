"""The structured layer (all but bitmask.py) must not pull torch into the API process."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_torch():
    code = "import sys, deepinfer.structured; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
