"""The one training loop on N ranks, on this CPU machine: two real processes (torchrun --nproc_per_node 2, gloo).

- sharding keeps each group whole on one rank, and ranks agree on dynamic sampling (in-process, many ranks simulated);
- ZeRO-3 (also ZeRO-2, ZeRO-3 with gradient checkpointing, and the plain learner with summed gradients), two
  processes: one DAPO update on a fixed batch = the one-device `trainer.TorchLearner` update;
- weight sync from ZeRO-3 shards into an `HFRolloutEngine` gives bit-identical weights;
- the ZeRO-3 learner as `dapo-train` builds it, two processes, a ~57M-parameter Qwen2 loaded by its hub name: every
  parameter partitioned right after construction, each rank's construction peak < 0.75x the model's bytes; a
  mini-batch whose groups were all generated on rank 0 is trained token-balanced (loss tokens differ by at most one
  response) and the update matches the same learner on one process within 3e-6 (the plain learner within 1e-5);
  the HF engine's copy is whole and synced; the streamed export costs rank 0 < 0.5x the model and
  loads back equal to the learner's weights;
- `dapo-train` under torchrun with ZeRO-3 (the 30-step tiny recipe) raises the training reward like the one-device
  run; it stops with the same DynamicSamplingError on both ranks when the batch cannot be filled; and a run killed
  with SIGKILL after a checkpoint and resumed with --resume repeats the uninterrupted one exactly.

Measured on 2 shared cores: the update/sync launch ~20-30 s, the 57M build launch ~35 s and its
one-rank twin ~25 s (the first DeepSpeed start on a machine also compiles a
shared-memory op, ~45 s, cached under ~/.cache), the 30-step run ~110 s, the error run ~15 s, the kill/resume ~80 s.
Set DAPO_REF_SKIP_SCALE_E2E=1 to skip the two-process training runs (learning, resume) when CI time is tight."""
import json, os, random, signal, subprocess, sys, time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.dist import shard, interleave
from dapo_ref.trainer import global_round, Remote, latest_checkpoint, read_metrics, strip_timing
from dapo_ref.zero import balanced_share, gather_batch
from dapo_ref.sampling import DynamicSamplingBuffer, DynamicSamplingError

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_worker  # noqa: E402


def _port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return str(s.getsockname()[1])


