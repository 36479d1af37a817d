"""Packed micro-batches (`packing.pack`) and the fused log-prob give what the padded layout (`packing.collate`) gives.

Float64 throughout, so the only differences are rounding (about 1e-16 relative): the padded layout computes attention
over padding it masks and its logits whole, the packed one attends within each sequence and never forms the logits.
"""

import pytest
import torch

from dapo_ref import learner as L
from dapo_ref import packing as packing_mod
from dapo_ref.core import LOSS_AGGS, DAPOConfig
from dapo_ref.learner import TorchLearner
from dapo_ref.interfaces import RolloutBatch
from dapo_ref.packing import collate, forward_logprobs, pack, pack_micro_batches
from dapo_ref.tiny_ship import ensure_tiny_model


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
        monkeypatch.setattr(
            lrn,
            "micro_batches",
            lambda bt: pack_micro_batches(
                [(len(p), len(r)) for p, r in zip(bt.prompt_ids, bt.response_ids)], cfg.micro_token_budget, padded=True
            ),
        )
    mbs, _ = lrn.passes(b)
    total = 0.0
    for loss, _, _ in lrn.micro_losses(b, old, mbs, *lrn.denominators(b)):
        loss.backward()
        total += float(loss.detach())
    if undo:
        monkeypatch.undo()
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("overlong_filter", [False, True])
def test_packed_loss_and_gradient_equal_padded(tiny64, monkeypatch, agg, overlong_filter):
    cfg = DAPOConfig(
        model="tiny",
        loss_agg=agg,
        overlong_filter=overlong_filter,
        micro_token_budget=40,
        l_max=64,
        l_cache=16,
        clip_c=3.0,
    )
    b = batch()
    g = torch.Generator().manual_seed(
        1
    )  # old log-probs near the policy's, so ratios spread on both sides of the clip range
    old = [-3 + 0.3 * torch.randn(len(r), generator=g) for r in b.response_ids]
    lp, gp = grads(tiny64, cfg, b, "packed", monkeypatch, old)
    ld, gd = grads(tiny64, cfg, b, "padded", monkeypatch, old)
    assert abs(lp - ld) <= 1e-10 * max(1.0, abs(ld))
    assert (gp - gd).abs().max() <= 1e-10 * max(1.0, gd.abs().max())


