"""The loss family around DAPO (`nbs/04c_loss_family.ipynb`): Dr. GRPO, GSPO and CISPO.

Each variant's loss and gradient are checked three ways, in float64 on random batches:
- against the paper's formula, written here as plain tensor arithmetic (no function of dapo_ref but the one tested);
- against the code of the two projects that implement it, transcribed line for line from
  verl `verl/trainer/ppo/core_algos.py` at commit b178a3cd56f58b2d502255daba591e92833930a7 (the same lines in tag
  v0.7.0): `compute_grpo_outcome_advantage` with `norm_adv_by_std_in_grpo`, `agg_loss`, `compute_policy_loss_gspo`,
  `compute_policy_loss_cispo`; and TRL `trl/trainer/grpo_trainer.py` at commit
  f2cd57710ae345ea6428ae95363267fcf38a3dc8 (the same lines in tag v1.9.0): the advantage with `scale_rewards`, the
  `importance_sampling_level == "sequence"` weight, and `loss_type` "grpo", "dr_grpo" and "cispo";
- split into micro-batches and ranks with the whole mini-batch's denominators, which must give the whole gradient.
With the defaults, `family_loss` and `scaled_advantages` must be DAPO's own functions, bit for bit (the demo's numbers
do not move), and `DAPOConfig` refuses the combinations no paper defines.
"""

import pytest
import torch

from dapo_ref.advantage import group_advantages
from dapo_ref.core import DAPOConfig, InputError
from dapo_ref.loss import loss_counts, policy_loss
from dapo_ref.loss_family import family_loss, scaled_advantages

D = torch.float64
L_MAX = 7  # the constant of Dr. GRPO's denominator (the config's l_max); every response here is shorter
TOL = 1e-12  # float64, values and gradients of order 1, a few dozen roundings: far below 1e-12 relative


def batch(seed: int, P: int = 3, G: int = 4, scale: float = 0.3):
    "A float64 mini-batch: log-probs (B, T), old log-probs, mask with responses of 1..L_MAX tokens, rewards (B,)."
    g = torch.Generator().manual_seed(seed)
    B = P * G
    old = -torch.rand(B, L_MAX, generator=g, dtype=D) * 3 - 0.05  # (B, T)
    logp = old + torch.randn(B, L_MAX, generator=g, dtype=D) * scale  # (B, T) some ratios far outside any clip
    lens = torch.randint(1, L_MAX + 1, (B,), generator=g)  # (B,)
    mask = torch.arange(L_MAX)[None, :] < lens[:, None]  # (B, T)
    rewards = torch.where(torch.rand(B, generator=g) < 0.5, 1.0, -1.0).to(D)  # (B,)
    rewards[:G] = 1.0  # one all-right group
    return logp, old, mask, rewards, G


def grad_of(loss_fn, logp):
    "loss and d loss / d logp at `logp`."
    x = logp.clone().requires_grad_()
    loss = loss_fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


# ---------------------------------------------------------------- the papers' formulas, written out


def paper_advantage(rewards, G, scale):
    "Eq. 4 and its variants: R minus the group mean, over the group's unbiased std, the batch's, or nothing."
    r = rewards.view(-1, G)
    c = (r - r.mean(1, keepdim=True)).view(-1)
    if scale == "none":  # Dr. GRPO
        return c
    std = rewards.std() if scale == "batch" else r.std(1, keepdim=True).expand_as(r).reshape(-1)
    return c / (std + 1e-6)


def paper_dr_grpo(logp, old, mask, adv, eps_low=0.2, eps_high=0.28):
    "Dr. GRPO: sum over responses and tokens of the clipped surrogate with unscaled A, over B' L_max (a constant)."
    r = torch.exp(logp - old)
    a = adv[:, None]
    obj = torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
    return -(obj * mask).sum() / (mask.any(1).sum() * L_MAX)


def paper_gspo(logp, old, mask, adv, eps_low=3e-4, eps_high=4e-4):
    "GSPO: s_i = (pi / pi_old)^(1/|o_i|), the clipped surrogate per response, a mean over responses."
    n = mask.sum(1)
    s = torch.exp(((logp - old) * mask).sum(1) / n)  # (B,)
    return -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv).mean()


