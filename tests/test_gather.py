"""`sharded.gather_groups` in a real 4-rank gloo job (2 engines of 2 ranks, uneven shares, an engine with nothing to
do, an engine whose reward plug-in fails): every rank receives the whole round, and what it stages is the round once,
not `world x` the largest rank's pickle (`torch.distributed.all_gather_object`)."""

import json, socket, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_four_ranks_two_engines_gather_tensors_not_padded_pickles(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", _port()]
    p = subprocess.run(
        [*cmd, str(ROOT / "tests" / "gather_worker.py"), str(tmp_path)],
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", **dict(__import__("os").environ)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    sys.path.insert(0, str(ROOT / "tests"))
    from gather_worker import group
    from dapo_ref.sharded import pack_groups

    for name, indices, shares in [("uneven", [0, 1, 2, 3, 4], ([0, 2, 4], [1, 3])), ("engine 1 idle", [7], ([7], []))]:
        b = [len(pack_groups([group(i) for i in s])) for s in shares]  # the two engines' buffers, packed here
        for rk in ranks:
            got = rk["rounds"][name]
            assert got["same"], name  # the whole round, in order, on every rank (both ranks of each engine)
            # received: each engine's buffer once (an idle engine's 24-byte header included); on the device one at a time
            assert got["received_bytes"] == sum(b) and got["device_peak_bytes"] == max(b), (name, got, b)
            # the old call pickled ~13 bytes per token (ids of 3-5 bytes, floats of 9) against 8, and staged W = 4
            # ranks' pickles where D = 2 engines send: old / new >= W / D x 13 / 8 = 3.3
            assert got["old_staged"] > 3 * got["received_bytes"], (name, got)
        print(
            f"{name}: per rank {got['received_bytes']} bytes received, {got['old_staged']} staged by all_gather_object"
        )
    assert [rk["failed"] for rk in ranks] == [
        "plug-in my_reward failed on 4 of 4 calls"
    ] * 4  # every rank stops with it