@pytest.mark.parametrize("ckpt,loop_from", [(False, 0), (False, 10), (True, 10), (False, 10**9)])
def test_learner_attends_per_sequence_with_and_without_checkpointing(tiny64, monkeypatch, ckpt, loop_from):
    "The learner's model attends per packed sequence (`varlen_sdpa`: long ones one by one, short ones together); recomputed layers do the same."
    monkeypatch.setattr(
        packing_mod, "VARLEN_LOOP_FROM", loop_from
    )  # 0: every sequence alone; 10: both kinds; 10**9: all together
    cfg = DAPOConfig(model="tiny", micro_token_budget=40, l_max=64, l_cache=16, gradient_checkpointing=ckpt)
    b, g = batch(2), torch.Generator().manual_seed(3)
    old = [-3 + 0.3 * torch.randn(len(r), generator=g) for r in b.response_ids]
    lp, gp = grads(tiny64, cfg, b, "packed", monkeypatch, old, undo=False)
    ld, gd = grads(
        tiny64, DAPOConfig(model="tiny", micro_token_budget=40, l_max=64, l_cache=16), b, "padded", monkeypatch, old
    )
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
        lens = [
            (int(torch.randint(1, 50, (1,), generator=g)), int(torch.randint(0, 200, (1,), generator=g)))
            for _ in range(n)
        ]
        budget = int(torch.randint(20, 400, (1,), generator=g))
        mbs = pack_micro_batches(lens, budget)
        assert sorted(i for mb in mbs for i in mb) == list(range(n))
        assert all(sum(sum(lens[i]) for i in mb) <= budget or len(mb) == 1 for mb in mbs)
        # first-fit decreasing needs at most 11/9 OPT + 1 bins, and OPT >= ceil(total / budget) (of what fits)
        fits = [sum(x) for x in lens if sum(x) <= budget]
        opt_lb = -(-sum(fits) // budget) + sum(1 for x in lens if sum(x) > budget)
        assert len(mbs) <= 11 / 9 * opt_lb + 1 + sum(1 for x in lens if sum(x) > budget)


def flash_varlen_stand_in(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """`flash_attn.flash_attn_varlen_func` as its contract reads (flash-attn 2, csrc/flash_attn/flash_api.cpp, mha_varlen_fwd:
    `cu_seqlens_q must have dtype int32`; max_seqlen an int; q (total, heads, d), k/v (total, kv_heads, d)), computed with
    torch's sdpa one sequence at a time: what transformers' flash_attention_2 path hands the kernel, checked on a CPU."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
    if not (isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)):
        raise TypeError("max_seqlen must be an int")
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and dropout_p == 0.0 and q.dim() == 3
    rep, out, cu = q.shape[1] // k.shape[1], torch.empty_like(q), cu_seqlens_q.tolist()
    assert max_seqlen_q == max(e - s for s, e in zip(cu[:-1], cu[1:]))
    for s, e in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (
            q[s:e].transpose(0, 1),
            k[s:e].repeat_interleave(rep, 1).transpose(0, 1),
            v[s:e].repeat_interleave(rep, 1).transpose(0, 1),
        )
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=softmax_scale
        ).transpose(0, 1)
    return out


@pytest.fixture
def flash_stand_in(monkeypatch):
    "transformers' flash_attention_2 path with `flash_varlen_stand_in` as its loaded kernel (flash-attn itself needs CUDA)."
    import transformers.modeling_flash_attention_utils as fau

    monkeypatch.setattr(fau, "_loaded_implementation", "flash_attention_2")
    monkeypatch.setattr(fau, "_flash_varlen_fn", flash_varlen_stand_in)
    monkeypatch.setattr(fau, "_process_flash_kwargs_fn", fau._lazy_define_process_function(flash_varlen_stand_in))


def cfg_with(impl: str) -> DAPOConfig:
    """A config whose learner uses `impl`. Flash kernels need bf16, which `DAPOConfig` enforces; these tests run the flash
    path in float32/float64 on CPU through a stand-in kernel, so the field is set after validation."""
    cfg = DAPOConfig(model="tiny")
    cfg.attn_implementation = impl
    return cfg


def learner_net(tiny64, impl):
    "The learner's model on attention `impl` (set on the config directly: transformers' setter asks for the flash-attn package)."
    model = __import__("copy").deepcopy(tiny64)
    model.config._attn_implementation = impl
    lrn = TorchLearner.build(cfg_with(impl), 0, model=model)
    return lrn.net


def test_flash_attention_path_gets_int32_offsets_and_equals_padded(tiny64, flash_stand_in):
    """The learner on flash_attention_2 (the GPU recipes' kernel): the offsets reach the kernel as int32 (they were int64,
    which flash-attn refuses), and a packed micro-batch's log-probs and gradient equal the padded sdpa reference in float64."""
    net, ref = learner_net(tiny64, "flash_attention_2"), __import__("copy").deepcopy(tiny64)
    assert net.config._attn_implementation == "flash_attention_2"  # the learner keeps a kernel that packs itself
    b = batch(3)
    lp = forward_logprobs(net, pack(b.prompt_ids, b.response_ids), 0.9)[0]
    lr = forward_logprobs(ref, collate(b.prompt_ids, b.response_ids, pad_id=0), 0.9)[0]
    m = collate(b.prompt_ids, b.response_ids, pad_id=0)["response_mask"]
    lp[m].sum().backward()
    lr[m].sum().backward()
    gp = torch.cat([p.grad.flatten() for p in net.parameters()])
    gr = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert (lp - lr)[m].abs().max() <= 1e-10 and (gp - gr).abs().max() <= 1e-10 * max(1.0, gr.abs().max())


@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2", "eager"])
def test_a_packed_sequence_sees_only_itself(tiny64, flash_stand_in, impl):
    """Every attention kernel the config offers keeps a packed row's sequences apart: changing one sequence's tokens leaves
    the others' log-probs bit-identical (attention across the boundary would move them). Eager is checked this way, not
    against the padded reference: transformers runs its softmax in float32."""
    net = learner_net(tiny64, impl)
    b = batch(4, n=4)
    other = [list(r) for r in b.response_ids]
    other[1] = [(t + 7) % 60 + 3 for t in other[1]]  # sequence 1's response changed
    prompts = [list(p) for p in b.prompt_ids]
    prompts[1] = [(t + 11) % 60 + 3 for t in prompts[1]]  # and its prompt
    with torch.no_grad():
        a = forward_logprobs(net, pack(b.prompt_ids, b.response_ids), 0.9)[0]
        c = forward_logprobs(net, pack(prompts, other), 0.9)[0]
    keep = [0, 2, 3]
    assert torch.equal(a[keep], c[keep]) and not torch.equal(a[1], c[1])


def test_the_config_chooses_the_learners_attention():
    "`attn_implementation` reaches the model the learner loads (sdpa becomes the packed `varlen_sdpa`; eager stays eager)."
    for impl, used in (("sdpa", "dapo_varlen"), ("eager", "eager")):
        lrn = TorchLearner.build(cfg_with(impl), 0)
        assert lrn.net.config._attn_implementation == used, (impl, lrn.net.config._attn_implementation)
