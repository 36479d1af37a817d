"Property tests for dapo_ref.advantage: a float64 Python-loop reference and hypothesis properties."
import math, statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.advantage import group_advantages, group_advantages_by_id

EPS = 1e-6


def loop_reference(rewards, ids, eps=EPS):
    "Float64, one group at a time: collect members by id, then statistics.mean / statistics.stdev (N - 1)."
    members = {}
    for i, g in enumerate(ids): members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        if len(vals) == 1: mu, sd = 0.0, 1.0
        else: mu, sd = statistics.mean(vals), statistics.stdev(vals)
        for i in idx: out[i] = (float(rewards[i]) - mu) / (sd + eps)
    return torch.tensor(out, dtype=torch.float64)


# rewards as the trainer produces them: +-1 from Eq. 7 plus an overlong penalty in [-1, 0] (Eq. 13), or +-1 only
reward = st.one_of(st.sampled_from([-1.0, 1.0]),
                   st.builds(lambda s, p: s - p, st.sampled_from([-1.0, 1.0]), st.floats(0, 1)))
group_size = st.integers(1, 9)


@st.composite
def grouped(draw):
    G = draw(group_size); P = draw(st.integers(0, 6))
    return draw(st.lists(reward, min_size=P * G, max_size=P * G)), G


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_matches_float64_loop(data):
    r, G = data
    ids = [i // G for i in range(len(r))]
    want = loop_reference(r, ids)
    test64 = group_advantages(torch.tensor(r, dtype=torch.float64), G)
    assert torch.allclose(test64, want, atol=1e-9, rtol=1e-9)
    test32 = group_advantages(torch.tensor(r), G)
    assert test32.dtype == torch.float32
    # float32 rounding of a std near 0 is amplified by 1/(std + eps): compare groups whose std is not tiny
    for i in range(0, len(r), G):
        if G == 1 or statistics.stdev(r[i:i + G]) > 1e-3:
            assert torch.allclose(test32[i:i + G].double(), want[i:i + G], atol=1e-4, rtol=1e-4)


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_zero_mean_per_group(data):
    r, G = data
    adv = group_advantages(torch.tensor(r, dtype=torch.float64), G).view(-1, G)
    assert torch.allclose(adv.sum(1), torch.zeros(adv.shape[0], dtype=torch.float64), atol=1e-9) or G == 1


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
    perm = list(range(B)); rnd.shuffle(perm)
    ids = [f"prompt-{i // G}" for i in range(B)]
    r = torch.tensor(r, dtype=torch.float64)
    want = group_advantages(r, G)[perm]
    got = group_advantages_by_id(r[perm], [ids[i] for i in perm])
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-9)
    # integer-tensor ids with arbitrary labels give the same answer
    labels = torch.tensor([(i // G) * 7919 % 101 - 50 for i in range(B)])  # distinct per group for i // G < 101
    assert torch.allclose(group_advantages_by_id(r[perm], labels[perm]), want, atol=1e-9, rtol=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), reward), min_size=1, max_size=40))
def test_by_id_uneven_groups_match_loop(pairs):
    ids = [g for g, _ in pairs]; r = [v for _, v in pairs]
    got = group_advantages_by_id(torch.tensor(r, dtype=torch.float64), torch.tensor(ids))
    assert torch.allclose(got, loop_reference(r, ids), atol=1e-9, rtol=1e-9)


@settings(max_examples=100, deadline=None)
@given(grouped(), st.floats(-5, 5), st.floats(0.1, 10))
def test_invariant_to_shift_and_positive_scale(data, shift, scale):
    r, G = data
    if G == 1: return  # mean 0, std 1 by convention: not normalised, so not invariant
    r = torch.tensor(r, dtype=torch.float64)
    a = group_advantages(r, G, eps=0.0)
    b = group_advantages(r * scale + shift, G, eps=0.0)
    ok = torch.isfinite(a)  # eps = 0: all-equal groups are 0 / 0
    assert torch.allclose(a[ok], b[ok], atol=1e-6)


def test_all_equal_is_zero_even_where_the_literal_formula_is_not():
    r = torch.full((16,), -1.3)
    literal = (r - r.mean()) / (r.std() + EPS)
    assert literal.abs().min() > 0.05  # the literal float32 formula amplifies a rounding error
    assert torch.equal(group_advantages(r, 16), torch.zeros(16))


def test_hand_values_and_population_std_differ():
    adv = group_advantages(torch.tensor([1.0, -1, -1, -1]), 4)  # mean -0.5, unbiased var (2.25 + 3 * 0.25) / 3 = 1
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert not torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]) / math.sqrt(0.75), atol=1e-3)


def test_empty_batch():
    assert group_advantages(torch.zeros(0), 4).shape == (0,)
    assert group_advantages_by_id(torch.zeros(0), []).shape == (0,)


@pytest.mark.parametrize("call,msg", [
    (lambda: group_advantages(torch.ones(6), 4), "not a multiple of group_size = 4"),
    (lambda: group_advantages(torch.ones(6), 0), "group_size = 0 is out of range"),
    (lambda: group_advantages(torch.ones(6), 2.0), "group_size = 2.0 is out of range"),
    (lambda: group_advantages(torch.ones(6), True), "group_size = True is out of range"),
    (lambda: group_advantages(torch.ones(3, 2), 2), "1-D tensor of shape (B,)"),
    (lambda: group_advantages(torch.ones(4), 2, eps=float("nan")), "eps = nan is out of range"),
    (lambda: group_advantages_by_id(torch.ones(3), [0, 1]), "group_ids has 2 entries but rewards has 3"),
    (lambda: group_advantages_by_id(torch.ones(3), [0, 1, 1], eps=-1), "eps = -1 is out of range"),
])
def test_errors(call, msg):
    with pytest.raises(ValueError) as e: call()
    assert msg in str(e.value)
