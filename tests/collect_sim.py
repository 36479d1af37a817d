"""Stand-in groups for simulated ranks (tests/test_scale.py, tests/test_tp.py): `algorithm.collect` on N ranks through
`sharded.ShardedRollout` (threads, `dist.run_ranks`) against one device, on groups whose accuracies depend only on
their prompt, so both generate the same ones."""

import random

from dapo_ref.algorithm import PromptSampler, collect
from dapo_ref.sampling import DynamicSamplingError


class Grp:
    "A stand-in group: its prompt and its G accuracies."

    def __init__(self, i, acc):
        self.i, self.acc = i, acc

    def __eq__(self, o):
        return (self.i, self.acc) == (o.i, o.acc)

    def __repr__(self):
        return f"g{self.i}"


def accuracies(G, p_mixed, seed):
    "prompt -> its group: mixed (informative) with probability p_mixed, else all equal."

    def acc(i):
        rng = random.Random(f"{seed}/{i}")
        return [True] + [False] * (G - 1) if rng.random() < p_mixed else [rng.random() < 0.5] * G

    return lambda i: Grp(i, acc(i))


def collect_or_error(rollout, cfg):
    "`collect`'s kept groups, seen groups and stats (the stub's round count aside), or its error message."
    try:
        kept, seen, stats = collect(rollout, PromptSampler(10_000, seed=1), cfg, step=1)
    except DynamicSamplingError as e:
        return str(e)
    return kept, seen, {k: v for k, v in stats.items() if k != "reward_timeouts"}  # the stub counts rounds per engine
