"""bf16 full fine-tuning needs an fp32 master copy (nbs/00_core.ipynb, the `dtype` rule): the plain PyTorch learner
with `dtype: bfloat16`, `zero_stage: 0` and `lora_r: 0` is refused, because its AdamW would step the bf16 weights
themselves and the paper's lr 1e-6 rounds away; the two ways out the error names (`zero_stage: 2`, `dtype: float32`)
keep the update."""

import copy, os

import pytest
import torch

from dapo_ref.algorithm import train_on
from dapo_ref.cli import load_config
from dapo_ref.core import DAPOConfig, InputError
from dapo_ref.learner import TorchLearner
from dapo_ref.policy import load_model, load_policy
from test_lora import ROOT, batch

LR = 1e-6  # the paper's
BOUND = 2.0**-11  # a bf16 weight of |w| > BOUND cannot move by LR: half its step is 2^-19 > 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (conftest.py)


def test_bf16_full_fine_tuning_without_deepspeed_is_refused_naming_both_ways_out():
    with pytest.raises(InputError) as e:
        DAPOConfig(dtype="bfloat16")
    msg = str(e.value)
    assert e.value.field == "dtype" and "\n" not in msg
    assert msg.startswith("dtype = bfloat16 with zero_stage = 0 and lora_r = 0: ")
    assert "set zero_stage: 2 (DeepSpeed keeps an fp32 master copy) or dtype: float32" in msg
    assert DAPOConfig(dtype="bfloat16", zero_stage=2).dtype == "bfloat16"  # DeepSpeed's fp32 master
    assert DAPOConfig(dtype="bfloat16", zero_stage=3).dtype == "bfloat16"
    assert DAPOConfig(dtype="bfloat16", lora_r=8).dtype == "bfloat16"  # fp32 adapters
    with pytest.raises(InputError, match="set dtype: bfloat16 with zero_stage: 2 or attn_implementation: sdpa"):
        DAPOConfig(attn_implementation="flash_attention_2")  # the flash rule's fix does not lead into this one


def test_no_shipped_recipe_trains_bf16_weights_without_a_master_copy():
    for r in sorted((ROOT / "recipes").glob("*.yaml")):
        c = load_config(r)  # a recipe with the combination would not load at all
        assert c.dtype != "bfloat16" or c.zero_stage > 0 or c.lora_r > 0, r.name


def test_an_lr_1e6_step_survives_only_with_an_fp32_copy(monkeypatch):
    """One AdamW step at lr 1e-6 on the tiny policy (444,544 weights), three ways, on the same four responses.

    Why it vanishes in bf16: bf16 keeps 8 significant bits, so a weight in [2^e, 2^(e+1)) lies on a grid of step
    2^(e-7), and rounding to nearest keeps it unless the change reaches half a step, 2^(e-8). AdamW's first step is
    lr * m_hat / (sqrt(v_hat) + eps) with m_hat = g and v_hat = g^2 (bias-corrected), i.e. lr * g / (|g| + 1e-8),
    at most lr = 1e-6 in size, plus the decoupled decay lr * 0.1 * |w|. For |w| > 2^-11 half a step is at least
    2^-19 = 1.91e-6 > 1e-6 + 1e-7 |w| for every |w| < 9: every such weight keeps its bf16 value exactly, whatever
    its gradient. Below, and from 2^-11 itself toward zero (the grid under a power of two is twice as fine), half a
    step is 2^-20 = 9.5e-7 < 1e-6, so those weights can move. Why the ways out keep
    it: an fp32 weight (a DeepSpeed master copy, or `dtype: float32`) of |w| < 2 has a step of at most 2^-23 =
    1.2e-7, below the 1e-6 update, so every weight whose gradient is not ~0 moves. The size that shows it: one
    step of the tiny policy in bf16 (the property is per weight; a bigger model adds nothing but time)."""
    pytest.importorskip("deepspeed")
    if not torch.cuda.is_available():
        monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))  # as dapo-train does on a CPU
    from dapo_ref.scale import DeepSpeedLearner

    _, tok = load_policy("tiny")
    pad, b = tok.pad_token_id, batch(tok)
    w0 = [p.detach().clone() for p in load_model("tiny", "bfloat16").parameters()]
    big = torch.cat([(w.abs() > BOUND).flatten() for w in w0])  # (N,) the weights lr 1e-6 cannot move in bf16
    n = big.numel()
    assert big.float().mean() > 0.99  # the tiny policy's weights are almost all above 2^-11, as a real model's are

    def moved(before, after) -> torch.Tensor:  # (N,) which weights changed
        return torch.cat([(a.float() != w.float()).flatten() for w, a in zip(before, after)])

    # the refused combination: the plain learner's AdamW on bf16 parameters (built around the config's rule)
    plain = TorchLearner(load_model("tiny", "bfloat16"), DAPOConfig(lr=LR, warmup_steps=0), pad_token_id=pad)
    train_on(plain, b, len(b))
    bf16_moved = moved(w0, [p.detach() for p in plain.model.parameters()])
    assert not bf16_moved[big].any()  # not one weight of |w| > 2^-11 moved: the whole update rounded away
    assert bf16_moved.sum() <= (~big).sum()  # what moved at all is among the small ones

    # way out 1: zero_stage: 2, DeepSpeed's fp32 master copy takes the step (the bf16 module is cast from it)
    cfg = load_config(ROOT / "recipes" / "tiny-cpu.yaml", dict(zero_stage=2, dtype="bfloat16", lr=LR, warmup_steps=0))
    ds = DeepSpeedLearner(load_model("tiny", "bfloat16"), cfg, pad)
    master0 = [p.detach().clone() for p in ds.guard_weights()]  # the fp32 master: one flat partition
    assert all(p.dtype == torch.float32 for p in master0) and sum(p.numel() for p in master0) == n
    train_on(ds, b, len(b))
    step = torch.cat([(a - w).flatten() for w, a in zip(master0, ds.guard_weights())]).abs()  # (N,)
    ds_module = [p.detach().clone() for p in ds.model.parameters()]
    ds.close()
    # every weight with a gradient moves: those without one (embedding rows of tokens the four responses never use)
    # are the only ones left, as in the float32 learner below
    assert (step > 0).float().mean() > 0.98
    assert ((step - LR).abs() <= 0.2 * LR).float().mean() > 0.9  # most by lr: |g| >> 1e-8, decay <= 1e-7 |w|
    assert not moved(w0, ds_module)[big].any()  # its bf16 copy has not moved yet: the master holds the update

    # way out 2: dtype: float32, the plain learner stepping fp32 weights
    f0 = copy.deepcopy(load_model("tiny", "float32"))
    f32 = TorchLearner(copy.deepcopy(f0), DAPOConfig(lr=LR, warmup_steps=0), pad_token_id=pad)
    train_on(f32, b, len(b))
    f32_moved = moved(list(f0.parameters()), [p.detach() for p in f32.model.parameters()])
    assert f32_moved.float().mean() > 0.98 and f32_moved[big].float().mean() > 0.98
