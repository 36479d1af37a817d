"""The reward plug-in forms practitioners write (verl's per-sample `compute_score`, TRL's per-batch function, the short
form), dict results, several weighted rewards and the boxed answer format: through `score_batch`, through a training
run on the tiny model with a scripted engine (every response's verdict known), and through the real `dapo-train`
(what each form receives from the data rows)."""

import json, os, subprocess, sys
from pathlib import Path

import pytest

from dapo_ref.cli import config_from_dict
from dapo_ref.data import BOXED_TEMPLATE, make_example, prompt_token_ids
from dapo_ref.interfaces import Completion, RolloutEngine
from dapo_ref.reward import score_batch

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = r"""
import json, os
from dapo_ref.data import extract_boxed


def _log(rec):
    if os.environ.get("FORMS_LOG"):
        with open(os.environ["FORMS_LOG"], "a") as f:
            f.write(json.dumps(rec) + "\n")


def _box(text, gt):
    return 1.0 if extract_boxed(text[-300:]) == str(gt) else -1.0


def pair_boxed(response, ground_truth):
    return _box(response, ground_truth)


def verl_boxed(data_source, solution_str, ground_truth, extra_info=None):
    _log(dict(form="verl", data_source=data_source, ground_truth=ground_truth, extra_info=extra_info))
    s = _box(solution_str, ground_truth)
    return {"score": s, "acc": s > 0, "boxed": float("\\boxed{" in solution_str), "pred": "a string: not logged"}


def trl_boxed(prompts, completions, **columns):
    extras = ("completion_ids", "trainer_state")  # TRL's, given in training (not JSON: trainer_state)
    cols = {k: columns[k] for k in sorted(columns) if k not in extras}
    gs = columns["trainer_state"].global_step if "trainer_state" in columns else None
    _log(dict(form="trl", n=len(completions), prompts=prompts, columns=cols, extras=[k for k in extras if k in columns],
              global_step=gs))
    return [_box(c[0]["content"], g) for c, g in zip(completions, columns["ground_truth"])]  # TRL's chat completions


def trl_none(prompts, completions, **columns):
    return [None if len(c[0]["content"]) % 3 == 0 else 0.5 for c in completions]


def trl_sees(prompts, completions, completion_ids, trainer_state, solution, problem, **kwargs):
    _log(dict(form="trl_sees", ids=completion_ids, step=trainer_state.global_step, max=trainer_state.max_steps,
              rollout_step=trainer_state.rollout_step, solution=solution, problem=problem, kw=sorted(kwargs)))
    return [_box(c[0]["content"], s) for c, s in zip(completions, solution)]


def trl_narrow(prompts, completions, data_source, ground_truth, extra_info, ability):  # no extras taken: none given
    return [_box(c[0]["content"], g) for c, g in zip(completions, ground_truth)]


def verl_clash(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": _box(solution_str, ground_truth), "pred": 7.0, "reward": 9.0, "length": 1.0, "step": 2.0}
"""