def paper_cispo(logp, old, mask, adv, eps_high=0.2):
    "CISPO: 1/sum|o_i| sum_i sum_t sg[min(r, 1 + eps_high)] A log pi (no lower bound)."
    w = torch.exp(logp - old).clamp(max=1 + eps_high).detach()
    return -(w * adv[:, None] * logp * mask).sum() / mask.sum()


VARIANTS = {  # name: (advantage scaling, family_loss arguments, the paper's loss)
    "dr-grpo": ("none", dict(agg="seq-mean-token-sum-norm", max_len=L_MAX), paper_dr_grpo),
    "gspo": ("group", dict(level="sequence", agg="seq-mean-token-mean"), paper_gspo),
    "cispo": ("group", dict(loss_mode="cispo"), paper_cispo),
}


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("seed", range(4))
def test_matches_the_papers_formula(name, seed):
    logp, old, mask, rewards, G = batch(seed)
    scale, kw, paper = VARIANTS[name]
    adv = scaled_advantages(rewards, G, scale)
    torch.testing.assert_close(adv, paper_advantage(rewards, G, scale), rtol=TOL, atol=TOL)
    ours = grad_of(lambda x: family_loss(x, old, adv, mask, **kw)[0], logp)
    theirs = grad_of(lambda x: paper(x, old, mask, adv), logp)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    assert ours[1].abs().sum() > 0 and (ours[1][~mask] == 0).all()  # a gradient, none on padding


def test_batch_scaling():
    logp, old, mask, rewards, G = batch(0)
    torch.testing.assert_close(
        scaled_advantages(rewards, G, "batch"), paper_advantage(rewards, G, "batch"), rtol=TOL, atol=TOL
    )


# ---------------------------------------------------------------- verl and TRL, transcribed


def verl_grpo_advantage(scores, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    "verl compute_grpo_outcome_advantage (core_algos.py, lines 266-330), its loop over groups."
    scores = scores.clone()
    id2score = {}
    for i in range(len(scores)):
        id2score.setdefault(index[i], []).append(scores[i])
    id2mean, id2std = {}, {}
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(id2score[idx])
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    for i in range(len(scores)):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    "verl agg_loss (lines 1025-1081), one rank (dp_size 1), the batch's own counts."
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).to(loss_mat.dtype)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return torch.sum(seq_losses) / loss_scale_factor
    raise ValueError(loss_agg_mode)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=3e-4, clip_ratio_high=4e-4):
    "verl compute_policy_loss_gspo (lines 1253-1326): the stop-gradient token form, seq-mean-token-mean."
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=10.0, clip_ratio_high=0.2):
    "verl compute_policy_loss_cispo (lines 1721-1779), the example script's bounds (low 10: none; high 0.2)."
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return verl_agg_loss(pg_losses, response_mask, "token-mean")


def trl_loss(per_token_logps, old_per_token_logps, advantages, mask, loss_type, level, eps_low, eps_high):
    "TRL GRPOTrainer._compute_loss (grpo_trainer.py, lines 3054-3150), beta 0, one process, no accumulation."
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * L_MAX)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # dapo, cispo: one process


