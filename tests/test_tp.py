"""Rollout groups: vLLM tensor parallelism t inside an N-rank training job (one engine per t consecutive ranks).

- in process, many layouts simulated (hypothesis, random acceptance patterns): the ranks of one engine see the same
  groups, every rank's buffer decides what one device decides, each group is counted once and every kept group is
  held (trained) by exactly one rank, one of its engine's;
- two real processes (torchrun --nproc_per_node 2, gloo), two DAPO steps of the `Trainer` with a recording stand-in
  for the vLLM engine (tests/tp_worker.py): with vllm_tensor_parallel 2 both ranks pass identical prompts and seeds
  (the one-device run's), the steps keep the one-device groups and train each of their responses exactly once across
  the ranks, and the engine's memory calls follow `FULL_ORDER`; with vllm_tensor_parallel 1 the ranks' prompts are
  disjoint. Measured on 2 shared cores: ~15 s per launch, ~7 s for the one-process reference."""
import json, os, random, subprocess, sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.dist import shard
from dapo_ref.rollout import rollout_groups
from dapo_ref.sampling import DynamicSamplingBuffer, DynamicSamplingError
from dapo_ref.trainer import Remote, global_round
from dapo_ref.vllm_rollout import FULL_ORDER

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "tp_worker.py")
sys.path.insert(0, str(ROOT / "tests"))
import tp_worker  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 3), tp=st.sampled_from([1, 2, 3, 4]), G=st.integers(2, 4), gen=st.integers(1, 10),
       need=st.integers(1, 10), rounds=st.integers(1, 4), p_mixed=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_tp_groups_agree_and_train_each_kept_group_once(dp, tp, G, gen, need, rounds, p_mixed, seed):
    world, gen = dp * tp, max(gen, need)
    rng = random.Random(seed)
    bufs = [DynamicSamplingBuffer(need, G, max_num_gen_batches=rounds) for _ in range(world)]
    one = DynamicSamplingBuffer(need, G, max_num_gen_batches=rounds)
    errors, err_one, pos = [None] * world, None, 0
    while not one.full and err_one is None:
        prompts = list(range(pos, pos + gen)); pos += gen
        accs = {p: ([True] + [False] * (G - 1)) if rng.random() < p_mixed else [rng.random() < 0.5] * G for p in prompts}
        layout = [rollout_groups(r, world, tp) for r in range(world)]
        shares = [shard(prompts, d, D) for d, D, _ in layout]  # what each rank's engine generates
        assert all(shares[r] == shares[r - r % tp] for r in range(world))  # one engine's ranks: the same prompts
        per_rank = [[a for p in s for a in accs[p]] for s in shares]
        want_acc = [a for p in prompts for a in accs[p]]
        held = Counter()
        for r in range(world):
            h, a = global_round(per_rank, [f"g{p}" for p in shares[r]], r, G, tp)
            assert a.tolist() == want_acc and len(h) == gen  # every group once, in global order
            mine = [x for x in h if not isinstance(x, Remote)]
            assert set(mine) <= {f"g{p}" for p in shares[r]}  # a rank holds only groups its engine generated
            held.update(mine)
            c = [sum(1 for x in h if isinstance(x, Remote) and x.rank == q) for q in range(r - r % tp, r - r % tp + tp) if q != r]
            assert all(abs(len(mine) - k) <= 1 for k in c)  # the engine's ranks take its groups in turn
            try: bufs[r].add(h, a)
            except DynamicSamplingError as e: errors[r] = str(e)
        assert held == Counter({f"g{p}": 1 for p in prompts})  # each group held by exactly one rank
        try: one.add([f"g{p}" for p in prompts], torch.tensor(want_acc))
        except DynamicSamplingError as e: err_one = str(e)
    assert all(e == err_one for e in errors)
    assert {b.full for b in bufs} == {one.full} and {b.rounds for b in bufs} == {one.rounds}
    assert all((b.n_seen, b.n_kept) == (one.n_seen, one.n_kept) for b in bufs)  # each group counted once
    if one.full:
        want, taken = one.take(), [b.take() for b in bufs]
        trained = [x for t in taken for x in t if not isinstance(x, Remote)]
        assert sorted(trained) == sorted(want)  # every kept group trained by exactly one rank


# --- two processes: the Trainer with a recording engine ---

def _run(out: Path, tp: int, world: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if world == 1: cmd = [sys.executable, WORKER, str(out), str(tp)]
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port,
               WORKER, str(out), str(tp)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), 1, 1)[0]