@pytest.fixture()
def forms(tmp_path, monkeypatch):
    (tmp_path / "forms_mod.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # the server's
    monkeypatch.setenv("FORMS_LOG", str(tmp_path / "calls.jsonl"))
    (tmp_path / "calls.jsonl").touch()  # made here: a plug-in may write a file above the run's folder, not make one
    # there (verify_server.protect: the runs below are in tmp_path/run)
    return tmp_path


def boxed(gt, right: bool) -> str:
    return f"... so the answer is \\boxed{{{gt if right else int(gt) + 1}}}."


def test_each_form_scores_boxed_answers(forms):
    "+1 for the right \\boxed{}, -1 for a wrong one, by the built-in reward in boxed format and by each plug-in form."
    rows = [
        make_example(f"What is {i} + {i}?", 2 * i, data_source="boxed-set", template=BOXED_TEMPLATE, index=i)
        for i in range(3)
    ]
    rows = [r for r in rows for _ in range(2)]  # G = 2
    texts = [boxed(r.ground_truth, j % 2 == 0) for j, r in enumerate(rows)]
    want = [1.0, -1.0] * 3
    for mode in [
        "dapo-reference",
        "dapo-strict",
        "forms_mod:pair_boxed",
        "forms_mod:verl_boxed",
        "forms_mod:trl_boxed",
    ]:
        s, a, m, p = score_batch(
            texts, [r.ground_truth for r in rows], mode, 30.0, answer_format="boxed", rows=rows, return_preds=True
        )
        assert s.tolist() == want and a.tolist() == [x > 0 for x in want], mode
        assert p == [str(2 * (j // 2) + j % 2) for j in range(6)], mode  # the boxed answer read, right or wrong
    # the default format reads `Answer:` lines: none here, so every response scores -1 (as the user saw)
    assert score_batch(texts, [r.ground_truth for r in rows])[0].tolist() == [-1.0] * 6
    # by data_source: the same responses, the set's format named for its source only
    s = score_batch(texts, [r.ground_truth for r in rows], answer_format="answer_line,boxed-set=boxed", rows=rows)[0]
    assert s.tolist() == want
    # the verl form got each row's columns; the TRL form the rows' messages and columns, one per completion
    calls = [json.loads(l) for l in (forms / "calls.jsonl").read_text().splitlines()]
    verl = sorted((c["ground_truth"], c["extra_info"]["index"]) for c in calls if c["form"] == "verl")
    assert verl == sorted((r.ground_truth, r.extra_info["index"]) for r in rows)
    assert {c["data_source"] for c in calls if c["form"] == "verl"} == {"boxed-set"}
    trl = [c for c in calls if c["form"] == "trl"]
    assert sum(c["n"] for c in trl) == 6 and all(
        set(c["columns"]) == {"ability", "data_source", "extra_info", "ground_truth"} for c in trl
    )
    assert all(len(v) == c["n"] and len(c["prompts"]) == c["n"] for c in trl for v in c["columns"].values())
    assert sorted(g for c in trl for g in c["columns"]["ground_truth"]) == sorted(r.ground_truth for r in rows)
    assert all(p[0]["content"].endswith("within \\boxed{}.") for c in trl for p in c["prompts"])


def test_weighted_rewards_dict_keys_and_no_verdict(forms):
    "Two rewards with weights: the total is the weighted sum, each logged on its own; dict keys and None counted."
    rows = [make_example("What is 1 + 1?", 2, template=BOXED_TEMPLATE)] * 4
    texts = [boxed(2, True), boxed(2, False), "ab", "abc"]  # the last has length 3: trl_none gives no verdict
    s, a, m = score_batch(
        texts,
        ["2"] * 4,
        "forms_mod:verl_boxed,forms_mod:trl_none",
        30.0,
        rows=rows,
        weights="1.0,0.5",
        answer_format="boxed",
    )
    trl = [0.5, 0.5, 0.5, -1.0]  # None -> -1
    verl = [1.0, -1.0, -1.0, -1.0]
    assert s.tolist() == [v + 0.5 * t for v, t in zip(verl, trl)]  # exact: halves and integers
    assert a.tolist() == [True, False, False, False]  # the verl form's own acc, not total > 0 (0.5 - 1 < 0 anyway)
    assert m["reward_errors"] == 1
    ex = m["extra"]
    assert [e["verl_boxed"] for e in ex] == verl and [e["trl_none"] for e in ex] == trl
    assert [e["verl_boxed/boxed"] for e in ex] == [1.0, 1.0, 0.0, 0.0] and [e["trl_none/failed"] for e in ex] == [
        0,
        0,
        0,
        1,
    ]
    assert "verl_boxed/pred" not in ex[0]  # a string is not a number to log
    # acc without an `acc` key: total score > 0
    assert score_batch(texts, ["2"] * 4, "forms_mod:trl_none", 30.0)[1].tolist() == [True, True, True, False]
    # a weight on a single reward is applied, built-in or plug-in alike
    for mode in ["dapo-reference", "forms_mod:verl_boxed"]:
        s = score_batch(texts, ["2"] * 4, mode, 30.0, rows=rows, weights="0.5", answer_format="boxed")[0]
        assert s.tolist() == [0.5, -0.5, -0.5, -0.5], mode


def test_a_dict_key_named_like_a_sample_field_is_written_as_logged(forms):
    "A single plug-in's keys `pred`, `reward`, `length`, `step` go to samples.jsonl as reward/<key>, beside the fields."
    from dapo_ref.algorithm import score_groups
    from dapo_ref.eval import response_rows
    from dapo_ref.trainer import load_tokenizer, sample_rows
    import torch

    tok = load_tokenizer("tiny")
    exs = [make_example("What is 1 + 1?", 2, template=BOXED_TEMPLATE)]
    cfg = config_from_dict(
        dict(
            model="tiny",
            reward="forms_mod:verl_clash",
            answer_format="boxed",
            group_size=2,
            soft_overlong_punishment=False,
            reward_timeout=30.0,
        )
    )
    ids = [tok.encode(boxed(2, right), add_special_tokens=False) + [tok.eos_token_id] for right in (True, False)]
    comps = [Completion(0, i, "stop") for i in ids]
    groups = score_groups(comps, tok, exs, [prompt_token_ids(exs[0], tok)], [0], cfg)
    rows = sample_rows(groups, tok, exs, 3, cfg.reward)
    for r, right in zip(rows, (True, False)):
        assert (r["pred"], r["step"], r["length"]) == ("2" if right else "3", 3, len(comps[int(not right)].token_ids))
        assert r["reward"] == r["score"] == (1.0 if right else -1.0)  # the reward's own `reward` key did not replace it
        assert (r["reward/pred"], r["reward/reward"], r["reward/length"], r["reward/step"]) == (7.0, 9.0, 1.0, 2.0)
    g = groups[0]
    rows = response_rows(
        ["q"],
        ["a", "b"],
        ["2", "2"],
        g.preds,
        torch.tensor(g.acc),
        torch.tensor([[3, 4]]),
        torch.tensor([[0, 0]]),
        cfg.reward,
        g.extra,
    )
    assert [(r["pred"], r["length"], r["reward/pred"]) for r in rows] == [("2", 3, 7.0), ("3", 4, 7.0)]
    json.dumps(rows)  # one JSON line each


def test_trl_form_gets_completion_ids_trainer_state_and_its_own_column_names(forms, tmp_path):
    """What TRL's GRPOTrainer passes a reward function: the completions' token ids, the trainer state (global_step in
    optimizer steps: in step 4, 3 rollout steps done x 2 updates each = 6; max_steps 5 x 2 = 10), the dataset's columns under
    their own names (answers mapped from `solution`, problems from `problem`); a function that takes none of these
    gets none; one that asks for a column the data does not have is refused before training, naming it."""
    import pyarrow as pa, pyarrow.parquet as pq
    from dapo_ref.algorithm import score_groups
    from dapo_ref.core import InputError
    from dapo_ref.data import load_math_dataset
    from dapo_ref.reward_pool import check_plugin
    from dapo_ref.trainer import load_tokenizer

    f = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "What is 1 + 1?", "solution": "2"}]), f)
    spec = f"{f}:prompt=problem:answer=solution:answer_format=boxed"
    tok, exs = load_tokenizer("tiny"), load_math_dataset(spec, verbose=False)
    base = dict(model="tiny", train_data=spec, answer_format="boxed", group_size=2, prompts_per_step=1)
    base.update(gen_batch_size=1, mini_batch_size=1, total_steps=5, soft_overlong_punishment=False, reward_timeout=30.0)
    ids = [tok.encode(boxed(2, right), add_special_tokens=False) + [tok.eos_token_id] for right in (True, False)]
    comps = [Completion(0, i, "stop") for i in ids]
    for fn in ("trl_sees", "trl_narrow"):
        cfg = config_from_dict({**base, "reward": f"forms_mod:{fn}"})
        groups = score_groups(comps, tok, exs, [prompt_token_ids(exs[0], tok)], [0], cfg, step=4)  # 3 steps done
        assert groups[0].scores == [1.0, -1.0], fn
    calls = [json.loads(l) for l in (forms / "calls.jsonl").read_text().splitlines()]  # a call per worker's chunk
    assert {c["form"] for c in calls} == {"trl_sees"}  # trl_narrow logs nothing: it was called without the extras
    assert sorted(i for c in calls for i in c["ids"]) == sorted(ids)
    assert {(c["step"], c["max"], c["rollout_step"]) for c in calls} == {(6, 10, 3)}
    assert [x for c in calls for x in c["solution"]] == ["2", "2"]
    assert [x for c in calls for x in c["problem"]] == ["What is 1 + 1?"] * 2
    assert all(c["kw"] == ["ability", "data_source", "extra_info", "ground_truth"] for c in calls)
    with pytest.raises(InputError, match="`solution` is no column"):
        check_plugin("forms_mod:trl_sees")  # the DAPO schema: no column of that name
    assert check_plugin("forms_mod:trl_sees", ("solution", "problem")) == {"forms_mod:trl_sees": "batch"}


