"""Property tests for dapo_ref.loss (beyond the lesson in nbs/04_loss.ipynb) and for dapo_ref.logprobs' token_logprobs and
token_entropy (nbs/08_logprobs.ipynb).

References are float64 python loops written from the case analysis of the clipped objective
(A >= 0: objective A*min(r, 1+eps_high); A < 0: A*min(max(r, 1-eps_low), c)), not from the
vectorised code.
"""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from dapo_ref.core import LOSS_AGGS
from dapo_ref.logprobs import token_entropy, token_logprobs
from dapo_ref.loss import agg_loss, clipped_token_loss, overlong_filter, policy_loss

SETTINGS = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U32, U64 = 2.0**-24, 2.0**-53  # unit roundoff of float32 / float64


def agg_tol(mask, scale: float, u: float = U64) -> float:
    """Bound on |vectorised loss - loop loss| for a (B, T) batch, both in a format with unit roundoff u: per token,
    exp (<= 1 ulp = 2u each side) and one multiply (u); the aggregation sums <= B*T terms and divides <= 2 times,
    <= (B*T + 2) u scale per side (Wilkinson), scale = the same aggregation of |token loss| (no cancellation).
    Both sides: 2 (B*T + 5) u scale (as tests/test_loss_split.py derives for float32)."""
    B, T = mask.shape
    return 2 * (B * T + 5) * u * scale


@st.composite
def batches(draw, min_b=1, max_b=6, max_t=8, per_token_adv=None):
    "A random (logp, old_logp, adv, mask) float64 batch; lengths 0..T per row, some rows possibly empty."
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.01  # log probs in (-4, 0)
    delta = torch.randn(B, T, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.05, 0.3, 1.5]))
    logp = old + delta
    lens = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    mask = torch.arange(T)[None, :] < lens[:, None]  # (B, T) bool
    if per_token_adv is None:
        per_token_adv = draw(st.booleans())
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def loop_losses(logp, old, adv, mask, eps_low, eps_high, clip_c):
    "Per-token loss as nested python lists (None at padding), float64."
    out = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            if not mask[i][t]:
                row.append(None)
                continue
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            r = math.exp(logp[i][t] - old[i][t])
            if a >= 0:
                obj = a * min(r, 1 + eps_high)
            else:
                b = max(r, 1 - eps_low)
                if clip_c is not None:
                    b = min(b, clip_c)
                obj = a * b
            row.append(-obj)
        out.append(row)
    return out


def loop_agg(rows, agg, T):
    "Aggregate per-token python losses by `agg`; rows without a loss token are not sequences of any mean."
    toks = [x for r in rows for x in r if x is not None]
    if agg == "token-mean":
        return sum(toks) / max(len(toks), 1)
    if agg == "seq-mean-token-mean":
        means = [sum(x for x in r if x is not None) / n for r in rows if (n := sum(x is not None for x in r))]
        return sum(means) / len(means) if means else 0.0
    sums = [sum(x for x in r if x is not None) for r in rows if any(x is not None for x in r)]  # rows with a token
    if agg == "seq-mean-token-sum":
        return sum(sums) / max(len(sums), 1)
    return sum(sums) / (max(len(sums), 1) * T)


@settings(**SETTINGS)
@given(
    batches(),
    st.sampled_from(LOSS_AGGS),
    st.sampled_from([None, 3.0, 10.0]),
    st.sampled_from([(0.2, 0.28), (0.2, 0.2), (0.1, 0.5)]),
)
def test_policy_loss_matches_python_loop(batch, agg, clip_c, eps):
    logp, old, adv, mask = batch
    loss, m = policy_loss(logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1], clip_c=clip_c, agg=agg)
    rows = loop_losses(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps[0], eps[1], clip_c)
    scale = loop_agg([[None if x is None else abs(x) for x in r] for r in rows], agg, mask.shape[1])
    assert abs(loss.item() - loop_agg(rows, agg, mask.shape[1])) <= agg_tol(mask, scale)
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


