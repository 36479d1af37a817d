"Tests for dapo_ref.sampling beyond the lesson: buffer bookkeeping, the round bound, disabled mode, errors, properties."

import statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.sampling import DynamicSamplingBuffer, DynamicSamplingError, informative_groups

G = 4
MIXED, ALL1, ALL0 = [1, 0, 0, 0], [1] * G, [0] * G


def round_of(patterns, start=0):
    "Groups named g<start>.. and their flat accuracies from a list of per-group patterns."
    return [f"g{start + i}" for i in range(len(patterns))], torch.tensor([a for p in patterns for a in p])


def ref_keep(acc, group_size):
    "The reference recipe's rule: np.std(group) > 0 or len(group) == 1, as a float64 loop."
    return [
        statistics.pstdev([float(v) for v in acc[i : i + group_size]]) > 0 or group_size == 1
        for i in range(0, len(acc), group_size)
    ]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(0, 10), st.data())
def test_informative_matches_recipe_rule(g, p, data):
    # floats 0 or of magnitude >= 1e-100: the reference's np.std of values closer than ~1e-154 underflows to 0 (their
    # squared deviation is below the smallest float64), where "all equal" is the exact comparison; rewards are ±1
    values = (
        st.sampled_from([0, 1])
        | st.sampled_from([-1.0, 1.0])
        | st.floats(-2, 2).filter(lambda x: x == 0 or abs(x) >= 1e-100)
    )
    acc = data.draw(st.lists(values, min_size=p * g, max_size=p * g))
    got = informative_groups(torch.tensor(acc, dtype=torch.float64), g)
    assert got.dtype == torch.bool and got.shape == (p,)
    assert got.tolist() == ref_keep(acc, g)


def test_informative_accepts_bool_int_float_and_empty():
    for acc in (torch.tensor([True, False]), torch.tensor([1, 0]), torch.tensor([1.0, -1.0])):
        assert informative_groups(acc, 2).tolist() == [True]
    assert informative_groups(torch.zeros(0), 4).shape == (0,)
    assert informative_groups(torch.zeros(3), 1).tolist() == [True] * 3  # groups of one are kept (recipe)


def test_surplus_dropped_order_preserved_and_counters():
    buf = DynamicSamplingBuffer(prompts_per_step=5, group_size=G, max_num_gen_batches=0)
    assert buf.add(*round_of([MIXED, ALL1, MIXED, ALL0], 0)) == 2  # g0 g2
    assert not buf.full and len(buf) == 2 and buf.rounds == 1
    assert buf.add(*round_of([ALL1, ALL1, MIXED, ALL0], 4)) == 1  # g6
    assert buf.add(*round_of([MIXED, MIXED, MIXED, MIXED], 8)) == 4  # g8..g11, 7 in all
    assert buf.full and len(buf) == 7 and buf.rounds == 3
    assert buf.take() == ["g0", "g2", "g6", "g8", "g9"]  # first 5 in insertion order
    assert (buf.n_seen, buf.n_kept, buf.n_dropped) == (12, 7, 2)
    assert (buf.n_all_correct, buf.n_all_wrong) == (3, 2)
    assert buf.frac_kept == 7 / 12  # n_kept / n_seen: one correctly rounded division
    assert len(buf) == 0 and not buf.full  # take() empties the buffer
    with pytest.raises(RuntimeError, match=r"call add\(\) until .full"):
        buf.take()
    buf.reset()
    assert (buf.rounds, buf.n_seen, buf.n_kept, buf.frac_kept) == (0, 0, 0, 0.0)


def test_exactly_full_has_no_surplus():
    buf = DynamicSamplingBuffer(2, G)
    buf.add(*round_of([MIXED, ALL0, MIXED]))
    assert buf.full and buf.take() == ["g0", "g2"] and buf.n_dropped == 0


