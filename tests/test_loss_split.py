"""A mini-batch's loss and gradient do not depend on how it is split into micro-batches and ranks.

Property test for the global denominators of `agg_loss` / `policy_loss`: for every aggregation mode, with
and without overlong filtering (rows, and whole micro-batches, with no loss tokens), any split of a
mini-batch into micro-batches spread over 1 or 2 ranks gives the full-batch loss and gradient within
float32 rounding. Ranks are simulated in one process, as data parallelism works: every rank holds its own
copy of the weights (here: its own leaf tensor of log-probs), backpropagates the sum of its micro-batch
losses into it, and the ranks' gradients are summed (an all-reduce SUM; a framework that averages over
ranks must multiply the loss by the world size once). Each micro-batch is cut to its own padded length
plus random extra padding, as a collate function does, so a padding-dependent normaliser would show.
"""

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dapo_ref.core import LOSS_AGGS, ROLLOUT_CORRECTIONS
from dapo_ref.loss import agg_loss, clipped_token_loss, loss_counts, overlong_filter, policy_loss
from dapo_ref.rollout_correction import rollout_weights

SETTINGS = dict(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U = 2.0**-24  # float32 unit roundoff u: a correctly rounded float32 op has relative error <= u


def loss_tol(B: int, T: int) -> float:
    """Bound on |split loss - full loss| / scale (scale = the same aggregation of |token loss|), derived:
    both sides compute log_ratio = logp - old with the same correctly rounded subtraction, so they differ only by
    (a) exp (vectorised Sleef vs scalar std::exp by position, each within 1 ulp <= 2u) and the multiply by -A (u):
        <= 3u relative per token on each side;
    (b) the float32 reductions: every agg mode sums <= B*T terms in total (row sums of <= T, then <= B rows) and
        divides at most twice, so each side's summation error is <= (B*T + 2) u * scale (Wilkinson, gamma_n ~ n u).
    The micro-batch losses are added in float64 (error ~ n_micro * 2**-53, below 1 u). Both sides together:
    2 * (B*T + 5) u * scale, at most 2 * (8*7 + 5) u = 122 u = 7.3e-6 (the old fixed 1e-5 = 168 u was not derived;
    measured over 2000 examples: <= 3.6 u)."""
    return 2 * (B * T + 5) * U + U


# Gradient, elementwise: each entry is one token's closed-form derivative, computed by the same ops on both sides
# (1/denominator, times -A, times r in exp's backward), and the other ranks add exact zeros. The sides can differ
# only through exp's value (<= 2 ulp apart = 4u relative) and the <= 3 correctly rounded multiplies/divides after
# it on each side (<= u each): |dg_i| <= (4 + 2*3) u |g_i| = 10 u |g_i|. (Measured: bit-identical in all 2000
# examples.) A token whose ratio sits within 2 ulp of a clip boundary could take the other branch; with ratios
# drawn from a continuous distribution that has probability ~1e-7 per token and is ignored.
GRAD_TOL = 10 * U


@st.composite
def mini_batches(draw):
    "A float32 mini-batch (logp, old_logp, adv, mask) and its truncation flags; some rows may have no tokens."
    B = draw(st.integers(1, 8))
    T = draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(B, T, generator=g) * 4 - 0.01  # (B, T) log-probs in (-4, 0)
    logp = old + torch.randn(B, T, generator=g) * draw(st.sampled_from([0.05, 0.5]))
    lens = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))  # (B,) 0 = empty response
    mask = torch.arange(T)[None, :] < lens[:, None]  # (B, T) bool
    adv = torch.randn((B, T) if draw(st.booleans()) else (B,), generator=g)
    truncated = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    return logp, old, adv, mask, truncated


@st.composite
def splits(draw, B):
    "A partition of range(B) into micro-batches (shuffled), each given to one of `world` ranks, and extra padding."
    world = draw(st.sampled_from([1, 2]))
    perm = draw(st.permutations(range(B)))
    cuts = sorted(draw(st.sets(st.integers(1, B - 1), max_size=B - 1))) if B > 1 else []
    micro = [perm[a:b] for a, b in zip([0] + cuts, cuts + [B])]
    ranks = [draw(st.integers(0, world - 1)) for _ in micro]
    pads = [draw(st.integers(0, 2)) for _ in micro]
    return world, micro, ranks, pads


