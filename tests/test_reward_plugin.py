"""A reward plug-in (`reward: package.module:function`) written here: one that scores, one that hangs, one that raises;
in the bounded worker pool through `score_batch`, and through `dapo-train` (counted; a bad name refused); plug-ins
that fail on most calls, or return what is no score, stop `dapo-train` and `dapo-eval` in one line naming them."""

import json, os, re, subprocess, sys
from pathlib import Path

import pytest

from dapo_ref.core import InputError
from dapo_ref.reward import score_batch, score_response
from dapo_ref.reward_pool import check_plugin

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
    "eval_every=0",
    "eval_k=1",
    "save_every=0",
]
PLUGIN = """
import os, time
from dapo_ref.reward import score_response
def exact(response, ground_truth, **kw):
    "The dapo-reference verdict, as a plug-in: the same scores as the built-in mode."
    return score_response(response, ground_truth)["score"]
def as_dict(response, ground_truth, **kw):
    return {"score": 0.25, "note": "extra keys are ignored"}
def hang(response, ground_truth, **kw):
    if len(response) % 2 == 0: time.sleep(600)  # about half of the calls never return
    return 1.0
def crash(response, ground_truth, **kw):
    if len(response) % 2 == 1: raise RuntimeError("plug-in bug")
    return float("nan") if len(response) % 4 == 0 else -0.5
"""