def _torchrun(args, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    p = subprocess.run([*TORCHRUN, _port(), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


# --- sharding and dynamic-sampling agreement (no processes) ---

@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 9), n=st.integers(0, 40), G=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_groups_stay_whole_on_one_rank(world, n, G, seed):
    "Every prompt (so all G responses of its group) is generated, scored and trained on exactly one rank."
    rng = random.Random(seed)
    prompts = list(range(n))
    parts = [shard(prompts, r, world) for r in range(world)]
    assert sorted(p for part in parts for p in part) == prompts and interleave(parts) == prompts
    # each rank's groups: its prompts' G accuracies, contiguous; the global view puts each group's G back together
    accs = {p: [rng.random() < 0.5 for _ in range(G)] for p in prompts}
    per_rank = [[a for p in part for a in accs[p]] for part in parts]
    for r in range(world):
        handles, acc = global_round(per_rank, [f"group{p}" for p in parts[r]], r, G)
        assert acc.tolist() == [a for p in prompts for a in accs[p]]
        assert [h for h in handles if not isinstance(h, Remote)] == [f"group{p}" for p in parts[r]]
        for pos, h in enumerate(handles):  # position p of the global order belongs to rank p % N
            assert (h.rank if isinstance(h, Remote) else r) == pos % world


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 6), G=st.integers(2, 4), gen=st.integers(1, 12), need=st.integers(1, 12),
       rounds=st.integers(1, 4), p_mixed=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_ranks_agree_on_dynamic_sampling(world, G, gen, need, rounds, p_mixed, seed):
    """N simulated ranks fed their all-gathered accuracies agree on full / rounds / the error, their kept count is the
    sum of the ranks' own kept counts, and together they keep exactly the groups one device would keep."""
    if gen < need: gen = need
    rng = random.Random(seed)
    bufs = [DynamicSamplingBuffer(need, G, max_num_gen_batches=rounds) for _ in range(world)]
    one = DynamicSamplingBuffer(need, G, max_num_gen_batches=rounds)
    errors, err_one, kept_by_rank = [None] * world, None, 0
    pos = 0
    while not one.full and err_one is None:
        prompts = list(range(pos, pos + gen)); pos += gen
        accs = {}
        for p in prompts:
            if rng.random() < p_mixed: accs[p] = [True] + [False] * (G - 1)
            else: accs[p] = [rng.random() < 0.5] * G
        parts = [shard(prompts, r, world) for r in range(world)]
        per_rank = [[a for p in part for a in accs[p]] for part in parts]
        kept_by_rank += sum(len(set(accs[p])) > 1 for p in prompts)  # each rank counts its own informative groups
        for r in range(world):
            h, a = global_round(per_rank, [f"g{p}" for p in parts[r]], r, G)
            try: bufs[r].add(h, a)
            except DynamicSamplingError as e: errors[r] = str(e)
        try: one.add([f"g{p}" for p in prompts], torch.tensor([a for p in prompts for a in accs[p]]))
        except DynamicSamplingError as e: err_one = str(e)
    assert all(e == err_one for e in errors)  # the same error (or none), raised in the same round on every rank
    assert {b.full for b in bufs} == {one.full} and {b.rounds for b in bufs} == {one.rounds}
    assert all(b.n_kept == kept_by_rank == one.n_kept for b in bufs)
    if one.full:
        want = one.take()
        taken = [b.take() for b in bufs]
        owned = [[h for h in t if not isinstance(h, Remote)] for t in taken]
        assert sorted(h for o in owned for h in o) == sorted(want)  # every kept group trained by exactly one rank
        for r in range(world):  # in global order; the owner of a group is its prompt's position in its round mod N
            assert [h if not isinstance(h, Remote) else None for h in taken[r]] == [
                w if (int(w[1:]) % gen) % world == r else None for w in want]


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 5), groups=st.integers(1, 8), G=st.integers(1, 4), per_mini=st.integers(1, 8),
       seed=st.integers(0, 10**6))