# ---------------------------------------------------------------- a training run whose every verdict is known


class BoxedEngine(RolloutEngine):
    "Answers every prompt with G responses alternating a right and a wrong \\boxed{} answer (prompt ids -> answer)."

    def __init__(self, tokenizer, answers):
        self.tok, self.answers = tokenizer, answers

    def generate(self, prompts, params, use_tqdm=False):
        out = []
        for q, p in enumerate(prompts):
            for j in range(params.n):
                ids = self.tok.encode(boxed(self.answers[tuple(p)], j % 2 == 0), add_special_tokens=False)
                out.append(Completion(q, ids + [self.tok.eos_token_id], "stop"))
        return out

    def load_weights(self, named_tensors):
        pass


def test_training_and_held_out_score_boxed_answers_by_every_form(forms, tmp_path):
    "One tiny run (1 step, step-0 and final evaluation) scored by the built-in reward and the three plug-in forms at once."
    from dapo_ref.trainer import Trainer, load_tokenizer
    from dapo_ref.track import read_samples

    tok = load_tokenizer("tiny")
    exs = [
        make_example(f"What is {i} + 3?", i + 3, data_source="boxed-set", template=BOXED_TEMPLATE, index=i)
        for i in range(6)
    ]
    names = ["dapo-reference", "forms_mod:pair_boxed", "forms_mod:verl_boxed", "forms_mod:trl_boxed"]
    cfg = config_from_dict(
        dict(
            model="tiny",
            reward=names,
            reward_weights=[1.0, 0.5, 0.25, 0.25],
            answer_format="boxed",
            group_size=4,
            prompts_per_step=2,
            gen_batch_size=2,
            mini_batch_size=8,
            l_max=48,
            l_cache=8,
            total_steps=1,
            eval_k=2,
            warmup_steps=0,
            save_every=0,
            samples_per_step=2,
            output_dir=str(tmp_path / "run"),
            reward_timeout=30.0,
        )
    )
    answers = {tuple(prompt_token_ids(e, tok)): e.ground_truth for e in exs}
    Trainer(cfg, exs[:4], exs[4:], tokenizer=tok, engine=BoxedEngine(tok, answers), log=None).fit()
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_acc"] for r in rows] == [0.5, 0.5]  # half of the held-out responses right, step 0 and the end
    step = rows[1]
    assert step["acc"] == 0.5 and step["reward_errors"] == step["reward_timeouts"] == 0
    for n in ["dapo-reference", "pair_boxed", "verl_boxed", "trl_boxed"]:
        assert step[f"reward/{n}"] == 0.0  # +1 and -1 alike often
    assert step["reward/verl_boxed/boxed"] == 1.0 and step["score_mean"] == 0.0
    samples = read_samples(tmp_path / "run")
    assert {s["split"] for s in samples} == {"train", "eval"} and len(samples) == 2 * 4 + 2 * (2 * 2)
    for s in samples:
        right = s["response"].endswith(f"\\boxed{{{s['ground_truth']}}}.")
        for n in ["dapo-reference", "pair_boxed", "verl_boxed", "trl_boxed"]:
            assert s[f"reward/{n}"] == (1.0 if right else -1.0), (n, s)  # as logged
        assert s["score"] == (2.0 if right else -2.0)  # 1 + 0.5 + 0.25 + 0.25, in training and held out
        assert s["pred"] == s["response"][s["response"].rfind("{") + 1 : -2]


