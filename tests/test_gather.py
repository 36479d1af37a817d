"""`ShardedRollout`'s gathers in a real 4-rank gloo job (2 engines of 2 ranks, uneven shares, an engine with nothing to
do, an engine whose reward plug-in fails, broadcasts cut into chunks): every rank receives each round's statistics and then the kept groups
whole; what it receives is that, once, not `world x` the largest rank's pickle of every round
(`torch.distributed.all_gather_object`, the call it replaces)."""

import json, os, socket, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_four_ranks_two_engines_gather_statistics_then_the_kept_groups(tmp_path):
    from gather_worker import CHUNK, ROUNDS, group
    from dapo_ref.sharded import pack_groups

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", _port()]
    p = subprocess.run(
        [*cmd, str(ROOT / "tests" / "gather_worker.py"), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # the bytes, packed here from the same groups: each round's statistics from each engine (shares [0, 2, 4], [1, 3];
    # then [7], []), and the kept groups from the engine that made each (prompts 7 and 0 from engine 0, 3 from engine 1)
    shares = [[[0, 2, 4], [1, 3]], [[7], []]]
    stats = sum(len(pack_groups([group(i) for i in s], tokens=False)) for rnd in shares for s in rnd)
    batch = [len(pack_groups([group(7), group(0)])), len(pack_groups([group(3)]))]  # in the batch's order
    for rk in ranks:
        assert rk["seen"] == ROUNDS and rk["lengths_right"] and rk["stats_only"]  # every rank: every round's statistics
        assert rk["batch_whole"]  # and the kept groups whole, in the batch's order, on both ranks of each engine
        assert rk["round_bytes"] == stats and rk["batch_bytes"] == sum(batch), (rk, stats, batch)
        assert rk["device_peak_bytes"] == CHUNK < max(batch)  # on the device one chunk of a broadcast at a time
        # the old call: every round's groups, pickled at ~13 bytes per token (ids of 3-5 bytes, floats of 9) against 8,
        # staged by W = 4 ranks where D = 2 engines send; the new: only the kept groups' tokens (3 of 6 groups here)
        assert rk["old_staged"] > 4 * (rk["round_bytes"] + rk["batch_bytes"]), rk
    r0 = ranks[0]
    print(
        f"\nper rank: {r0['round_bytes']} + {r0['batch_bytes']} bytes received; all_gather_object: {r0['old_staged']}"
    )
    assert [rk["failed"] for rk in ranks] == [
        "plug-in my_reward failed on 4 of 4 calls"
    ] * 4  # every rank stops with it
    # another exception in one engine (ranks 2 and 3): they raise their own, the others the engine's in one line
    assert [rk["broken"] for rk in ranks] == ["RuntimeError: engine 1: ValueError: scorer ran out of memory"] * 2 + [
        "ValueError: scorer ran out of memory"
    ] * 2