def cut(x: torch.Tensor, rows: list[int], width: int, fill: float = 0.0) -> torch.Tensor:
    "Rows `rows` of (B, T) `x` re-padded to `width` columns (dropping or adding padding), differentiably."
    x = x[rows]
    if width <= x.shape[1]:
        return x[:, :width]
    return torch.cat([x, x.new_full((len(rows), width - x.shape[1]), fill)], dim=1)


def split_loss_and_grad(logp, old, adv, mask, split, agg, max_len, correction=None):
    """Loss summed over micro-batches and ranks, and the ranks' summed gradient, with denominators counted as a trainer
    would; `correction` = (engine log-probs (B, T), mode): each micro-batch's weights from its own rows, as the learner's."""
    world, micro, ranks, pads = split
    widths = [int(mask[rows].sum(-1).max()) + p for rows, p in zip(micro, pads)]  # collate: longest row + extra
    # each rank counts its own micro-batches; an all-reduce SUM gives the mini-batch's counts
    per_rank = [[0, 0] for _ in range(world)]
    for rows, w, r in zip(micro, widths, ranks):
        n_tok, n_seq = loss_counts(cut(mask, rows, w, False))
        per_rank[r][0] += n_tok
        per_rank[r][1] += n_seq
    num_tokens, num_seqs = sum(c[0] for c in per_rank), sum(c[1] for c in per_rank)
    assert (num_tokens, num_seqs) == loss_counts(mask)  # the same as counting the whole mini-batch
    leaves = [logp.detach().clone().requires_grad_() for _ in range(world)]  # each rank's own weights
    total = 0.0
    for rows, w, r in zip(micro, widths, ranks):
        a = adv[rows] if adv.dim() == 1 else cut(adv, rows, w)
        wt = None
        if correction is not None:
            wt = rollout_weights(
                cut(old, rows, w, -1.0), cut(correction[0], rows, w, -1.0), cut(mask, rows, w, False), correction[1]
            )
        loss, _ = policy_loss(
            cut(leaves[r], rows, w, -1.0),
            cut(old, rows, w, -1.0),
            a,
            cut(mask, rows, w, False),
            clip_c=10.0,
            agg=agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_len=max_len,
            weights=wt,
        )
        assert loss.grad_fn is not None  # every micro-batch can be backpropagated, empty or not
        if not bool(cut(mask, rows, w, False).any()):
            assert loss.item() == 0.0
        loss.backward()
        total += loss.item()
    grads = [l.grad if l.grad is not None else torch.zeros_like(l) for l in leaves]
    return total, torch.stack(grads).sum(0)


@settings(**SETTINGS)
@given(mini_batches(), st.data(), st.sampled_from(LOSS_AGGS), st.booleans(), st.integers(0, 5))
def test_any_split_over_micro_batches_and_ranks_gives_the_full_batch_loss_and_gradient(batch, data, agg, filt, extra):
    logp, old, adv, mask, truncated = batch
    if filt:
        mask = overlong_filter(mask, truncated)  # truncated rows: no loss tokens
    max_len = mask.shape[1] + extra  # the config's l_max >= any response
    full = logp.detach().clone().requires_grad_()
    ref, _ = policy_loss(full, old, adv, mask, clip_c=10.0, agg=agg, max_len=max_len)  # one call, whole mini-batch
    ref.backward()
    total, grad = split_loss_and_grad(logp, old, adv, mask, data.draw(splits(len(mask))), agg, max_len)
    # magnitude of the result without cancellation: the same aggregation of |token loss|
    r = (logp - old).exp()
    tok = clipped_token_loss(r, adv if adv.dim() == 2 else adv[:, None], 0.2, 0.28, 10.0).abs()
    scale = agg_loss(tok, mask, agg, max_len=max_len).item()
    B, T = mask.shape
    assert abs(total - ref.item()) <= loss_tol(B, T) * scale  # derived in `loss_tol`; exact 0 == 0 when scale = 0
    assert bool(
        ((grad - full.grad).abs() <= GRAD_TOL * full.grad.abs()).all()
    )  # elementwise, see GRAD_TOL; zeros exact
    assert bool((grad[~mask] == 0).all())  # padding and filtered rows: exactly zero


