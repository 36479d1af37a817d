"Property tests for dapo_ref.advantage: a float64 Python-loop reference and hypothesis properties."

import math, statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.advantage import group_advantages, group_advantages_by_id

EPS = 1e-6
U32, U64 = 2.0**-24, 2.0**-53  # unit roundoff of float32 / float64


def adv_tol(G: int, u: float) -> float:
    """Bound on |computed - exact| for one advantage of a group of G, computed in a float format with unit roundoff u
    from rewards exact in that format. Every error is a multiple of u * R (R = the group's range), because the
    implementation first subtracts the group minimum (exact by Sterbenz when r and the minimum are within a factor 2,
    else <= u |x| <= u R), and dividing by the std multiplies by R / sigma <= k = sqrt(2 (G - 1)) (the smallest unbiased
    std of G values with range R: two at the ends, the rest at the mean), while |adv| <= a = (G - 1) / sqrt(G).
    Deviations: dev = x - mean: <= (G + 3) u R (mean over G terms, one division, one subtraction).
    std: input errors <= u R move it by <= sqrt(G / (G - 1)) u R <= sqrt(2) u R; its own rounding (Welford or two-pass,
    relative error of the variance <= (G + 2) u kappa^2 with kappa^2 <= 1 + k^2 for data in [0, R]) moves it by
    <= (G + 2)(1 + k^2)/2 u sigma. Quotient: one more rounding u |adv|.
    So |d adv| <= [(G + 3) k + a (sqrt(2) k + (G + 2)(1 + k^2)/2 + 1)] u; a group of one is r / (1 + eps): <= 3 u |r|,
    |r| <= 2. For G = 9 in float32: 315 u = 1.9e-5."""
    if G == 1:
        return 6 * u
    k, a = math.sqrt(2 * (G - 1)), (G - 1) / math.sqrt(G)
    return ((G + 3) * k + a * (math.sqrt(2) * k + (G + 2) * (1 + k * k) / 2 + 1)) * u


