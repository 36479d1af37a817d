"""`dist.init_distributed(single=True)` in a lone process: a one-rank group with no rendezvous address."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = "from dapo_ref import dist; r = dist.init_distributed(single=True, backend='gloo'); print(r, dist.all_reduce([2.0]))"


@pytest.mark.parametrize("left", [{}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}])
def test_lone_process_needs_no_master_addr(left):
    """A lone process builds its one-rank group in memory, also where a parent's own `init_distributed(single=True)`
    left WORLD_SIZE=1 in the environment it passed on (pytest's worker did, and `gpu_check.py` then asked env:// for a
    MASTER_ADDR nobody set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    p = subprocess.run(
        [sys.executable, "-c", CODE], cwd=ROOT, env={**env, **left}, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[-2] == "(0, 1) [2.0]"
