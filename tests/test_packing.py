"""Packed micro-batches (`learner.pack`) and the fused log-prob give what the padded layout (`learner.collate`) gives.

Float64 throughout, so the only differences are rounding (about 1e-16 relative): the padded layout computes attention
over padding it masks and its logits whole, the packed one attends within each sequence and never forms the logits.
"""
import pytest
import torch

from dapo_ref import learner as L
from dapo_ref.core import LOSS_AGGS, DAPOConfig
from dapo_ref.learner import RolloutBatch, TorchLearner, collate, forward_logprobs, pack, pack_micro_batches
from dapo_ref.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def tiny64():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float64)


def batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    P = [torch.randint(3, 60, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    R = [torch.randint(3, 60, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    trunc = torch.tensor([i % 3 == 1 for i in range(n)])
    return RolloutBatch(P, R, adv, trunc, torch.zeros(n))


def grads(tiny64, cfg, b, layout, monkeypatch, old, undo=True):
    "Loss and gradient of one mini-batch through the learner's own micro-batch loop, in the given layout, at old log-probs `old`."
    model = __import__("copy").deepcopy(tiny64)
    lrn = TorchLearner.build(cfg, 0, model=model)
    if layout == "padded":
        monkeypatch.setattr(L, "pack", lambda p, r: collate(p, r, pad_id=0))
        monkeypatch.setattr(lrn, "micro_batches", lambda bt: pack_micro_batches(
            [(len(p), len(r)) for p, r in zip(bt.prompt_ids, bt.response_ids)], cfg.micro_token_budget, padded=True))
    mbs, _ = lrn.passes(b)
    total = 0.0
    for loss, _, _ in lrn.micro_losses(b, old, mbs, *lrn.denominators(b)):
        loss.backward(); total += float(loss.detach())
    if undo: monkeypatch.undo()
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("overlong_filter", [False, True])
def test_packed_loss_and_gradient_equal_padded(tiny64, monkeypatch, agg, overlong_filter):
    cfg = DAPOConfig(model="tiny", loss_agg=agg, overlong_filter=overlong_filter, micro_token_budget=40, l_max=64,
                     l_cache=16, clip_c=3.0)
    b = batch()
    g = torch.Generator().manual_seed(1)  # old log-probs near the policy's, so ratios spread on both sides of the clip range
    old = [-3 + 0.3 * torch.randn(len(r), generator=g) for r in b.response_ids]
    lp, gp = grads(tiny64, cfg, b, "packed", monkeypatch, old)
    ld, gd = grads(tiny64, cfg, b, "padded", monkeypatch, old)
    assert abs(lp - ld) <= 1e-10 * max(1.0, abs(ld))
    assert (gp - gd).abs().max() <= 1e-10 * max(1.0, gd.abs().max())


@pytest.mark.parametrize("ckpt,loop_from", [(False, 0), (False, 10), (True, 10), (False, 10**9)])
def test_learner_attends_per_sequence_with_and_without_checkpointing(tiny64, monkeypatch, ckpt, loop_from):
    "The learner's model attends per packed sequence (`varlen_sdpa`: long ones one by one, short ones together); recomputed layers do the same."
    monkeypatch.setattr(L, "VARLEN_LOOP_FROM", loop_from)  # 0: every sequence alone; 10: both kinds; 10**9: all together
    cfg = DAPOConfig(model="tiny", micro_token_budget=40, l_max=64, l_cache=16, gradient_checkpointing=ckpt)
    b, g = batch(2), torch.Generator().manual_seed(3)
    old = [-3 + 0.3 * torch.randn(len(r), generator=g) for r in b.response_ids]
    lp, gp = grads(tiny64, cfg, b, "packed", monkeypatch, old, undo=False)
    ld, gd = grads(tiny64, DAPOConfig(model="tiny", micro_token_budget=40, l_max=64, l_cache=16), b, "padded", monkeypatch, old)
    assert abs(lp - ld) <= 1e-10 * max(1.0, abs(ld)) and (gp - gd).abs().max() <= 1e-10 * max(1.0, gd.abs().max())


def test_varlen_is_the_learners_attention(tiny64):
    lrn = TorchLearner.build(DAPOConfig(model="tiny"), 0, model=__import__("copy").deepcopy(tiny64))
    assert lrn.net.config._attn_implementation == "dapo_varlen"


def test_fused_equals_unfused_on_the_model(tiny64):
    b = batch(1)
    mb = pack(b.prompt_ids, b.response_ids)
    with torch.no_grad():
        a = forward_logprobs(tiny64, mb, 0.7, entropy=True)
        u = forward_logprobs(tiny64, mb, 0.7, entropy=True, fused=False)
    assert (a[0] - u[0]).abs().max() <= 1e-12 and (a[1] - u[1]).abs().max() <= 1e-12


def test_micro_batches_respect_the_budget_and_cover_every_sequence():
    g = torch.Generator().manual_seed(2)
    for trial in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        lens = [(int(torch.randint(1, 50, (1,), generator=g)), int(torch.randint(0, 200, (1,), generator=g))) for _ in range(n)]
        budget = int(torch.randint(20, 400, (1,), generator=g))
        mbs = pack_micro_batches(lens, budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(n))
        assert all(sum(sum(lens[i]) for i in mb) <= budget or len(mb) == 1 for mb in mbs)
        # first-fit decreasing needs at most 11/9 OPT + 1 bins, and OPT >= ceil(total / budget) (of what fits)
        fits = [sum(x) for x in lens if sum(x) <= budget]
        opt_lb = -(-sum(fits) // budget) + sum(1 for x in lens if sum(x) > budget)
        assert len(mbs) <= 11 / 9 * opt_lb + 1 + sum(1 for x in lens if sum(x) > budget)