def test_balanced_share_covers_each_mini_batch_once(world, groups, G, per_mini, seed):
    """Whatever rank generated a response, the ranks' shares train every response of every mini-batch exactly once,
    inside its mini-batch, with loads that differ by at most that mini-batch's longest response."""
    rng = random.Random(seed)
    B = groups * G
    size = min(B, per_mini * G)
    lengths = [rng.randint(0, 40) for _ in range(B)]
    shares = [balanced_share(lengths, size, r, world) for r in range(world)]
    assert {len(s) for s in shares} == {-(-B // size)}  # every rank sees every mini-batch (maybe an empty share)
    assert sorted(i for s in shares for mb in s for i in mb) == list(range(B))
    for k in range(-(-B // size)):
        lo, hi = k * size, min(B, (k + 1) * size)
        assert all(lo <= i < hi for s in shares for i in s[k])
        loads = [sum(lengths[i] for i in s[k]) for s in shares]
        assert max(loads) - min(loads) <= max(lengths[lo:hi])


def test_gather_batch_on_one_rank_is_the_batch():
    "One process: nothing moves; an ownership list that does not match the local batch is refused."
    b = scale_worker.fixed_batch()
    assert gather_batch(b, [True] * len(b)) is b
    with pytest.raises(ValueError, match="owned positions"): gather_batch(b, [True] * (len(b) - 1) + [False])


# --- two processes: ZeRO-3 update = one-device update; weight sync bit-identical ---

@pytest.fixture(scope="module")
def two_rank_update(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale_update")
    p, dt = _torchrun(["tests/scale_worker.py", str(out), "3,2,3gc,0"], timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    print(f"\ntwo-process update/sync launch (ZeRO-3, ZeRO-2, ZeRO-3 + gradient checkpointing, plain): {dt:.1f} s")
    return {s: torch.load(out / f"stage{s}.pt", weights_only=False) for s in ("3", "2", "3gc", "0")}


@pytest.fixture(scope="module")
def one_device_update():
    "The same fixed batch, the same config, one process: `Trainer.train_on` with the plain learner."
    from dapo_ref.trainer import load_policy
    model, tok = load_policy("tiny")
    init = {n: t.clone() for n, t in model.state_dict().items()}
    trainer, old, metrics, n_micro = scale_worker.trainer_update(scale_worker.test_cfg(), model, tok)
    assert type(trainer.learner).__name__ == "TorchLearner" and trainer.world == 1
    return dict(init=init, weights=model.state_dict(), old=old, metrics=metrics, n_micro=n_micro)


# fp32 on both sides. The gradients agree to float32 rounding (summation order differs: 2 ranks x 3-4 micro-batches
# vs 7 micro-batches on one device, then a reduce-scatter). Adam's first step is lr * g / (|g| + eps), so a weight
# whose gradient is near eps (1e-8) can move by a different fraction of lr: measured max |diff| 2.9e-6 with lr 1e-3
# while the update itself moves weights by up to 1.1e-3. Asserted: |diff| <= 1e-5 = 1% of lr, for every weight.
UPDATE_ATOL = 1e-5


@pytest.mark.parametrize("stage", ["3", "2", "3gc", "0"])
def test_two_rank_update_matches_one_device(stage, two_rank_update, one_device_update):
    ds, one = two_rank_update[stage], one_device_update
    assert ds["learner"] == ("TorchLearner" if stage == "0" else "DeepSpeedLearner")
    assert ds["checkpointed_layers"] == ([True, True] if stage.endswith("gc") else [False, False])  # recompute really on
    assert ds["world"] == 2
    assert sorted(ds["n_micro"]) != [one["n_micro"]] and max(ds["n_micro"]) < one["n_micro"]  # really split: 3+4 vs 7
    assert ds["n_micro"][0] != ds["n_micro"][1]  # unequal micro-batch counts: the padding passes ran
    # old log-probs on each rank = the one-device ones of the same responses
    G, n = scale_worker.G, scale_worker.N_GROUPS
    for r in range(2):
        idx = [k * G + t for k in shard(list(range(n)), r, 2) for t in range(G)]
        for a, i in zip(ds["old"][r], idx):  # float32 log-probs near -10, different padding: a few ulp (1e-6) apart
            torch.testing.assert_close(a, one["old"][i], rtol=1e-6, atol=1e-5)
    # the global denominator, loss and clipped grad norm
    m, m1 = ds["metrics"], one["metrics"]
    assert m["num_tokens"] == m1["num_tokens"] == sum(len(r) for r in scale_worker.fixed_batch().response_ids)
    assert abs(m["loss"] - m1["loss"]) < 1e-6 and abs(m["grad_norm"] - m1["grad_norm"]) < 1e-5 * m1["grad_norm"]
    assert m1["grad_norm"] > scale_worker.test_cfg().grad_clip  # clipping was active on both sides
    # the weights after one update
    moved = max(float((one["weights"][k] - one["init"][k]).abs().max()) for k in one["init"])
    assert moved > 5e-4, moved  # the update moved the weights by ~lr
    assert set(ds["streamed"]) == set(one["weights"])  # the same names the one-device learner hands over
    for k, w in one["weights"].items():
        torch.testing.assert_close(ds["streamed"][k], w, rtol=0, atol=UPDATE_ATOL, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("stage", ["3", "2", "0"])
def test_weight_sync_from_shards_is_bit_identical(stage, two_rank_update):
    "The engine on every rank holds exactly DeepSpeed's own consolidated weights (gathered by a different path)."
    ds = two_rank_update[stage]
    assert len(ds["consolidated"]) >= len(ds["streamed"]) - 1  # tied lm_head may be dropped by DeepSpeed's gather
    for k, t in ds["consolidated"].items():
        assert torch.equal(ds["streamed"][k], t), k
    for r, eng in enumerate(ds["engines"]):
        for k, t in ds["streamed"].items():
            assert torch.equal(eng[k], t), (r, k)


# --- two processes: the ZeRO-3 learner as dapo-train builds it (57M Qwen2), balanced ranks, streamed export ---

@pytest.fixture(scope="module")
def build_run(tmp_path_factory):
    """The 57M Qwen2 in a local hub cache; the `build` worker on two ranks and on one (the same ZeRO-3 learner, one
    device); the plain learner's update of the same batch in this process."""
    from test_zero import HUB_NAME, fake_hub, qwen2_57m
    from dapo_ref.trainer import load_tokenizer
    tmp = tmp_path_factory.mktemp("build")
    model = qwen2_57m()
    fake_hub(tmp / "hub", HUB_NAME, model, max_shard_size="20MB")
    init = {k: v.clone() for k, v in model.state_dict().items()}
    env = {**os.environ, "HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    p = subprocess.run([*TORCHRUN, _port(), "tests/scale_worker.py", str(tmp / "two"), "build", HUB_NAME], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    dt = time.perf_counter() - t0
    p = subprocess.run([sys.executable, "tests/scale_worker.py", str(tmp / "one"), "build", HUB_NAME], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    two, one = (torch.load(tmp / d / "build.pt", weights_only=False) for d in ("two", "one"))
    print(f"\ntwo-process 57M build/update/export launch: {dt:.1f} s; peak / model bytes: "
          + "; ".join(f"rank {x['rank']} construction {x['construct_extra'] / x['model_bytes']:.2f}, trainer "
                      f"{x['trainer_extra'] / x['model_bytes']:.2f}, export {x['export_extra'] / x['model_bytes']:.2f}"
                      for x in two["ranks"]))
    cfg = scale_worker.test_cfg(); cfg.lr = scale_worker.LR_BUILD
    trainer, _, metrics, _ = scale_worker.trainer_update(cfg, model, load_tokenizer("tiny"))  # one device, plain learner
    assert type(trainer.learner).__name__ == "TorchLearner"
    return dict(ranks=two["ranks"], weights=two["weights"], export=tmp / "two" / "export", init=init,
                one=dict(weights=one["weights"], metrics=one["ranks"][0]["metrics"][0]),
                plain=dict(weights=model.state_dict(), metrics=metrics))


def test_zero3_learner_construction_is_partitioned(build_run):
    init = build_run["init"]
    full = sum(v.numel() for v in init.values())
    for r in build_run["ranks"]:
        assert r["all_partitioned"] and r["full_numel"] == full and r["model_bytes"] == 4 * full
        assert full / 2 <= r["local_numel"] <= full / 2 + len(init), (r["local_numel"], full)  # half, padded
        assert r["construct_extra"] < 0.75 * r["model_bytes"], (r["rank"], r["construct_extra"] / r["model_bytes"])
        assert not r["engine_partitioned"] and r["engine_equal"]  # the transformers engine: a whole, synced copy


def test_balanced_update_matches_one_device(build_run):
    "Every group generated on rank 0; after balancing both ranks train, their tokens differ by at most one response."
    r0, r1 = build_run["ranks"]
    lengths = [len(x) for x in scale_worker.fixed_batch().response_ids]
    assert len(r0["trained"]) == len(r1["trained"]) == 1  # one mini-batch, one update on each rank
    t0, t1 = r0["trained"][0], r1["trained"][0]
    assert t0 and t1 and sorted(t0 + t1) == sorted(lengths)  # both ranks train; every response once
    assert abs(sum(t0) - sum(t1)) <= max(lengths), (sum(t0), sum(t1))
    m, m1, mp = r0["metrics"][0], build_run["one"]["metrics"], build_run["plain"]["metrics"]
    assert m == r1["metrics"][0]  # the update's metrics are global
    assert m["num_tokens"] == m1["num_tokens"] == mp["num_tokens"] == sum(lengths)
    assert abs(m["loss"] - m1["loss"]) < 1e-6 and abs(m["grad_norm"] - m1["grad_norm"]) < 1e-5 * m1["grad_norm"]
    # DeepSpeed's global norm of the flat fp32 gradient vs torch's norm of per-tensor norms: 4.5e-5 apart, also on one rank
    assert abs(m["loss"] - mp["loss"]) < 1e-6 and abs(m["grad_norm"] - mp["grad_norm"]) < 1e-4 * mp["grad_norm"]
    one, plain, init = build_run["one"]["weights"], build_run["plain"]["weights"], build_run["init"]
    moved = max(float((plain[k] - init[k]).abs().max()) for k in init)
    assert moved > 0.5 * scale_worker.LR_BUILD, moved
    # The same ZeRO-3 learner on one device: measured max |diff| 1.4e-6 (lr 1e-4). Against the plain learner the
    # ZeRO-3 arithmetic itself differs by 2.6e-6 already on one rank (Adam's first step amplifies gradients near its
    # eps), measured 3.1e-6 here: held to UPDATE_ATOL, as the tiny-model tests above.
    diff = max(float((build_run["weights"][k] - w).abs().max()) for k, w in one.items())
    assert diff <= 3e-6, diff
    diff_plain = max(float((build_run["weights"][k] - w).abs().max()) for k, w in plain.items())
    assert diff_plain <= UPDATE_ATOL, diff_plain


def test_streamed_export_of_the_learner(build_run):
    from transformers import AutoModelForCausalLM
    r0 = build_run["ranks"][0]
    assert r0["export_extra"] < 0.5 * r0["model_bytes"], r0["export_extra"] / r0["model_bytes"]
    back = AutoModelForCausalLM.from_pretrained(build_run["export"], dtype=torch.float32).state_dict()
    assert set(back) == set(build_run["weights"])
    for k, v in build_run["weights"].items(): assert torch.equal(back[k], v), k


# --- two processes: the command end to end ---

def _rows(d): return [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]


TRAIN = ["-m", "dapo_ref.train", "--config", "recipes/tiny-cpu.yaml", "--threads", "1", "--quiet", "gpus_per_node=2"]
ZERO3 = "zero_stage=3"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DAPO_REF_SKIP_SCALE_E2E") == "1", reason="DAPO_REF_SKIP_SCALE_E2E=1")
def test_two_process_run_learns(tmp_path):
    out = tmp_path / "run"
    p, dt = _torchrun([*TRAIN, ZERO3, *E2E_OVERRIDES, f"output_dir={out}"], timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    print(f"\ntwo-process run: {dt:.1f} s; {p.stdout.strip().splitlines()[-1]}")
    assert "on 2 ranks" in p.stdout and p.stdout.count("held-out accuracy") == 1  # rank 0 alone prints
    s = json.loads((out / "summary.json").read_text())
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(s["steps"] + 1))  # one row per step, written once (rank 0)
    assert s["world_size"] == 2 and s["grad_updates"] == E2E_STEPS * 16 * 8 // 64
    assert rows[1]["groups_seen"] == 32  # gathered from both ranks: the whole round
    assert s["eval_start"] is not None and s["eval_end"] is not None  # held-out evaluated at start and end (sharded)
    steps = rows[1:]
    first, last = [sum(r["reward_mean"] for r in steps[a:b]) / (b - a) for a, b in ((0, 10), (len(steps) - 10, len(steps)))]
    assert last - first >= E2E_MARGIN, (first, last)  # the training reward rises like the one-device run's
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "final")  # full weights gathered from the ZeRO-3 shards
    ck = out / "checkpoints" / f"step-{s['steps']}"
    assert (ck / "model.safetensors").exists() and (ck / "deepspeed").is_dir()


E2E_STEPS = 30                    # the tiny-cpu recipe as `make demo` runs it (16 prompts x G = 8 per step, 2 updates each)
E2E_OVERRIDES = ["eval_every=0", f"total_steps={E2E_STEPS}"]  # held-out accuracy at the start and the end only
# Training reward (Eq. 7 + Eq. 13, mean over all generated responses), mean of the last 10 steps minus the first 10,
# measured on this recipe with tiny-v2 (30 steps, same seed): one device (`dapo-train`) 0.005 -> 0.201 (+0.196);
# two processes with ZeRO-3 -0.011 -> 0.213 (+0.224), held-out 43.0% -> 79.7%.
# One 10-step mean averages 1280 responses. Asserted well below the measured rise (the earlier tiny-v1 runs rose
# by +0.13, which also passes).
E2E_MARGIN = 0.06


@pytest.mark.slow
def test_unfillable_batch_stops_every_rank_with_the_same_error(tmp_path):
    "One generation round, 32 prompts to fill from 32: fails in round 1 on both ranks, rc 1, rank 0 prints the error."
    p, dt = _torchrun([*TRAIN, ZERO3, "total_steps=1", "prompts_per_step=32", "gen_batch_size=32", "max_num_gen_batches=1",
                       "eval_k=1", "eval_every=0", f"output_dir={tmp_path / 'run'}"], timeout=600)
    print(f"\ntwo-process unfillable batch: {dt:.1f} s")
    assert p.returncode != 0
    assert p.stderr.count("dapo-train: error: dynamic sampling found") == 1, p.stderr[-3000:]
    assert "max_num_gen_batches = 1" in p.stderr


def test_two_process_config_error_names_the_field(tmp_path):
    "A field this launch cannot honour stops both ranks before any model loads; rank 0 alone prints it."
    p, _ = _torchrun([*TRAIN, "offload_params=true", f"output_dir={tmp_path / 'run'}"], timeout=300)
    assert p.returncode != 0 and p.stderr.count("dapo-train: error: offload_params") == 1, p.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DAPO_REF_SKIP_SCALE_E2E") == "1", reason="DAPO_REF_SKIP_SCALE_E2E=1")
def test_two_process_kill_9_and_resume_repeats_the_run(tmp_path):
    """ZeRO-3 on two ranks: 3 steps straight; then the same run killed with SIGKILL (torchrun and both ranks) as soon
    as its first checkpoint is on disk, and `--resume` (ZeRO-3 partitions, schedule, RNG of each rank and data
    position restored): identical metrics apart from timings."""
    common = [*TRAIN, ZERO3, "total_steps=3", "eval_every=2", "eval_k=1", "save_every=1"]
    t0 = time.perf_counter()
    p, _ = _torchrun([*common, f"output_dir={tmp_path / 'ref'}"], timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    k = subprocess.Popen([*TORCHRUN, _port(), *common, f"output_dir={run}"], cwd=ROOT, env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while latest_checkpoint(run) is None:  # kill -9 the whole launch as soon as the first checkpoint is on disk
        assert k.poll() is None, "the run ended before its first checkpoint"
        assert time.perf_counter() - t0 < 600
        time.sleep(0.05)
    os.killpg(k.pid, signal.SIGKILL)
    k.wait()
    killed_at = latest_checkpoint(run).name
    p, _ = _torchrun([*common, f"output_dir={run}", "--resume"], timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    print(f"\ntwo-process kill -9 and resume (3 launches): {time.perf_counter() - t0:.1f} s, killed at {killed_at}")
    ref, cut = [[strip_timing(r) for r in read_metrics(tmp_path / d / "metrics.jsonl")] for d in ("ref", "killed")]
    assert killed_at != "step-3" and [r["step"] for r in cut] == [0, 1, 2, 3]
    assert cut == ref  # bit-identical: same floats, not only close ones
