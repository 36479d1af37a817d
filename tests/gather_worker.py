"""One rank of tests/test_gather.py's 4-rank gloo job: `ShardedRollout` rounds over 2 engines of 2 ranks, gathered by
`sharded.gather_groups`; each rank writes what it received and what the gather cost to `<out>/rank<r>.json`."""

import json, os, pickle, random, sys

import torch
import torch.distributed as tdist

from dapo_ref import dist
from dapo_ref.algorithm import Group
from dapo_ref.reward_pool import RewardPluginError
from dapo_ref.sharded import ShardedRollout, StubRollout


def group(i: int) -> Group:
    "Prompt i's group: 4 responses of lengths drawn from i (uneven shares: 3 to 1400 tokens), the engine's log-probs."
    rng = random.Random(i)
    resp = [[rng.randrange(151_665) for _ in range(rng.randrange(3, 1400))] for _ in range(4)]
    return Group(
        i,
        [rng.randrange(151_665) for _ in range(20)],
        resp,
        [len(r) > 1300 for r in resp],
        [1.0, -1.0, 1.0, -1.0],
        [True, False, True, False],
        [1.0, -1.0, 1.0, -1.0],
        ["1", "", "1", ""],
        [{}] * 4,
        [torch.tensor([-rng.random() for _ in r]).tolist() for r in resp],  # float32 values, as vLLM reports them
    )


class Failing(StubRollout):
    def groups(self, indices, step, rnd):
        raise RewardPluginError("plug-in my_reward failed on 4 of 4 calls")


if __name__ == "__main__":
    out = sys.argv[1]
    r, w = dist.init_distributed(backend="gloo")
    rounds = {}
    for name, indices in {"uneven": [0, 1, 2, 3, 4], "engine 1 idle": [7]}.items():
        sr = ShardedRollout(StubRollout(group), r, w, tp=2)
        got = sr.groups(indices, step=1, rnd=0)
        # what all_gather_object would have staged: each rank's pickle padded to the largest, world of them
        mine = [group(i) for i in dist.shard(indices, sr.d, sr.D)] if sr.t == 0 else None
        sizes = [len(pickle.dumps(x)) for x in dist.all_gather(mine)]  # (the old call itself, for its sizes)
        rounds[name] = dict(same=got == [group(i) for i in indices], old_staged=w * max(sizes), **sr.gathered)
    try:
        ShardedRollout(Failing() if r >= 2 else StubRollout(group), r, w, tp=2).groups([0, 1, 2], step=1, rnd=1)
        failed = None
    except RewardPluginError as e:
        failed = str(e)
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(dict(rounds=rounds, failed=failed), f)
    tdist.destroy_process_group()
