"""Rollout correction (nbs/04b_rollout_correction.ipynb): the weights of every mode against a float64 loop written from
the definitions, the gradient they give, the learner's loss and a step's metrics with the correction threaded through
micro-batches, and the config's refusals. The split invariance with the correction on is in test_loss_split.py; a real
engine-learner gap in test_vllm.py (test_gpu_check_cpu): vLLM's CPU build in bfloat16 (vllm_dtype) beside a float32
learner, token_truncate on, responses of at most 24 tokens. Not run: a corrected bfloat16 engine on a GPU, long responses."""

import math

import pytest
import torch

from dapo_ref.core import ROLLOUT_CORRECTIONS, DAPOConfig, InputError
from dapo_ref.cli import config_from_dict
from dapo_ref.interfaces import RolloutBatch
from dapo_ref.loss import policy_loss
from dapo_ref.rollout_correction import batch_weights, rollout_weights

MODES = ROLLOUT_CORRECTIONS[1:]
U = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64 unit roundoff


def loop_weights(old: list[list[float]], eng: list[list[float]], mode: str, C: float) -> list[list[float]]:
    "Reference, per response in Python floats: w_t = exp(old_t - eng_t); W = the product of a row's w_t; then min(., C) or 0 outside [1/C, C]."
    out = []
    for o, e in zip(old, eng):
        w = [math.exp(a - b) for a, b in zip(o, e)]
        W = math.prod(w)
        row = [W] * len(w) if mode.startswith("sequence") else w
        out.append([min(x, C) if mode.endswith("truncate") else (x if 1 / C <= x <= C else 0.0) for x in row])
    return out


def padded(rows: list[list[float]], T: int, dtype=torch.float64) -> torch.Tensor:
    "(B, T) of ragged rows, zero-padded."
    x = torch.zeros(len(rows), T, dtype=dtype)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("C", [1.5, 2.0, 5.0])
def test_weights_match_a_float64_loop(mode, C):
    """Random responses of 1-12 tokens with per-token log gaps of size ~0.8 (so every branch is taken: sequence weights
    spread over e^{+-3}). The loop multiplies probabilities where the code sums logs: both are float64, each product or
    sum of <= 12 terms within 12 u relative, exp/log within 1 ulp; with |log W| <= 12 * 2 the weights agree within
    (12 + 2) * 24 u64 relative, < 1e-13. A value within 1e-9 of a boundary (C or 1/C) could branch differently on the two
    sides; the draws are continuous and such a draw is skipped rather than compared."""
    g = torch.Generator().manual_seed(int(C * 10) + MODES.index(mode))
    lens = torch.randint(1, 13, (40,), generator=g).tolist()
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lens]
    eng = [[o - float(torch.randn(1, generator=g, dtype=torch.float64)) * 0.8 for o in row] for row in old]
    T = max(lens)
    mask = padded([[1.0] * n for n in lens], T).bool()
    w = rollout_weights(padded(old, T), padded(eng, T), mask, mode, C)
    ref = loop_weights(old, eng, mode, C)
    near = lambda x: abs(x - C) < 1e-9 * C or abs(x - 1 / C) < 1e-9
    taken = {"clipped": 0, "kept": 0}
    for i, row in enumerate(ref):
        raw = loop_weights([old[i]], [eng[i]], mode, math.inf)[
            0
        ]  # before truncation / masking (mask: C = inf keeps all)
        for t, x in enumerate(row):
            if near(raw[t]):
                continue
            assert abs(float(w[i, t]) - x) <= 1e-13 * max(x, 1.0), (mode, i, t, float(w[i, t]), x)
            taken["clipped" if x != raw[t] else "kept"] += 1
    assert taken["clipped"] > 0 and taken["kept"] > 0, taken  # both branches were exercised
    assert bool((w[~mask] == 0).all())  # padding: exactly 0


@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_w_times_the_uncorrected_one_token_by_token(mode):
    """d loss_w / d logp_t = w_t d loss / d logp_t: the corrected token loss is w_t times the uncorrected one and w is
    a constant. Both sides are float64 products of the same factors (1/N or a row's share, -A, r, w) in another order:
    <= 4 correctly rounded multiplies each, so within 2 * 4 + 1 = 9 u64 relative, taken as 10 u64. Tokens whose weight
    is 0 (masked) get an exact 0; for every aggregation the same holds, since w enters before it."""
    g = torch.Generator().manual_seed(7)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    eng = old - torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    mask = torch.arange(T)[None, :] < torch.tensor([9, 1, 5, 7, 3, 8])[:, None]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    w = rollout_weights(old, eng, mask, mode, 2.0)
    assert bool((w[mask] == 0).any()) == mode.endswith("mask")  # min(W, C) > 0: truncation never zeroes
    for agg in ("token-mean", "seq-mean-token-mean"):
        logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
        grad = lambda weights: torch.autograd.grad(
            policy_loss(logp, old, adv, mask, clip_c=10.0, agg=agg, weights=weights)[0], logp
        )[0]
        g0, gw = grad(None), grad(w)
        assert bool(((gw - w * g0).abs() <= 10 * U64 * (w * g0).abs()).all()), (mode, agg)
        assert bool((gw[w == 0] == 0).all())


def test_none_and_unit_weights_leave_the_loss_bit_for_bit():
    "weights=None is the uncorrected path; weights of exactly 1 (engine = learner) multiply by 1.0: the same bits."
    g = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    mask, adv = torch.ones(4, 5, dtype=torch.bool), torch.randn(4, generator=g)
    base, m0 = policy_loss(logp, old, adv, mask)
    for mode in MODES:
        same, m1 = policy_loss(logp, old, adv, mask, weights=rollout_weights(old, old, mask, mode))
        assert same.item() == base.item() and m1 == m0


