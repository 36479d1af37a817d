"""report_to (TensorBoard, W&B offline) and samples.jsonl through `dapo-train`: what a run writes, what it refuses."""

import json, os, re, subprocess, sys
from pathlib import Path

import pytest

from dapo_ref.reward import score_response
from dapo_ref.track import SampleLog, read_samples

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
SMALL = [
    "prompts_per_step=2",
    "gen_batch_size=4",
    "group_size=4",
    "mini_batch_size=8",
    "l_max=48",
    "l_cache=8",
    "dynamic_sampling=false",
    "warmup_steps=0",
]  # 2 groups of 4 per step


def _train(args, env=None, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dapo_ref.train", "--config", str(RECIPE), "--threads", "1", "--quiet", *SMALL, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    "Two rollout steps with both trackers, an evaluation at the start and the end; samples_per_step 3 of the 2 groups kept."
    out = tmp_path_factory.mktemp("track") / "run"
    p = _train(
        [
            "total_steps=2",
            "eval_every=0",
            "eval_k=2",
            "save_every=0",
            "report_to=tensorboard,wandb",
            "samples_per_step=3",
            f"output_dir={out}",
        ]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_tensorboard_event_files_hold_every_metrics_row(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(l) for l in (tracked_run / "metrics.jsonl").read_text().splitlines()]
    ev = EventAccumulator(str(tracked_run / "tb"))
    ev.Reload()
    acc = ev.Scalars("eval_acc")  # at step 0 and at the last step
    assert [(e.step, round(e.value, 6)) for e in acc] == [
        (r["step"], round(r["eval_acc"], 6)) for r in rows if "eval_acc" in r
    ]
    assert [e.step for e in ev.Scalars("acc")] == [1, 2]
    assert {"config", "summary"} <= set(ev.Tags()["tensors"]) | {t.split("/")[0] for t in ev.Tags()["tensors"]}


def test_wandb_offline_run_is_written(tracked_run):
    runs = list((tracked_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    run_id = (tracked_run / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(run_id) and list(runs[0].glob(f"run-{run_id}.wandb"))
    # the run's records (protobuf): a key (field 1 or a nested_key, field 2) followed by its value_json (field 16: tag
    # 0x82 0x01, then a length byte); the history and summary records repeat values
    data = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    values = lambda key: {
        json.loads(data[m.end() : m.end() + m.group(1)[0]])
        for m in re.finditer(b"[\n\x12]" + re.escape(bytes([len(key)]) + key.encode()) + b"\x82\x01(.)", data, re.S)
    }
    rows = [json.loads(l) for l in (tracked_run / "metrics.jsonl").read_text().splitlines()]
    assert values("eval_acc") == {r["eval_acc"] for r in rows if "eval_acc" in r} and len(values("eval_acc")) == 2
    assert values("eval_end") == {json.loads((tracked_run / "summary.json").read_text())["eval_end"]}
    assert b"report_to" in data and b"tensorboard,wandb" in data  # the config


def test_samples_rows_match_the_run(tracked_run):
    rows = read_samples(tracked_run)
    keys = {
        "step",
        "split",
        "prompt",
        "response",
        "pred",
        "ground_truth",
        "score",
        "length",
        "truncated",
        "reward_mode",
    }
    assert all(keys <= set(r) for r in rows)
    ev, tr = [r for r in rows if r["split"] == "eval"], [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in tr] == [1] * 8 + [2] * 8  # every kept group (2 < samples_per_step) of G = 4 at each step
    assert sorted({r["step"] for r in ev}) == [0, 2] and len(ev) == 2 * 64 * 2  # 64 held-out problems x eval_k 2, twice
    for r in rows:  # the saved text scores as saved (Eq. 7 recomputed from the row alone)
        assert score_response(r["response"], r["ground_truth"], mode=r["reward_mode"])["score"] == r["score"], r
        assert r["reward_mode"] == "dapo-reference" and r["prompt"].strip() and r["length"] >= 1
    m = [json.loads(l) for l in (tracked_run / "metrics.jsonl").read_text().splitlines()]
    end = [x for x in m if x["step"] == 2][0]
    assert sum(r["score"] > 0 for r in ev if r["step"] == 2) / 128 == pytest.approx(end["eval_acc"], abs=1e-12)


def test_samples_stay_bounded_over_a_long_run(tmp_path):
    "5,000 steps of 16 rows (a long run's worth) into an 8 MiB bound: never more than the bound plus one write."
    log = SampleLog(tmp_path, max_bytes=8 * 2**20)
    row = dict(
        step=0,
        split="train",
        prompt="q" * 300,
        response="r" * 3000,
        pred="1",
        ground_truth="1",
        score=1.0,
        length=900,
        truncated=False,
        reward_mode="dapo-reference",
    )
    write = 16 * (len(json.dumps(row)) + 8)
    for s in range(5000):
        log.write([dict(row, step=s)] * 16)
        total = sum(p.stat().st_size for p in tmp_path.glob("samples*.jsonl"))
        assert total <= 8 * 2**20 + write, (s, total)
    assert read_samples(tmp_path)[-1]["step"] == 4999


def test_missing_tracker_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A wandb that does not import (here: `sys.modules["wandb"] = None`, so `import wandb` raises ImportError) stops
    the run before the model loads. In this process: `dapo-train`'s exit status as a process is
    test_trainer.py::test_cli_errors_exit_2_without_traceback_as_a_process's."""
    from dapo_ref.train import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    rc = main(["--config", str(RECIPE), "--quiet", *SMALL, "report_to=wandb", f"output_dir={tmp_path / 'run'}"])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 2, lines
    assert len(lines) == 1 and "report_to names wandb" in lines[0] and "pip install 'dapo_ref[wandb]'" in lines[0], (
        lines
    )
    assert not (tmp_path / "run").exists()  # nothing written


def test_unknown_tracker_is_refused(tmp_path, capsys):
    from dapo_ref.train import main

    rc = main(["--config", str(RECIPE), "--quiet", *SMALL, "report_to=comet", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "report_to" in err and "tensorboard" in err, err


def test_trackers_receive_the_perf_keys(tracked_run):
    "TensorBoard and W&B get the throughput and ETA keys of every step's metrics row, with its values."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(l) for l in (tracked_run / "metrics.jsonl").read_text().splitlines()]
    ev = EventAccumulator(str(tracked_run / "tb"))
    ev.Reload()
    keys = ["perf/rollout_tokens_per_s", "perf/learner_tokens_per_s", "perf/eta_s"]
    for k in keys:
        want = [(r["step"], r[k]) for r in rows if k in r]
        assert [r["step"] for r in rows if k in r] == [1, 2], k
        got = [(e.step, e.value) for e in ev.Scalars(k)]  # float32 in the event file
        assert [s for s, _ in got] == [s for s, _ in want] and all(
            v == pytest.approx(w, rel=1e-6, abs=1e-6) for (_, v), (_, w) in zip(got, want)
        ), (k, got, want)
    assert "perf/learner_mfu" not in ev.Tags()["scalars"]  # the CPU: no peak, no MFU
    run_id = (tracked_run / "wandb_run_id").read_text().strip()
    data = next((tracked_run / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")).read_bytes()
    for k in keys:  # the key's name and each of its values (as JSON) are in the W&B run's records
        assert k.encode() in data, k
        assert all(json.dumps(r[k]).encode() in data for r in rows if k in r), k