def trl_advantage(rewards, G, scale_rewards):
    "TRL's advantage (lines 2682-2708): R minus the group mean, over the group's or the batch's std + 1e-4, or not."
    mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
    std = rewards.view(-1, G).std(1).repeat_interleave(G) if scale_rewards == "group" else rewards.std()
    a = rewards - mean
    return a if scale_rewards == "none" else a / (std + 1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_matches_verl(seed):
    logp, old, mask, rewards, G = batch(seed)
    m = mask.to(D)
    index = [i // G for i in range(len(rewards))]
    for norm, scale in ((True, "group"), (False, "none")):  # Dr. GRPO: norm_adv_by_std_in_grpo false
        torch.testing.assert_close(
            scaled_advantages(rewards, G, scale), verl_grpo_advantage(rewards, index, 1e-6, norm), rtol=TOL, atol=TOL
        )
    adv = scaled_advantages(rewards, G)
    gspo = grad_of(lambda x: family_loss(x, old, adv, mask, level="sequence", agg="seq-mean-token-mean")[0], logp)
    # verl's seq-mean-token-mean divides a response's token sum by |o_i| + 1e-8: each response's term (and each
    # gradient entry, which comes from one response) is off by <= 1e-8 relative (|o_i| >= 1); the loss, a mean of
    # terms of either sign, by <= 1e-8 times the largest term, |A| max(s, 1 + 4e-4)
    verl = grad_of(lambda x: verl_gspo(old, x, adv[:, None], m), logp)
    s_i = torch.exp(((logp - old) * m).sum(1) / m.sum(1))  # (B,) GSPO's ratios
    largest = float((adv.abs() * s_i.clamp(min=1 + 4e-4)).max())
    torch.testing.assert_close(gspo[0], verl[0], rtol=TOL, atol=1e-8 * largest + TOL)
    torch.testing.assert_close(gspo[1], verl[1], rtol=1e-8 + TOL, atol=TOL)
    cispo = grad_of(lambda x: family_loss(x, old, adv, mask, loss_mode="cispo")[0], logp)
    torch.testing.assert_close(cispo, grad_of(lambda x: verl_cispo(old, x, adv[:, None], m), logp), rtol=TOL, atol=TOL)
    # Dr. GRPO: verl's seq-mean-token-sum-norm is a sum over L_max (loss_scale_factor); its worker divides by the
    # mini-batch's responses (dynamic batch size), which here all have a loss token: B' = B
    a0 = scaled_advantages(rewards, G, "none")
    kw = dict(eps_low=0.2, eps_high=0.28, agg="seq-mean-token-sum-norm", max_len=L_MAX)
    dr = grad_of(lambda x: family_loss(x, old, a0, mask, **kw)[0], logp)
    clip = lambda x: torch.maximum(
        -a0[:, None] * torch.exp(x - old), -a0[:, None] * torch.exp(x - old).clamp(0.8, 1.28)
    )  # verl's vanilla pg_losses (its dual clip off)
    ref = grad_of(lambda x: verl_agg_loss(clip(x), m, "seq-mean-token-sum-norm", L_MAX) / len(rewards), logp)
    torch.testing.assert_close(dr, ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("seed", range(4))
def test_matches_trl(seed):
    logp, old, mask, rewards, G = batch(seed)
    m = mask.to(D)
    for scale in ("group", "batch", "none"):  # TRL adds 1e-4 to the std where verl (and this project) add 1e-6
        torch.testing.assert_close(
            scaled_advantages(rewards, G, scale, eps=1e-4), trl_advantage(rewards, G, scale), rtol=TOL, atol=TOL
        )
    adv = scaled_advantages(rewards, G)
    a = adv[:, None]
    ours = grad_of(lambda x: family_loss(x, old, adv, mask, level="sequence", agg="seq-mean-token-mean")[0], logp)
    trl = grad_of(lambda x: trl_loss(x, old, a, m, "grpo", "sequence", 3e-4, 4e-4), logp)  # GSPO as TRL's docs set it
    torch.testing.assert_close(ours, trl, rtol=TOL, atol=TOL)
    ours = grad_of(lambda x: family_loss(x, old, adv, mask, loss_mode="cispo", cispo_eps_high=0.2)[0], logp)
    trl = grad_of(lambda x: trl_loss(x, old, a, m, "cispo", "token", 0.2, 1.2), logp)  # TRL caps at epsilon_high itself
    torch.testing.assert_close(ours, trl, rtol=TOL, atol=TOL)
    a0 = scaled_advantages(rewards, G, "none")
    ours = grad_of(lambda x: family_loss(x, old, a0, mask, agg="seq-mean-token-sum-norm", max_len=L_MAX)[0], logp)
    trl = grad_of(lambda x: trl_loss(x, old, a0[:, None], m, "dr_grpo", "token", 0.2, 0.28), logp)
    torch.testing.assert_close(ours, trl, rtol=TOL, atol=TOL)


# ---------------------------------------------------------------- micro-batches and ranks


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("seed", range(3))
def test_split_into_micro_batches_and_ranks(name, seed):
    "Rows over 4 ranks, unevenly (one rank with nothing), each in micro-batches: the sum is the whole gradient."
    logp, old, mask, rewards, G = batch(seed, P=4)
    scale, kw, _ = VARIANTS[name]
    adv = scaled_advantages(rewards, G, scale)
    kw = {k: v for k, v in kw.items() if k != "max_len"}
    agg = kw.get("agg", "token-mean")
    n_tok, n_seq = loss_counts(mask)  # the whole mini-batch's counts, as the learner sums them over ranks
    denoms = dict(num_tokens=n_tok, num_seqs=n_seq, max_len=L_MAX if agg == "seq-mean-token-sum-norm" else None)
    whole = grad_of(lambda x: family_loss(x, old, adv, mask, **kw, **denoms)[0], logp)
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))
    ranks = [perm[:7], perm[7:8], perm[8:8], perm[8:]]  # uneven shares, rank 2 empty
    x = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=D)
    for rows in ranks:
        for mb in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):  # two micro-batches a rank
            if len(mb):
                total = total + family_loss(x[mb], old[mb], adv[mb], mask[mb], **kw, **denoms)[0]
    (g,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total.detach(), whole[0], rtol=TOL, atol=TOL)
    torch.testing.assert_close(g, whole[1], rtol=TOL, atol=TOL)