@pytest.fixture()
def plugins(tmp_path, monkeypatch):
    (tmp_path / "test_plugins_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )  # the server's path too
    return tmp_path


RESPONSES = ["x Answer: 12", "Answer: 7", "no answer here", "Answer: 12 ", "So Answer: 3", "Answer:12"]
TRUTHS = ["12", "8", "1", "12", "3", "12"]


def test_plugin_scores_like_the_builtin_mode(plugins):
    s, a, m = score_batch(RESPONSES, TRUTHS, "test_plugins_mod:exact", timeout=30.0)
    ref, ref_acc, _ = score_batch(RESPONSES, TRUTHS, "dapo-reference")
    assert (
        s.tolist() == ref.tolist()
        and a.tolist() == ref_acc.tolist()
        and m["reward_timeouts"] == m["reward_errors"] == 0
    )
    assert score_response("Answer: 12", "12", mode="test_plugins_mod:exact")["score"] == 1.0
    assert score_batch(RESPONSES[:2], TRUTHS[:2], "test_plugins_mod:as_dict")[0].tolist() == [0.25, 0.25]
    # `pred` for reading: the response's `Answer:` line (dapo-strict's extraction), "[INVALID]" without one
    preds = score_batch(RESPONSES, TRUTHS, "test_plugins_mod:exact", return_preds=True)[3]
    assert preds == ["12", "7", "[INVALID]", "12", "3", "12"]


def test_hanging_plugin_costs_its_timeout_and_is_counted(plugins):
    s, a, m = score_batch(RESPONSES, TRUTHS, "test_plugins_mod:hang", timeout=1.0, workers=2)
    even = [len(r) % 2 == 0 for r in RESPONSES]
    assert s.tolist() == [-1.0 if e else 1.0 for e in even] and m["reward_timeouts"] == sum(even) > 0


def test_raising_plugin_scores_minus_one_and_is_counted(plugins):
    "With reward_failures: warn (a NaN among the results stops the default, `stop`: tested below)."
    s, a, m = score_batch(RESPONSES, TRUTHS, "test_plugins_mod:crash", timeout=10.0, on_failure="warn")
    bad = [len(r) % 2 == 1 or len(r) % 4 == 0 for r in RESPONSES]  # raised, or returned NaN
    assert s.tolist() == [-1.0 if b else -0.5 for b in bad] and m["reward_errors"] == sum(bad) > 0
    assert not a.any()  # acc: score > 0


def test_bad_plugins_are_refused_by_name(plugins):
    (plugins / "test_plugins_bad.py").write_text("judge = 3\ndef one(response): return 1.0\n")
    for spec, words in [
        ("test_plugins_nosuch:f", "cannot load it"),
        ("test_plugins_mod:nosuch", "cannot load it"),
        ("test_plugins_bad:judge", "not a function"),
        ("test_plugins_bad:one", "cannot be called as one(response, ground_truth)"),
    ]:
        with pytest.raises(InputError, match=re.escape(words)):
            check_plugin(spec)


def _train(args, env):
    return subprocess.run(
        [sys.executable, "-m", "dapo_ref.train", "--config", str(RECIPE), "--threads", "1", "--quiet", *SMALL, *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_training_with_a_hanging_plugin_goes_on(plugins, tmp_path):
    """Two steps scored by a plug-in that hangs on about half of the responses (limit 0.5 s): the run ends, every timeout
    counted. Held out: 4 problems at the end only (each hanging call costs its 0.5 s; the 64 problems at both ends
    cost ~30 s of waiting and showed nothing more)."""
    from dapo_ref.data import save_math_dataset
    from dapo_ref.tiny import tiny_splits

    held = save_math_dataset(tiny_splits(64, 4, seed=0)[1][:4], tmp_path / "held.jsonl")
    p = _train(
        [
            "total_steps=2",
            "reward=test_plugins_mod:hang",
            "reward_timeout=0.5",
            "reward_failures=warn",  # about half of the calls fail: in some rounds more than half
            f"eval_data={held}",
            "val_before_train=false",
            f"output_dir={tmp_path / 'run'}",
        ],
        {"PYTHONPATH": os.environ["PYTHONPATH"]},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2 and all(r["reward_timeouts"] > 0 for r in steps)
    assert all(r["score_mean"] > -1.0 for r in steps)  # the calls that returned scored +1


def test_training_with_an_unknown_plugin_is_refused_in_one_line(tmp_path, capsys):
    "In this process: `dapo-train`'s exit status as a process is test_trainer.py's (test_cli_errors_exit_2_...)."
    from dapo_ref.train import main

    rc = main(
        [
            "--config",
            str(RECIPE),
            "--quiet",
            *SMALL,
            "reward=no_such_pkg.rewards:judge",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and "reward = no_such_pkg.rewards:judge" in lines[0], lines
    assert not (tmp_path / "run").exists()


FAILING = """
import math, time
def always(response, ground_truth, **kw): raise KeyError("ground_truth format")
def nan(response, ground_truth, **kw): return math.nan
def huge(response, ground_truth, **kw): return 1e30
def words(response, ground_truth, **kw): return "yes"
def forever(response, ground_truth, **kw): time.sleep(600)
def hog(response, ground_truth, **kw): return float(len(bytearray(2**31)))  # 2 GiB at once
def some(response, ground_truth, **kw):
    if len(response) % 3 == 0: raise ValueError("a third of them")
    return 1.0
"""


@pytest.fixture()
def failing(tmp_path, monkeypatch):
    (tmp_path / "failing_mod.py").write_text(FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return tmp_path


@pytest.mark.parametrize(
    "reward, extra, words",
    [
        (
            "failing_mod:always",
            [],
            ["raised; the round stopped there", "KeyError: 'ground_truth format'"],
        ),  # how many calls ended first: below, from the pool's rule
        ("failing_mod:nan", [], ["reward = failing_mod:nan returned nan, outside the finite range +-1e+06"]),
        ("failing_mod:huge", [], ["returned 1e+30, outside the finite range"]),
        ("failing_mod:words", [], ["returned str 'yes', not a number"]),
        ("dapo-reference,failing_mod:always", ["reward_weights=1.0,0.5"], ["reward = failing_mod:always failed"]),
        ("failing_mod:forever", ["reward_timeout=0.3"], ["ran past reward_timeout (0.3 s)", "the round stopped there"]),
    ],
)
def test_a_failing_plugin_stops_training_in_one_line(failing, tmp_path, capsys, reward, extra, words):
    """Every call raising, a NaN, an inf-sized or a string score, one failing part of a weighted reward, a plug-in
    that never returns: the run stops in its first round with one line naming the plug-in, the count and the first
    failure (before, it trained on -1s for ten rounds and then blamed the data: "make the training data easier")."""
    from dapo_ref.train import main

    rc = main(["--config", str(RECIPE), "--quiet", *SMALL, f"reward={reward}", *extra, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("dapo-train: error: ")]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert all(w in lines[0] for w in words) and "easier" not in lines[0], lines[0]
    if (
        reward == "failing_mod:always"
    ):  # the pool gives up once max(8, 2 x workers) calls ended, all failed; a call that
        # ended in the same poll as the last of them is counted too (up to workers - 1 more), as in
        # test_dapo_eval_counts_reward_failures_and_stops_on_most
        from dapo_ref.reward_pool import default_workers

        w = default_workers()
        m = re.search(r"failed on (\d+) of the (\d+) calls it was given this round \((\d+) raised", lines[0])
        assert m and m[1] == m[2] == m[3] and max(8, 2 * w) <= int(m[1]) <= max(8, 2 * w) + w - 1, lines[0]


def test_a_plugin_past_its_memory_bound_scores_minus_one_as_a_timeout(failing):
    "A call allocating 2 GiB with reward_memory_mb 256: -1, counted with the timeouts (the others' workers unharmed)."
    s, a, m = score_batch(RESPONSES[:2], TRUTHS[:2], "failing_mod:hog", memory_mb=256, on_failure="warn")
    assert s.tolist() == [-1.0, -1.0] and m["reward_timeouts"] == 2 and m["reward_errors"] == 0


def test_dapo_eval_counts_reward_failures_and_stops_on_most(failing, tmp_path, capsys):
    "dapo-eval: a third of the calls failing is counted in its output and JSON; every call failing stops it in one line."
    from dapo_ref.data import save_math_dataset
    from dapo_ref.eval_cli import main
    from dapo_ref.tiny import tiny_splits

    data = save_math_dataset(tiny_splits(64, 6, seed=0)[1][:6], tmp_path / "held.jsonl")
    base = ["--model", "tiny", "--data", str(data), "--k", "2", "--max-tokens", "24"]
    assert main([*base, "--reward", "failing_mod:some", "--out", str(tmp_path / "a.json")]) == 0
    res, out = json.loads((tmp_path / "a.json").read_text()), capsys.readouterr().out
    assert 0 < res["reward_errors"] < 6 and f"{res['reward_errors']} failed (raised" in out, out
    assert main([*base, "--reward", "failing_mod:always", "--out", str(tmp_path / "b.json")]) == 1
    err = capsys.readouterr().err
    # it gives up once `give_up` = max(8, 2 x workers) calls have ended, all failed, where the round has more (12 here:
    # 6 problems x k 2); a call that ended in the same poll as the last of them is counted too (up to workers - 1
    # more), and the rest were not made. With 6 or more workers the round is too small to give up early: all 12 fail.
    from dapo_ref.reward_pool import default_workers

    w = default_workers()
    give_up = max(8, 2 * w)
    m = re.search(r"dapo-eval: error: reward = failing_mod:always failed on (\d+) of the (\d+) calls", err)
    assert m and m[1] == m[2], err
    if give_up < 12:
        assert give_up <= int(m[1]) <= give_up + w - 1 and "calls not made" in err, err
    else:
        assert int(m[1]) == 12, err
    assert not (tmp_path / "b.json").exists()