# ---------------------------------------------------------------- the real dapo-train: what each form receives


def test_dapo_train_passes_the_rows_columns_to_each_form(forms, tmp_path):
    "verl's form gets data_source, ground_truth and extra_info of the row; TRL's the prompts and the other columns."
    from dapo_ref.tiny import tiny_splits

    out = tmp_path / "run"
    args = [
        "reward=[forms_mod:verl_boxed, forms_mod:trl_boxed]",
        "reward_weights=[1.0, 0.5]",
        "total_steps=1",
        "prompts_per_step=2",
        "gen_batch_size=2",
        "group_size=2",
        "mini_batch_size=4",
        "l_max=16",
        "l_cache=4",
        "dynamic_sampling=false",
        "eval_every=0",
        "val_before_train=false",
        "eval_k=1",
        "save_every=0",
        "samples_per_step=1",
        "reward_timeout=30",
        f"output_dir={out}",
    ]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_ref.train",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            "--threads",
            "1",
            "--quiet",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    train, held = tiny_splits(4000, 64, seed=0)
    known = {(e.data_source, e.ground_truth, json.dumps(e.extra_info, sort_keys=True)) for e in train + held}
    calls = [json.loads(l) for l in (forms / "calls.jsonl").read_text().splitlines()]
    verl = [c for c in calls if c["form"] == "verl"]
    assert len(verl) == 2 * 2 + 64  # the step's P * G responses, then the 64 held-out problems x eval_k = 1
    assert all(
        (c["data_source"], c["ground_truth"], json.dumps(c["extra_info"], sort_keys=True)) in known for c in verl
    )
    trl = [c for c in calls if c["form"] == "trl"]
    assert sum(c["n"] for c in trl) == len(verl)
    for c in trl:
        cols = c["columns"]
        rows = list(
            zip(cols["data_source"], cols["ground_truth"], (json.dumps(x, sort_keys=True) for x in cols["extra_info"]))
        )
        assert set(cols) == {"ability", "data_source", "extra_info", "ground_truth"} and set(rows) <= known
        assert all(p[-1]["role"] == "user" and "Answer:" in p[-1]["content"] for p in c["prompts"])
        assert c["extras"][:1] == ["completion_ids"]  # what TRL passes besides: the token ids, ...
    assert {tuple(c["extras"]) for c in trl} == {("completion_ids", "trainer_state")}  # ... and the trainer state,
    assert sorted({c["global_step"] for c in trl}) == [0, 1]  # TRL's global_step: 0 in step 1, 1 at the last evaluation
    # in training (not in the held-out evaluation, which runs outside a step) the trainer state
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    step = rows[-1]
    assert step["score_mean"] == pytest.approx(step["reward/verl_boxed"] + 0.5 * step["reward/trl_boxed"], abs=1e-12)
    assert step["reward/verl_boxed/boxed"] == 0.0  # the tiny policy writes `Answer:` lines, never a box