# ---------------------------------------------------------------- the defaults are DAPO


def test_defaults_are_dapo_bit_for_bit():
    logp, old, mask, rewards, G = batch(5)
    logp, old = logp.float(), old.float()
    adv = scaled_advantages(rewards.float(), G)
    assert torch.equal(adv, group_advantages(rewards.float(), G))
    kw = dict(eps_low=0.2, eps_high=0.28, clip_c=10.0, agg="token-mean")
    a, ma = family_loss(logp.clone().requires_grad_(), old, adv, mask, **kw)
    b, mb = policy_loss(logp.clone().requires_grad_(), old, adv, mask, **kw)
    assert torch.equal(a, b) and ma == mb
    cfg = DAPOConfig()
    assert (cfg.scale_rewards, cfg.importance_sampling_level, cfg.loss_mode) == ("group", "token", "vanilla")


def test_variants_differ_where_their_papers_say():
    "CISPO keeps a gradient on up-clipped tokens, DAPO gives them none; GSPO clips whole responses."
    logp, old, mask, rewards, G = batch(1, scale=1.0)
    adv = scaled_advantages(rewards, G)
    up = mask & (adv[:, None] > 0) & (torch.exp(logp - old) > 1.28)  # (B, T) up-clipped under Eq. 8
    assert up.any()
    dapo = grad_of(lambda x: family_loss(x, old, adv, mask)[0], logp)[1]
    cispo = grad_of(lambda x: family_loss(x, old, adv, mask, loss_mode="cispo")[0], logp)[1]
    assert (dapo[up] == 0).all() and (cispo[up] != 0).all()
    gspo = grad_of(lambda x: family_loss(x, old, adv, mask, level="sequence", agg="seq-mean-token-mean")[0], logp)[1]
    rows_zero = (gspo == 0).all(1)  # a clipped response: all of its tokens silent, or none
    assert ((gspo[~rows_zero] != 0) == mask[~rows_zero]).all()


