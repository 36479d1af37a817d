"""One rank of tests/test_gather.py's 4-rank gloo job: a `ShardedRollout` step over 2 engines of 2 ranks (rounds with
uneven shares and with an idle engine, then `fetch` of the kept groups); each rank writes what it received and what
the gathers cost to `<out>/rank<r>.json`."""

import json, os, pickle, random, sys

import torch
import torch.distributed as tdist

from dapo_ref import dist
from dapo_ref.algorithm import Group
from dapo_ref.reward_pool import RewardPluginError
from dapo_ref import sharded
from dapo_ref.sharded import ShardedRollout, StubRollout

ROUNDS = [
    [0, 1, 2, 3, 4],
    [7],
]  # round 0: engine 0 gets prompts 0, 2, 4 and engine 1 prompts 1, 3; round 1: engine 1 idle
CHUNK = 10_000  # bytes per broadcast here: the statistics in one, each engine's kept groups in several
KEPT = [(0, 3), (1, 0), (0, 0)]  # (round, position) of the kept groups, in the batch's order (prompts 3, 7, 0)


def group(i: int) -> Group:
    "Prompt i's group: 4 responses of lengths drawn from i (3 to 1400 tokens), the engine's log-probs (float32 values)."
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


class Broken(StubRollout):
    def groups(self, indices, step, rnd):
        raise ValueError("scorer ran out of memory")


if __name__ == "__main__":
    out = sys.argv[1]
    r, w = dist.init_distributed(backend="gloo")
    sharded.GATHER_CHUNK_BYTES = CHUNK
    sr = ShardedRollout(StubRollout(group), r, w, tp=2)
    seen, old = [], 0
    for rnd, indices in enumerate(ROUNDS):
        seen.append(sr.groups(indices, step=1, rnd=rnd))
        # what all_gather_object staged for the same round: each rank's pickle padded to the largest, world of them
        mine = [group(i) for i in dist.shard(indices, sr.d, sr.D)] if sr.t == 0 else None
        old += w * max(len(pickle.dumps(x)) for x in dist.all_gather(mine))  # (the old call itself, for its sizes)
    stats_only = all(isinstance(g.responses[0], type(seen[0][0].responses[0])) for s in seen for g in s)
    batch = sr.fetch([seen[rnd][k] for rnd, k in KEPT])
    row = dict(
        seen=[[g.index for g in s] for s in seen],
        lengths_right=[[len(x) for x in g.responses] for s in seen for g in s]
        == [[len(x) for x in group(g.index).responses] for s in seen for g in s],
        stats_only=stats_only and type(seen[0][0].responses[0]).__name__ == "Elsewhere",
        batch_whole=batch == [group(seen[rnd][k].index) for rnd, k in KEPT],
        old_staged=old,
        **sr.gathered,
    )
    try:
        ShardedRollout(Failing() if r >= 2 else StubRollout(group), r, w, tp=2).groups([0, 1, 2], step=2, rnd=0)
        row["failed"] = None
    except RewardPluginError as e:
        row["failed"] = str(e)
    try:  # any other failure of one engine's round: every rank stops with it too
        ShardedRollout(Broken() if r >= 2 else StubRollout(group), r, w, tp=2).groups([0, 1, 2], step=3, rnd=0)
        row["broken"] = None
    except Exception as e:
        row["broken"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{r}.json"), "w") as f:
        json.dump(row, f)
    tdist.destroy_process_group()