@settings(**SETTINGS)
@given(batches(min_b=2, max_b=8), st.data())
def test_micro_batches_with_num_tokens_equal_full_batch_gradient(batch, data):
    logp, old, adv, mask = batch
    B = len(mask)
    perm = data.draw(st.permutations(range(B)))
    cuts = sorted(data.draw(st.sets(st.integers(1, B - 1), max_size=B - 1)))
    splits = [perm[a:b] for a, b in zip([0] + cuts, cuts + [B])]
    full = logp.clone().requires_grad_()
    policy_loss(full, old, adv, mask, clip_c=10.0)[0].backward()
    acc = logp.clone().requires_grad_()
    n = int(mask.sum())
    total = 0.0
    for rows in splits:
        l, _ = policy_loss(acc[rows], old[rows], adv[rows], mask[rows], clip_c=10.0, num_tokens=n)
        l.backward()
        total += l.item()
    r = (logp - old).exp()
    scale = agg_loss(clipped_token_loss(r, adv if adv.dim() == 2 else adv[:, None], 0.2, 0.28, 10.0).abs(), mask).item()
    assert abs(total - policy_loss(logp, old, adv, mask, clip_c=10.0)[0].item()) <= agg_tol(mask, scale)
    # each gradient entry is one token's closed-form derivative by the same ops on both sides: <= 10 u |g| (derived in
    # tests/test_loss_split.py: exp's value <= 2 ulp apart, <= 3 more roundings per side)
    assert bool(((acc.grad - full.grad).abs() <= 10 * U64 * full.grad.abs()).all())


def test_per_micro_token_mean_weighted_by_sequences_is_not_token_mean():
    # unequal token counts per micro-batch: 1+1 = 2 tokens vs 6+6 = 12 tokens
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    logp = old + 0.05 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1] * 6, [1] * 6]).bool()
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
    full = logp.clone().requires_grad_()
    policy_loss(full, old, adv, mask)[0].backward()
    verl = logp.clone().requires_grad_()
    fixed = logp.clone().requires_grad_()
    for rows in ([0, 1], [2, 3]):
        (policy_loss(verl[rows], old[rows], adv[rows], mask[rows])[0] * (len(rows) / 4)).backward()
        policy_loss(fixed[rows], old[rows], adv[rows], mask[rows], num_tokens=int(mask.sum()))[0].backward()
    rel = lambda g: ((g - full.grad).norm() / full.grad.norm()).item()
    assert rel(fixed.grad) <= 10 * U64  # elementwise <= 10 u |g| (see above), so normwise too
    assert rel(verl.grad) > 0.1  # a discrimination on this fixed batch: token weights 1/4 vs 1/14 (below)
    # token (0, 0): full batch weight 1/14; per-micro x seq share: 1/2 * 1/2 = 1/4. Python's exp and torch's are each
    # within 1 ulp (2u), then <= 3 roundings per side: rel 10 u
    r00 = math.exp(logp[0, 0] - old[0, 0])
    assert full.grad[0, 0].item() == pytest.approx(-1.0 * r00 / 14, rel=10 * U64)
    assert verl.grad[0, 0].item() == pytest.approx(-1.0 * r00 / 4, rel=10 * U64)


@settings(**SETTINGS)
@given(batches(), st.floats(0.01, 0.5), st.sampled_from(LOSS_AGGS))
def test_symmetric_eps_without_dual_clip_is_ppo(batch, eps, agg):
    logp, old, adv, mask = batch
    loss, _ = policy_loss(logp, old, adv, mask, eps_low=eps, eps_high=eps, clip_c=None, agg=agg)
    r = (logp - old).exp()
    a = adv if adv.dim() == 2 else adv[:, None]
    ppo_tok = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)  # Eq. 1, negated
    assert abs(loss.item() - agg_loss(ppo_tok, mask, agg).item()) <= agg_tol(
        mask, agg_loss(ppo_tok.abs(), mask, agg).item()
    )


@settings(**SETTINGS)
@given(batches(), st.floats(1.01, 20.0), st.sampled_from(LOSS_AGGS))
def test_dual_clip_never_increases_loss(batch, c, agg):
    logp, old, adv, mask = batch
    r = (logp - old).exp()
    a = adv if adv.dim() == 2 else adv[:, None]
    with_c, without = clipped_token_loss(r, a, 0.2, 0.28, c), clipped_token_loss(r, a, 0.2, 0.28, None)
    assert bool((with_c <= without).all())
    assert bool((with_c[a.expand_as(r) >= 0] == without[a.expand_as(r) >= 0]).all())  # A >= 0 untouched
    l_c = policy_loss(logp, old, adv, mask, clip_c=c, agg=agg)[0].item()
    l_0 = policy_loss(logp, old, adv, mask, clip_c=None, agg=agg)[0].item()
    # token by token with_c <= without (checked above); the aggregation is monotone up to its rounding, agg_tol
    assert l_c <= l_0 + agg_tol(mask, agg_loss(without.abs(), mask, agg).item())