# ---------------------------------------------------------------- what the config refuses


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(importance_sampling_level="sequence"), ["importance_sampling_level = sequence", "loss_agg"]),
        (
            dict(importance_sampling_level="sequence", loss_agg="seq-mean-token-mean"),
            ["importance_sampling_level = sequence", "clip_c", "clip_c: null"],
        ),
        (dict(loss_mode="cispo"), ["loss_mode = cispo", "clip_c", "clip_c: null"]),
        (
            dict(loss_mode="cispo", importance_sampling_level="sequence", loss_agg="seq-mean-token-mean", clip_c=None),
            ["importance_sampling_level = sequence", "loss_mode = cispo"],
        ),
        (dict(scale_rewards="std"), ["scale_rewards", "group, batch, none"]),
        (dict(seq_eps_low=1.5), ["seq_eps_low"]),
    ],
)
def test_refused_in_one_line(kw, words):
    with pytest.raises(InputError) as e:
        DAPOConfig(**kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_defined_combinations_load():
    DAPOConfig(importance_sampling_level="sequence", loss_agg="seq-mean-token-mean", clip_c=None)
    DAPOConfig(loss_mode="cispo", clip_c=None)
    DAPOConfig(scale_rewards="none", loss_agg="seq-mean-token-sum-norm")


# ---------------------------------------------------------------- in the trainer


@pytest.mark.parametrize(
    "variant",
    [
        dict(scale_rewards="none", loss_agg="seq-mean-token-sum-norm"),  # Dr. GRPO
        dict(importance_sampling_level="sequence", loss_agg="seq-mean-token-mean", clip_c=None),  # GSPO
        dict(loss_mode="cispo", clip_c=None),  # CISPO
    ],
    ids=["dr-grpo", "gspo", "cispo"],
)
def test_one_learner_update_per_variant(tmp_path, variant):
    "Line 9 and line 11 of a real round on the tiny model, with each variant's fields: advantages and one update."
    from pathlib import Path
    from dapo_ref.algorithm import collect, make_batch
    from dapo_ref.cli import load_config
    from dapo_ref.trainer import Trainer

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
    base = dict(total_steps=1, eval_every=0, save_every=0, eval_k=1, output_dir=str(tmp_path / "run"), warmup_steps=0)
    cfg = load_config(recipe, {**base, **variant})
    torch.manual_seed(0)
    tr = Trainer(cfg, progress=False, log=None)
    groups, _, _ = collect(tr.rollout, tr.sampler, cfg, 1)
    b = make_batch(groups, cfg.group_size, cfg.scale_rewards)
    rewards = torch.tensor([r for g in groups for r in g.rewards])
    torch.testing.assert_close(b.advantages, scaled_advantages(rewards, cfg.group_size, cfg.scale_rewards))
    old, _ = tr.learner.compute_logprobs(b)
    m = tr.learner.update(b, old)
    assert m["skipped"] == 0 and m["grad_norm"] > 0
    # the update's loss is taken at theta_old: every ratio is 1 up to the forward passes' rounding (dev), so it is the
    # variant's objective at r = 1, computed here from the batch alone; within dev and float32 summation of N terms
    A = b.advantages.double()  # (B,)
    n = torch.tensor([len(r) for r in b.response_ids], dtype=torch.float64)  # (B,) loss tokens (no filter here)
    logp_old = [o.double() for o in old]
    at_one = {
        "dr-grpo": -(A * n).sum() / (len(n) * cfg.l_max),
        "gspo": -A.mean(),
        "cispo": -sum(a * lp.sum() for a, lp in zip(A, logp_old)) / n.sum(),
    }[cfg_name(variant)]
    scale = {"dr-grpo": (A.abs() * n).sum() / (len(n) * cfg.l_max), "gspo": A.abs().mean()}.get(
        cfg_name(variant), sum(a.abs() * lp.abs().sum() for a, lp in zip(A, logp_old)) / n.sum()
    )
    dev = max(1 - m["ratio_min"], m["ratio_max"] - 1)
    assert abs(m["loss"] - float(at_one)) <= (dev + n.sum().item() * 2**-24) * float(scale), (m["loss"], at_one)
    dapo = -(A * n).sum() / n.sum()  # DAPO's objective at r = 1: what the learner would give if it ignored the fields
    assert abs(float(dapo) - float(at_one)) > 10 * (dev + n.sum().item() * 2**-24) * float(scale)
    tr.close()


def cfg_name(variant: dict) -> str:
    return "gspo" if "importance_sampling_level" in variant else "cispo" if "loss_mode" in variant else "dr-grpo"