def test_a_trl_form_plugin_reading_its_own_columns_trains_and_evaluates(forms, tmp_path):
    """`train_data` and `eval_data` in another schema (`solution` holds the answers): a TRL-form plug-in asking for
    `solution` gets it in the training rounds and in the held-out evaluations alike (the evaluation at step 0 had no
    renamed columns: an error after the model had loaded)."""
    import pyarrow as pa, pyarrow.parquet as pq
    from dapo_ref.train import main

    rows = lambda lo, hi: [{"problem": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(lo, hi)]
    pq.write_table(pa.Table.from_pylist(rows(0, 8)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(8, 10)), tmp_path / "held.parquet")
    spec = lambda f: f"{tmp_path / f}:prompt=problem:answer=solution"
    args = [*("--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--threads", "1", "--quiet")]
    args += [f"train_data={spec('train.parquet')}", f"eval_data={spec('held.parquet')}", "reward=forms_mod:trl_sees"]
    args += ["total_steps=1", "prompts_per_step=2", "gen_batch_size=2", "group_size=2", "mini_batch_size=4"]
    args += [
        "l_max=8",
        "l_cache=2",
        "dynamic_sampling=false",
        "eval_k=1",
        "save_every=0",
        f"output_dir={tmp_path / 'r'}",
    ]
    assert main(args) == 0
    calls = [json.loads(l) for l in (forms / "calls.jsonl").read_text().splitlines()]
    held = {"What is 8 + 1?", "What is 9 + 1?"}
    evals = [c for c in calls if set(c["problem"]) <= held]
    train = [c for c in calls if not set(c["problem"]) & held]
    assert evals and train and len(evals) + len(train) == len(calls)
    assert sorted({c["step"] for c in evals}) == [0, 1]  # global_step before and after the step (2 x 2 / 4 = 1 update)
    assert sorted(x for c in evals for x in c["solution"]) == ["10", "10", "9", "9"]  # two problems, two evaluations
