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


@pytest.mark.parametrize("visible, local, expected", [(1, 3, 0), (8, 3, 3), (4, 6, 2)])
def test_nccl_device_is_a_visible_ordinal(monkeypatch, visible, local, expected):
    """`init_distributed` puts a rank on a GPU its process can see. Under `srun --gpus-per-task=1` task 3 of a node sees
    one GPU, cuda:0, and LOCAL_RANK=3: set_device(3) (the code before this test) fails there. torchrun shows all 8:
    LOCAL_RANK itself. 4 visible for local rank 6 (two tasks of 4 GPUs each, one rank per GPU): 6 mod 4 = 2. NCCL and
    CUDA are stand-ins here (recorders): what is checked is the ordinal handed to torch.cuda.set_device."""
    import torch
    from dapo_ref import dist

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    for k, v in dict(WORLD_SIZE="8", RANK=str(local), LOCAL_RANK=str(local)).items():
        monkeypatch.setenv(k, v)
    assert dist.init_distributed(backend="nccl") == (local, 8)  # the environment's: the stand-in group is not up
    assert calls == [("set_device", expected), ("init", "nccl")]


def test_vllm_run_refuses_a_local_rank_past_the_visible_gpus(monkeypatch):
    """`srun --gpus-per-task=1` shows each task one GPU while LOCAL_RANK counts the node's tasks: the learner's device
    is `dist.device_index()` (LOCAL_RANK modulo the visible GPUs), but vLLM's external launcher takes LOCAL_RANK itself
    as its CUDA device; `check_run` refuses the launch in one line before any model loads, naming both numbers."""
    import importlib.util

    import torch
    from dapo_ref import trainer
    from dapo_ref.core import DAPOConfig, InputError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: object() if m == "vllm" else real(m, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = DAPOConfig(rollout_backend="vllm", gpus_per_node=4)
    with pytest.raises(InputError, match=r"LOCAL_RANK = 3, but this process sees 1 GPU\(s\)"):
        trainer.check_run(cfg, world=4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # every task sees its node's GPUs: accepted
    assert trainer.check_run(cfg, world=4) is cfg