# ---------------------------------------------------------------- through the learner: micro-batches, a step's metrics
@pytest.fixture(scope="module")
def tiny():
    from dapo_ref.policy import load_policy

    torch.set_num_threads(1)
    return load_policy("tiny")


def synthetic_batch(B: int = 16, seed: int = 0) -> RolloutBatch:
    "B responses of 2-14 random token ids after 8-token prompts, random advantages; no engine log-probs yet."
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 15, (B,), generator=g).tolist()
    return RolloutBatch(
        [torch.randint(1, 300, (8,), generator=g).tolist() for _ in range(B)],
        [torch.randint(1, 300, (n,), generator=g).tolist() for n in lens],
        torch.randn(B, generator=g),
        torch.zeros(B, dtype=torch.bool),
        torch.zeros(B),
    )


@pytest.mark.parametrize("mode", MODES)
def test_learner_loss_and_step_metrics_with_the_correction(tiny, mode):
    """The learner threads the engine's log-probs through its micro-batches (a budget of 60 tokens: several, responses
    in another order than the batch's) to the loss. At theta_old every ratio is 1 (up to the two forward passes'
    rounding, `dev`), so the token-mean loss is -sum_{i,t} A_i w_{i,t} / N, computed here in float64 from the loop's
    weights. Bound: each token's loss is off by <= |A_i| w dev plus 3 roundings (exp, two products), and the float32
    sums of N terms and one division add <= (N + 2) u S (Wilkinson), S = sum |A_i| w / N; together
    (N + 5) u S + dev S (1 + 3u). The step's metrics: the mean and max of w over every token, float64 on both sides."""
    import copy
    from dapo_ref.algorithm import train_on
    from dapo_ref.learner import TorchLearner

    model, tok = tiny
    cfg = DAPOConfig(
        rollout_backend="vllm", rollout_correction=mode, micro_token_budget=60, mini_batch_size=16, warmup_steps=0
    )
    learner = TorchLearner(copy.deepcopy(model), cfg, tok.pad_token_id)
    batch = synthetic_batch()
    assert len(learner.micro_batches(batch)) > 3
    old, _ = learner.compute_logprobs(batch)
    g = torch.Generator().manual_seed(1)
    d = [torch.randn(len(o), generator=g, dtype=torch.float64) * 0.5 for o in old]  # per response: log w
    batch.rollout_logp = [(o.double() - x).tolist() for o, x in zip(old, d)]
    ref = loop_weights([o.double().tolist() for o in old], batch.rollout_logp, mode, 2.0)
    N = sum(len(r) for r in ref)
    A = batch.advantages.double().tolist()
    L_star = -sum(a * w for a, row in zip(A, ref) for w in row) / N
    S = sum(abs(a) * w for a, row in zip(A, ref) for w in row) / N
    with torch.no_grad():
        parts = list(learner.micro_losses(batch, old, learner.micro_batches(batch), *learner.denominators(batch)))
    dev = max(max(1 - m["ratio_min"], m["ratio_max"] - 1) for _, m, n in parts if n)
    loss = sum(float(l) for l, _, _ in parts)
    assert abs(loss - L_star) <= (N + 5) * U * S + dev * S * (1 + 3 * U), (loss, L_star, dev)
    updates, stats = train_on(learner, batch, 16)
    tokens = torch.cat(d)
    assert abs(stats["rollout_w_mean"] - float(tokens.exp().mean())) <= 1e-12  # float32 old: the same values both sides
    assert abs(stats["rollout_w_max"] - float(tokens.exp().max())) <= 1e-12
    assert stats["rollout_w_truncated_frac"] == float((tokens > math.log(2)).double().mean())
    assert len(updates) == 1 and updates[0]["skipped"] == 0 and updates[0]["grad_norm"] > 0


def test_a_correction_without_engine_log_probs_is_refused_by_name():
    "An engine handed to the trainer that returns no log-probs: the first micro-batch says which setting and the fix."
    b = synthetic_batch(2)
    with pytest.raises(InputError, match="rollout_correction = token_mask needs the engine's log-probs"):
        batch_weights(
            b,
            torch.zeros(2, 14),
            torch.ones(2, 14),
            DAPOConfig(rollout_backend="vllm", rollout_correction="token_mask"),
        )
    assert batch_weights(b, torch.zeros(2, 14), torch.ones(2, 14), DAPOConfig()) is None  # off: nothing is computed


@pytest.mark.parametrize(
    "over,field,msg",
    [
        (
            dict(rollout_correction="token_truncate"),
            "rollout_correction",
            "set rollout_backend: vllm or rollout_correction: none",
        ),
        (dict(rollout_correction="token_mask", rollout_backend="vllm", top_p=0.7), "top_p", "set top_p: 1.0"),
        (dict(rollout_correction="sequence_mask", rollout_backend="vllm", top_k=50), "top_k", "set top_k: -1"),
        (dict(rollout_correction="token"), "rollout_correction", "one of none, token_truncate"),
        (dict(rollout_correction_threshold=0.5), "rollout_correction_threshold", "rollout_correction_threshold > 1"),
    ],
)
def test_the_config_refuses_what_it_cannot_correct(over, field, msg):
    "One line naming the setting and the fix, when the config is read (before any model loads)."
    with pytest.raises(InputError) as e:
        config_from_dict(over)
    assert e.value.field == field and msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert config_from_dict({**over, "rollout_correction": "none"} if field != "rollout_correction_threshold" else {})