@settings(**SETTINGS)
@given(
    batches(),
    st.sampled_from(LOSS_AGGS),
    st.sampled_from([None, 10.0]),
    st.sampled_from([0.0, 1e6, -1e6, float("inf"), float("nan")]),
)
def test_masked_tokens_get_exactly_zero_gradient(batch, agg, clip_c, junk):
    logp, old, adv, mask = batch
    logp = logp.where(mask, torch.tensor(junk, dtype=torch.float64)).requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask, clip_c=clip_c, agg=agg)
    loss.backward()
    assert math.isfinite(loss.item())
    assert bool((logp.grad[~mask] == 0).all())
    assert bool(torch.isfinite(logp.grad).all())
    assert all(math.isfinite(v) for v in metrics.values())


@settings(**SETTINGS)
@given(batches())
def test_metrics_match_loop(batch):
    logp, old, adv, mask = batch
    _, m = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_c=3.0)
    L, O, M = logp.tolist(), old.tolist(), mask.tolist()
    A = adv.tolist()
    up, low, dual, kl, ratios, up_p, probs = 0, 0, 0, 0.0, [], [], []
    for i in range(len(M)):
        for t in range(len(M[i])):
            if not M[i][t]:
                continue
            a = A[i][t] if isinstance(A[i], list) else A[i]
            r = math.exp(L[i][t] - O[i][t])
            ratios.append(r)
            kl += O[i][t] - L[i][t]
            probs.append(math.exp(L[i][t]))
            if a > 0 and r > 1.28:
                up += 1
                up_p.append(math.exp(O[i][t]))
            if a < 0 and r < 0.8:
                low += 1
            if a < 0 and r > 3.0:
                dual += 1
    n = len(ratios)
    # clip fractions: an exact integer sum divided once in float64 on both sides, so equal. The others are float64
    # means of n terms summed in another order, plus exp (torch vs math, each <= 1 ulp): <= (n + 4) u64 times the mean
    # of |terms| (Wilkinson); min/max of exps: 4 u64 relative
    if n == 0:
        assert m["clipfrac_high"] == m["clipfrac_low"] == m["approx_kl"] == 0.0 and m["ratio_min"] == 1.0
        return
    exp = dict(
        clipfrac_high=up / n,
        clipfrac_low=low / n,
        clipfrac_dual=dual / n,
        approx_kl=kl / n,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        up_clipped_prob=sum(up_p) / len(up_p) if up_p else 0.0,
        up_clipped_prob_max=max(up_p, default=0.0),
        prob_mean=sum(probs) / n,
    )
    mag = dict(
        approx_kl=sum(abs(o - l) for r_o, r_l, r_m in zip(O, L, M) for o, l, mm in zip(r_o, r_l, r_m) if mm) / n,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        up_clipped_prob=exp["up_clipped_prob"],
        up_clipped_prob_max=exp["up_clipped_prob_max"],
        prob_mean=exp["prob_mean"],
    )
    for k, v in exp.items():
        if k.startswith("clipfrac"):
            assert m[k] == v, k
        else:
            assert abs(m[k] - v) <= (n + 4) * U64 * mag[k], k