@pytest.mark.parametrize("bound", [1, 2, 3, 10])
def test_error_raised_at_exactly_the_bound(bound):
    buf = DynamicSamplingBuffer(prompts_per_step=100, group_size=G, max_num_gen_batches=bound)
    for r in range(bound - 1):  # rounds 1 .. bound-1 do not raise
        assert buf.add(*round_of([MIXED, ALL1, ALL1, ALL0], 4 * r)) == 1
    with pytest.raises(DynamicSamplingError) as e:  # round `bound` does
        buf.add(*round_of([MIXED, ALL1, ALL1, ALL0], 4 * bound))
    msg = str(e.value)
    assert isinstance(e.value, RuntimeError)
    assert buf.rounds == bound
    for part in (
        f"max_num_gen_batches = {bound}",
        f"in {bound} generation rounds",
        f"kept {bound} of {4 * bound} groups (25.0%",
        "set max_num_gen_batches = 0 for unbounded",
        "make the training data harder",
        "increase gen_batch_size",
        f"{2 * bound} groups were all correct and {bound} all wrong",
        "about 100 rounds would be needed",
    ):
        assert part in msg, (part, msg)


def test_error_suggests_easier_data_when_groups_are_all_wrong():
    buf = DynamicSamplingBuffer(3, G, max_num_gen_batches=1)
    with pytest.raises(DynamicSamplingError, match="make the training data easier") as e:
        buf.add(*round_of([ALL0, ALL0, ALL1]))
    assert "no group was informative" in str(e.value) and "kept 0 of 3 groups (0.0%" in str(e.value)


def test_no_error_when_the_bound_round_fills_the_buffer():
    buf = DynamicSamplingBuffer(2, G, max_num_gen_batches=2)
    buf.add(*round_of([ALL0, ALL0]))
    buf.add(*round_of([MIXED, MIXED], 2))  # round 2 = bound, but full: no error
    assert buf.take() == ["g2", "g3"]


def test_unbounded_never_raises():
    buf = DynamicSamplingBuffer(prompts_per_step=1, group_size=G, max_num_gen_batches=0)
    for r in range(500):  # a bounded loop standing in for "forever"
        assert buf.add(*round_of([ALL1, ALL0], 2 * r)) == 0
    assert buf.rounds == 500 and not buf.full and buf.frac_kept == 0.0
    buf.add(*round_of([MIXED], 1000))
    assert buf.take() == ["g1000"]


def test_disabled_keeps_every_group():
    buf = DynamicSamplingBuffer(prompts_per_step=3, group_size=G, max_num_gen_batches=1, enabled=False)
    assert buf.add(*round_of([ALL1, ALL0, MIXED, ALL1])) == 4
    assert buf.frac_kept == 1.0 and (buf.n_all_correct, buf.n_all_wrong) == (2, 1)  # still counted, for logging
    assert buf.take() == ["g0", "g1", "g2"] and buf.n_dropped == 1


def test_disabled_still_bounded_when_rounds_are_too_small():
    buf = DynamicSamplingBuffer(prompts_per_step=3, group_size=G, max_num_gen_batches=2, enabled=False)
    buf.add(*round_of([ALL1]))
    with pytest.raises(DynamicSamplingError, match="max_num_gen_batches = 2"):
        buf.add(*round_of([ALL1], 1))