@settings(**{**SETTINGS, "max_examples": 40})
@given(mini_batches(), st.data(), st.sampled_from(LOSS_AGGS), st.sampled_from(ROLLOUT_CORRECTIONS[1:]))
def test_the_split_invariance_holds_with_rollout_correction(batch, data, agg, mode):
    """The same property with the rollout correction on: every micro-batch computes its weights from its own rows (a
    sequence's weight needs only its row). Token weights are elementwise, the same bits on both sides; a sequence
    weight sums a row in float64 over another padded width, so its float32 value can differ by one rounding: 2u
    relative per token, added to both bounds (loss: 2u * scale; gradient: GRAD_TOL + 2u), with `scale` the aggregation
    of |w * token loss|."""
    logp, old, adv, mask, truncated = batch
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    roll = old - torch.randn(old.shape, generator=g) * 0.5  # (B, T) the engine's log-probs: w spread over e^{+-1}
    wt = rollout_weights(old, roll, mask, mode)  # (B, T)
    full = logp.detach().clone().requires_grad_()
    ref, _ = policy_loss(full, old, adv, mask, clip_c=10.0, agg=agg, max_len=mask.shape[1], weights=wt)
    ref.backward()
    split = data.draw(splits(len(mask)))
    total, grad = split_loss_and_grad(logp, old, adv, mask, split, agg, mask.shape[1], correction=(roll, mode))
    r = (logp - old).exp()
    tok = (clipped_token_loss(r, adv if adv.dim() == 2 else adv[:, None], 0.2, 0.28, 10.0) * wt).abs()
    scale = agg_loss(tok, mask, agg, max_len=mask.shape[1]).item()
    B, T = mask.shape
    assert abs(total - ref.item()) <= (loss_tol(B, T) + 2 * U) * scale
    assert bool(((grad - full.grad).abs() <= (GRAD_TOL + 2 * U) * full.grad.abs()).all())
    assert bool((grad[~mask] == 0).all()) and bool(
        (grad[mask & (wt == 0)] == 0).all()
    )  # masked by the correction: none


def test_a_mini_batch_without_loss_tokens_gives_an_exact_zero_that_backpropagates():
    logp = torch.randn(3, 4, requires_grad=True)
    mask = overlong_filter(torch.ones(3, 4, dtype=torch.bool), torch.ones(3, dtype=torch.bool))  # all truncated
    for agg in LOSS_AGGS:
        loss, m = policy_loss(
            logp, logp.detach() - 0.1, torch.ones(3), mask, agg=agg, num_tokens=0, num_seqs=0, max_len=8
        )
        assert loss.item() == 0.0 and loss.grad_fn is not None
        loss.backward()
        assert bool((logp.grad == 0).all())
        assert m["ratio_min"] == m["ratio_max"] == 1.0


def test_per_micro_batch_rescale_depends_on_the_split():
    "The weighting this replaces: each micro-batch's own seq mean times its share of rows, len(idx)/len(batch)."
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1]]).bool()  # rows 1, 2 overlong-filtered
    L = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    # the hand values below are dyadic rationals, exact in float32, so every sum and quotient is exact: compare with ==
    full = agg_loss(L, mask, "seq-mean-token-mean")  # (1 + 2) / 2 rows = 1.5
    assert full.item() == 1.5
    old = lambda parts: sum(agg_loss(L[p], mask[p], "seq-mean-token-mean") * len(p) / 4 for p in parts).item()
    assert old([[0, 1], [2, 3]]) == 1 * 2 / 4 + 2 * 2 / 4  # 1.5: happens to agree
    assert old([[0, 1, 2], [3]]) == 1 * 3 / 4 + 2 * 1 / 4  # 1.25
    assert old([[0], [1, 2, 3]]) == 1 * 1 / 4 + 2 * 3 / 4  # 1.75
    new = lambda parts: sum(agg_loss(L[p], mask[p], "seq-mean-token-mean", num_seqs=2) for p in parts).item()
    for parts in ([[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0], [1, 2, 3]]):
        assert new(parts) == 1.5