@settings(**SETTINGS)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(2, 40),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.3, 3.0, 30.0]),
    st.sampled_from([None, 1, 3]),
)
def test_token_entropy_matches_float64_reference(B, T, V, seed, scale, chunk):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g) * scale
    H = token_entropy(z, chunk_rows=chunk)
    ref = torch.tensor(
        [
            [-sum(p * math.log(p) for p in torch.softmax(z[b, t].double(), -1).tolist() if p > 0) for t in range(T)]
            for b in range(B)
        ],
        dtype=torch.float64,
    )
    assert H.shape == (B, T) and H.dtype == torch.float32
    # Derived per position, first order in u = 2^-24 (same float32 inputs on both sides; the float64 reference's error is
    # ~1e-9 of this). zs = z - max z (error <= u |zs|), lse = logsumexp(zs) in [0, log V], E = E_p[-zs] = H - lse:
    #   lse: input errors move it by <= u E_p|zs|; exp (2u), a sum of V terms (V u), log and the add: <= (V + 3) u + u lse
    #   E_p[zs]: p's relative error <= (V + 4) u + u |zs_i| (+ the same from lse), the einsum sum <= V u E_p|zs|:
    #            <= (2 V + 6) u E + u E_p[zs^2]
    #   the subtraction: u H.
    # |dH| <= u [(V + 3) + lse + (2 V + 7) E + E_p[zs^2] + H]  (e.g. V = 40, scale 30: a few 1e-6)
    zs = z.double() - z.double().amax(-1, keepdim=True)
    p = torch.softmax(zs, -1)
    lse, E, E2 = torch.logsumexp(zs, -1), -(p * zs).sum(-1), (p * zs * zs).sum(-1)
    tol = U32 * ((V + 3) + lse + (2 * V + 7) * E + E2 + ref)
    assert bool(((H.double() - ref).abs() <= tol).all()), ((H.double() - ref).abs() / tol).max()


@settings(**SETTINGS)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(2, 40),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.5, 1.0, 1.7]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_token_logprobs_matches_log_softmax_gather(B, T, V, seed, tau, dtype):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, T, V, generator=g) * 4).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    ref = torch.log_softmax(z.double() / tau, -1).gather(-1, labels[..., None])[..., 0]
    lp = token_logprobs(z, labels, tau)
    assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Derived per position, first order in u (float32, or float64 for float64 logits; bfloat16 logits are cast to
    # float32 exactly, and the reference sees the same values). y = z / tau: <= u M, M = max |y| of the row.
    # picked y_l: <= u M. logsumexp(y) = m + log sum exp(y - m): input errors <= u M; y - m <= 2 u M; exp 2u; the sum of
    # V terms V u; log u log V; + m: u (M + log V). The final subtraction: u |lp|.
    # |d lp| <= u [6 M + V + 2 + 3 log V + |lp|]
    u = U64 if dtype == torch.float64 else U32
    M = (z.double() / tau).abs().amax(-1)
    tol = u * (6 * M + V + 2 + 3 * math.log(V) + ref.abs())
    assert bool(((lp.double() - ref).abs() <= tol).all()), ((lp.double() - ref).abs() / tol).max()


def test_token_logprobs_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 3), generator=g)
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    (token_logprobs(a, labels, 0.8) * torch.arange(6.0, dtype=torch.float64).view(2, 3)).sum().backward()
    (
        torch.log_softmax(b / 0.8, -1).gather(-1, labels[..., None])[..., 0]
        * torch.arange(6.0, dtype=torch.float64).view(2, 3)
    ).sum().backward()
    # float64: d/dz = w / tau (onehot - p); p's relative error <= (V + 4) u + u max|z / tau| (<= 2 u ... 8 u here), so
    # |d grad| <= (w / tau)(V + 13) u64 with w <= 5, tau = 0.8, V = 11: 6.25 * 24 u64 = 1.7e-14
    assert torch.allclose(a.grad, b.grad, rtol=0, atol=5 / 0.8 * (11 + 13) * U64)


def test_errors_name_the_problem():
    x = torch.zeros(2, 3)
    with pytest.raises(  # the caller's contract (a recipe's loss_agg is validated by DAPOConfig)
        AssertionError,
        match=r"agg = 'mean' is not a loss aggregation; allowed values: token-mean, "
        r"seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm",
    ):
        policy_loss(x, x, torch.zeros(2), x, agg="mean")
    with pytest.raises(AssertionError, match="clip_c = 0.5 must be > 1"):
        policy_loss(x, x, torch.zeros(2), x, clip_c=0.5)
    with pytest.raises(ValueError, match=r"truncated must be \(B,\)"):
        overlong_filter(x, torch.zeros(3, dtype=torch.bool))


def test_overlong_filter_zeroes_truncated_rows_only():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = overlong_filter(mask, torch.tensor([True, False, True]))
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(mask[1], out[1]) and out.dtype == mask.dtype