def loop_reference(rewards, ids, eps=EPS):
    "Float64, one group at a time: collect members by id, then statistics.mean / statistics.stdev (N - 1)."
    members = {}
    for i, g in enumerate(ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        if len(vals) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu, sd = statistics.mean(vals), statistics.stdev(vals)
        for i in idx:
            out[i] = (float(rewards[i]) - mu) / (sd + eps)
    return torch.tensor(out, dtype=torch.float64)


def ref_tol(vals, eps=EPS) -> float:
    """Bound on the float64 loop reference's own error for one group `vals` (G >= 2). It does not shift by the minimum:
    statistics.mean is correctly rounded (<= u64 max|r|, not u64 R), r - mean adds <= u64 R, and dividing by
    sd + eps (sd correctly rounded, one addition, one division: <= 3 u64 relative) adds <= 3 u64 |adv| + u64 |adv|.
    So <= u64 (max|r| + R) / (sd + eps) + 4 u64 a, a = (G - 1) / sqrt(G) >= |adv|."""
    G = len(vals)
    if G == 1:
        return 2 * U64 * max(abs(v) for v in vals)  # r / (1 + eps): two roundings
    R, sd = max(vals) - min(vals), statistics.stdev(vals)
    return U64 * (max(abs(v) for v in vals) + R) / (sd + eps) + 4 * U64 * (G - 1) / math.sqrt(G)


def check_groups(got, rewards, ids, impl_tol):
    "Every group's advantages within impl_tol(G) + ref_tol(group) of the loop reference on the same `rewards`."
    want = loop_reference(rewards, ids)
    for g in set(ids):
        idx = [i for i, h in enumerate(ids) if h == g]
        tol = impl_tol(len(idx)) + ref_tol([float(rewards[i]) for i in idx])
        assert ((got[idx].double() - want[idx]).abs() <= tol).all(), (g, tol, got[idx], want[idx])


# rewards as the trainer produces them: +-1 from Eq. 7 plus an overlong penalty in [-1, 0] (Eq. 13), or +-1 only
reward = st.one_of(
    st.sampled_from([-1.0, 1.0]), st.builds(lambda s, p: s - p, st.sampled_from([-1.0, 1.0]), st.floats(0, 1))
)
group_size = st.integers(1, 9)


@st.composite
def grouped(draw):
    G = draw(group_size)
    P = draw(st.integers(0, 6))
    return draw(st.lists(reward, min_size=P * G, max_size=P * G)), G


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_matches_float64_loop(data):
    r, G = data
    ids = [i // G for i in range(len(r))]
    test64 = group_advantages(torch.tensor(r, dtype=torch.float64), G)
    check_groups(test64, r, ids, lambda G: adv_tol(G, U64))  # implementation and reference errors, both derived
    test32 = group_advantages(torch.tensor(r), G)
    assert test32.dtype == torch.float32
    # the float32 run sees the float32 rounding of the rewards: give the reference the same inputs, so only the float32
    # arithmetic differs (rounding the inputs would be amplified by 1/(std + eps) for a std near 0)
    check_groups(test32, torch.tensor(r).tolist(), ids, lambda G: adv_tol(G, U32))


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_zero_mean_per_group(data):
    r, G = data
    adv = group_advantages(torch.tensor(r, dtype=torch.float64), G).view(-1, G)
    # exact advantages sum to 0: G terms each within adv_tol(G, U64), plus the float64 sum's own error G u64 G a
    tol = G * adv_tol(G, U64) + G * U64 * G * (G - 1) / math.sqrt(G)
    assert G == 1 or (adv.sum(1).abs() <= tol).all()


@settings(max_examples=200, deadline=None)
@given(reward, st.integers(1, 32), st.integers(1, 4), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_equal_rewards_give_exactly_zero(v, G, P, dtype):
    r = torch.full((P * G,), v, dtype=dtype)
    adv = group_advantages(r, G)
    by_id = group_advantages_by_id(r, [i // G for i in range(P * G)])
    if G == 1:
        assert torch.equal(adv, r / (1 + EPS)) and torch.equal(by_id, r / (1 + EPS))
    else:
        assert torch.equal(adv, torch.zeros_like(r)) and torch.equal(by_id, torch.zeros_like(r))


@settings(max_examples=200, deadline=None)
@given(grouped(), st.randoms(use_true_random=False))
def test_by_id_agrees_with_contiguous_under_permutation(data, rnd):
    r, G = data
    B = len(r)
    perm = list(range(B))
    rnd.shuffle(perm)
    ids = [f"prompt-{i // G}" for i in range(B)]
    r = torch.tensor(r, dtype=torch.float64)
    want = group_advantages(r, G)[perm]
    got = group_advantages_by_id(r[perm], [ids[i] for i in perm])
    tol = 2 * adv_tol(G, U64)  # two float64 algorithms (reduction vs index_add), each within adv_tol of exact
    assert ((got - want).abs() <= tol).all()
    # integer-tensor ids with arbitrary labels give the same answer
    labels = torch.tensor([(i // G) * 7919 % 101 - 50 for i in range(B)])  # distinct per group for i // G < 101
    assert ((group_advantages_by_id(r[perm], labels[perm]) - want).abs() <= tol).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), reward), min_size=1, max_size=40))
def test_by_id_uneven_groups_match_loop(pairs):
    ids = [g for g, _ in pairs]
    r = [v for _, v in pairs]
    got = group_advantages_by_id(torch.tensor(r, dtype=torch.float64), torch.tensor(ids))
    check_groups(got, r, ids, lambda G: adv_tol(G, U64))


@settings(max_examples=100, deadline=None)
@given(grouped(), st.floats(-5, 5), st.floats(0.1, 10))
def test_invariant_to_shift_and_positive_scale(data, shift, scale):
    r, G = data
    if G == 1:
        return  # mean 0, std 1 by convention: not normalised, so not invariant
    r = torch.tensor(r, dtype=torch.float64)
    a = group_advantages(r, G, eps=0.0)
    b = group_advantages(r * scale + shift, G, eps=0.0)
    # b's inputs carry the rounding of r * scale + shift: delta <= 2 u64 (scale |r| + |shift|) each, which moves dev by
    # <= 2 delta and the std by <= sqrt(2) delta, so b moves by <= (2 + sqrt(2) a) delta / (scale sigma) (a = max |adv|);
    # plus both evaluations' own error, adv_tol(G, U64) each
    a_max = (G - 1) / math.sqrt(G)
    delta = 2 * U64 * (scale * float(r.abs().amax()) + abs(shift)) if len(r) else 0.0
    for i in range(0, len(r), G):
        sigma = float(r[i : i + G].std())
        if sigma == 0 or bool((r[i : i + G] == r[i]).all()):
            continue  # eps = 0: an all-equal group is 0 / 0 (its float64 std can round to ~1e-17 instead of 0)
        tol = 2 * adv_tol(G, U64) + (2 + math.sqrt(2) * a_max) * delta / (scale * sigma)
        assert ((a[i : i + G] - b[i : i + G]).abs() <= tol).all(), (tol, a[i : i + G], b[i : i + G])


def test_all_equal_is_zero_even_where_the_literal_formula_is_not():
    r = torch.full((16,), -1.3)
    literal = (r - r.mean()) / (r.std() + EPS)
    assert literal.abs().min() > 0.05  # the literal float32 formula amplifies a rounding error (deterministic input)
    assert torch.equal(group_advantages(r, 16), torch.zeros(16))


def test_hand_values_and_population_std_differ():
    adv = group_advantages(torch.tensor([1.0, -1, -1, -1]), 4)  # mean -0.5, unbiased var (2.25 + 3 * 0.25) / 3 = 1
    want = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64) / (1 + EPS)  # exact, with eps's bias (1.5e-6)
    assert ((adv.double() - want).abs() <= adv_tol(4, U32)).all()
    # the population std gives values 1/sqrt(0.75) larger: >= 0.077 away, far beyond 1e-3 (and adv_tol)
    assert not torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]) / math.sqrt(0.75), atol=1e-3)


def test_empty_batch():
    assert group_advantages(torch.zeros(0), 4).shape == (0,)
    assert group_advantages_by_id(torch.zeros(0), []).shape == (0,)


@pytest.mark.parametrize(
    "call,msg",
    [
        (lambda: group_advantages(torch.ones(6), 4), "not a multiple of group_size = 4"),
        (lambda: group_advantages(torch.ones(6), 0), "group_size = 0 is out of range"),
        (lambda: group_advantages(torch.ones(6), 2.0), "group_size = 2.0 is out of range"),
        (lambda: group_advantages(torch.ones(6), True), "group_size = True is out of range"),
        (lambda: group_advantages(torch.ones(3, 2), 2), "1-D tensor of shape (B,)"),
        (lambda: group_advantages(torch.ones(4), 2, eps=float("nan")), "eps = nan is out of range"),
        (lambda: group_advantages_by_id(torch.ones(3), [0, 1]), "group_ids has 2 entries but rewards has 3"),
        (lambda: group_advantages_by_id(torch.ones(3), [0, 1, 1], eps=-1), "eps = -1 is out of range"),
    ],
)
def test_errors(call, msg):
    with pytest.raises((ValueError, AssertionError)) as e:  # shapes raise; ranges are the caller's contract
        call()
    assert msg in str(e.value)