def test_groups_can_be_any_objects_and_singleton_groups_are_kept():
    buf = DynamicSamplingBuffer(prompts_per_step=3, group_size=1)
    objs = [{"prompt": i} for i in range(3)]
    assert buf.add(objs, torch.tensor([1.0, 1.0, 0.0])) == 3
    assert buf.take() == objs


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.lists(st.lists(st.sampled_from(["mixed", "all1", "all0"]), max_size=6), min_size=1, max_size=8),
)
def test_buffer_property_first_informative_in_order(need, g, rounds):
    "take() returns the first `need` informative groups in generation order, whatever the rounds look like."
    pat = {"mixed": [1] + [0] * (g - 1) if g > 1 else [1], "all1": [1] * g, "all0": [0] * g}
    buf = DynamicSamplingBuffer(need, g, max_num_gen_batches=0)
    expected, n = [], 0
    for kinds in rounds:
        if buf.full:
            break
        names = [f"g{n + i}" for i in range(len(kinds))]
        expected += [nm for nm, k in zip(names, kinds) if k == "mixed" or g == 1]
        buf.add(names, torch.tensor([a for k in kinds for a in pat[k]], dtype=torch.float32).view(-1))
        n += len(kinds)
    if buf.full:
        assert buf.take() == expected[:need]
    else:
        assert len(buf) == len(expected) < need


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: DynamicSamplingBuffer(0, G), "prompts_per_step = 0 is out of range"),
        (lambda: DynamicSamplingBuffer(2.5, G), "prompts_per_step = 2.5 is out of range"),
        (lambda: DynamicSamplingBuffer(2, 0), "group_size = 0 is out of range"),
        (lambda: DynamicSamplingBuffer(2, G, max_num_gen_batches=-1), "max_num_gen_batches = -1 is out of range"),
        (lambda: DynamicSamplingBuffer(2, G, max_num_gen_batches=True), "max_num_gen_batches = True is out of range"),
        (lambda: DynamicSamplingBuffer(2, G, enabled="yes"), "enabled = 'yes' is out of range"),
        (lambda: DynamicSamplingBuffer(2, G).add(["a", "b"], torch.ones(4)), "expected acc of shape (8,)"),
        (lambda: DynamicSamplingBuffer(2, G).add(["a"], torch.ones(1, 4)), "expected acc of shape (4,)"),
        (lambda: informative_groups(torch.ones(5), 2), "not a multiple of group_size = 2"),
        (lambda: informative_groups(torch.ones(4), -1), "group_size = -1 is out of range"),
        (lambda: informative_groups(torch.ones(2, 2), 2), "1-D tensor of shape (P*G,)"),
    ],
)
def test_invalid_arguments(make, msg):
    with pytest.raises((ValueError, AssertionError)) as e:  # shapes raise; ranges are the caller's contract
        make()
    assert msg in str(e.value)


def test_a_continuous_reward_fills_the_batch_when_the_filter_reads_its_score():
    """A plug-in whose score is always positive (a continuous reward in 0.2-0.8) reads "correct" on every response (acc
    is score > 0): with `dynamic_sampling_metric: acc` every group is all-correct and dropped, so no round fills the
    batch (the bound of 3 rounds ends the step); with `score` (verl's filter_groups.metric: score) a group is kept when
    its scores differ and the batch fills. A group whose scores are all equal (every 4th prompt here) is still
    dropped: its advantages are zero (Eq. 4), as Eq. 11's all-correct groups' are."""
    from dapo_ref.algorithm import Group, PromptSampler, collect
    from dapo_ref.core import DAPOConfig
    from dapo_ref.names import foreign
    from dapo_ref.sharded import StubRollout

    def group(i):
        s = [0.5] * 4 if i % 4 == 0 else [round(0.2 + 0.1 * ((i + k) % 7), 1) for k in range(4)]
        return Group(i, [1], [[2]] * 4, [False] * 4, s, [x > 0 for x in s], s, ["x"] * 4, [{}] * 4)

    base = dict(group_size=4, prompts_per_step=6, gen_batch_size=8, max_num_gen_batches=3, mini_batch_size=24)
    with pytest.raises(DynamicSamplingError):
        collect(StubRollout(group), PromptSampler(1000, seed=0), DAPOConfig(**base), step=1)
    cfg = DAPOConfig(**base, dynamic_sampling_metric="score")
    kept, seen, stats = collect(StubRollout(group), PromptSampler(1000, seed=0), cfg, step=1)
    assert len(kept) == 6 and all(len(set(g.scores)) > 1 for g in kept)
    assert stats["groups_all_correct"] == sum(g.index % 4 == 0 for g in seen)  # the equal groups, dropped
    # verl's key reads as the field: its sequence rewards are this project's reward (score + overlong penalty)
    metric = foreign("algorithm.filter_groups.metric")
    assert metric.convert("metric", "seq_final_reward", {}) == {"dynamic_sampling_metric": "reward"}