def _groups(trained_step):
    "prompt -> its trained responses (sorted) from [prompt, response] pairs."
    out = {}
    for p, r in trained_step: out.setdefault(tuple(p), []).append(tuple(r))
    return {k: sorted(v) for k, v in out.items()}


def _expected_memory(rank_out):
    "FULL_ORDER per step, the load expanded into one reload per layer bucket (bucket bytes 0) carrying every weight once."
    calls = []
    for names in rank_out["weight_names"]:
        for s in FULL_ORDER:
            if s != "load": calls.append(s); continue
            buckets, last = [], None
            for n in names:
                unit = n.split(".")[2] if n.startswith("model.layers.") else n
                if unit != last or not n.startswith("model.layers."): buckets.append([])
                buckets[-1].append(n); last = unit
            calls += [["reload_weights", b] for b in buckets]
    return calls


@pytest.mark.slow
def test_two_ranks_one_tp2_engine(tmp_path, one_device):
    r0, r1 = _run(tmp_path, 2, 2)
    assert r0["generated"] == r1["generated"]  # identical prompts, seeds and completions on both ranks of the engine
    assert r0["generated"] == one_device["generated"]  # ... the one-device run's: one engine, one share of the prompts
    assert len({c["seed"] for c in r0["generated"]}) == len(r0["generated"])  # a new seed every round
    for k in ("groups_seen", "gen_rounds", "groups_all_correct", "groups_all_wrong", "frac_kept"):  # each group counted once
        assert [r[k] for r in r0["rows"]] == [r[k] for r in r1["rows"]] == [r[k] for r in one_device["rows"]], k
    assert sum(r["gen_rounds"] for r in r0["rows"]) > len(r0["rows"])  # dynamic sampling dropped groups: a real test
    for s in range(len(r0["trained"])):
        union = r0["trained"][s] + r1["trained"][s]
        assert sorted(map(str, union)) == sorted(map(str, one_device["trained"][s]))  # each kept response exactly once
        groups = _groups(union)
        assert len(groups) == 4 and all(len(v) == tp_worker.G for v in groups.values())
    for r in (r0, r1):
        assert r["memory"] == _expected_memory(r)


@pytest.mark.slow
def test_two_ranks_tp1_disjoint_prompts(tmp_path):
    r0, r1 = _run(tmp_path, 1, 2)
    assert len(r0["generated"]) == len(r1["generated"])  # the same rounds on both ranks
    for a, b in zip(r0["generated"], r1["generated"]):
        pa, pb = {tuple(p) for p in a["prompts"]}, {tuple(p) for p in b["prompts"]}
        assert not pa & pb and len(pa) + len(pb) == tp_worker.GEN  # disjoint halves of the round
        assert a["seed"] != b["seed"]
    for s in range(len(r0["trained"])):
        groups = _groups(r0["trained"][s] + r1["trained"][s])
        assert len(groups) == 4 and all(len(v) == tp_worker.G for v in groups.values())  # each kept group once
    assert [r["groups_seen"] for r in r0["rows"]] == [tp_worker.GEN * r["gen_rounds"] for r in r0["rows"]]


@pytest.mark.slow
def test_kill_9_of_one_rank_stops_the_other_three(tmp_path):
    """Four ranks started as a cluster scheduler starts them (one process each, RANK / WORLD_SIZE / MASTER_ADDR set; no
    torchrun agent to tear the job down), two engines at TP 2 (the recording stand-in), dist_timeout 60 s. Rank 3 is
    killed with SIGKILL as the first step starts: ranks 0-2 must not wait for it forever. Each leaves its collective with
    an error and exits non-zero within the process-group timeout (gloo reports a vanished peer at once; a peer that
    hangs instead would take dist_timeout)."""
    import socket, time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
    base = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "KILL_RANK": "3", "DIST_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path), "2"], cwd=ROOT,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / f"err{r}.txt").open("w")) for r in range(4)]
    try:
        assert procs[3].wait(timeout=300) == -9  # hang guard: the model loads first
        t_kill = time.time()
        rcs = [p.wait(timeout=60 + 30) for p in procs[:3]]  # hang guard = the process-group timeout + 30 s
        waited = time.time() - t_kill
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
    assert all(rc != 0 for rc in rcs), (rcs, [(tmp_path / f"err{r}.txt").read_text()[-1500:] for r in range(3)])
    assert waited < 60 + 30, waited
    assert not any((tmp_path / f"rank{r}.json").exists() for r in range(4))  # nobody finished as if nothing happened
