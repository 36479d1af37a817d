"Ablation (dapo-ablate) end to end on the --quick base: the table, per-run caching, resuming an interrupted ablation."

import json, os, shutil, subprocess, sys, time
from pathlib import Path

import pytest

from dapo_ref.ablation import ROWS, row_switches
from dapo_ref.ablation_table import COLUMNS, FIGURES
from dapo_ref.ablate import main

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def _cmd(out, *extra):
    return [PY, "-m", "dapo_ref.ablate", "--quick", "--seeds", "0", "--out", str(out), *extra]


def _snapshot(d: Path) -> dict:
    "Every file under `d`: its bytes and modification time (ns)."
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def _meta(out):
    return json.loads((out / "table.json").read_text())["meta"]


def quick_testbed(name: str):
    "The folder --quick trains on for a testbed base: its 10-step build (`studies.testbed_base`)."
    from dapo_ref.testbeds import TESTBEDS, testbed_model

    return testbed_model(**{**TESTBEDS[name], "steps": 10}, log=None)


def test_cli_errors(capsys):
    for argv, msg in [
        (["--rows", "3-clip-hihger"], "rows are: 1-grpo"),
        (["--base", "recipes/no-such.yaml"], "no recipe file at recipes/no-such.yaml"),
        (["--threads", "-1"], "--threads -1 is out of range: allowed >= 1"),
        (["--target", "nan"], "--target nan is out of range"),
        (["lr=inf"], "lr = inf is not a finite number"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("dapo-ablate: error: ") and msg in err and err.count("\n") == 1, err


def test_default_base_from_another_directory(tmp_path, monkeypatch, capsys):
    "The default --base resolves in the checkout, not the working directory (a bad flag stops the command after it loaded)."
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["--jobs", "0"])
    assert "--jobs 0 is out of range" in capsys.readouterr().err  # the base loaded; the flag is what failed
    assert not any(tmp_path.iterdir())  # nothing written


def test_python_m_help():
    r = subprocess.run([PY, "-m", "dapo_ref.ablate", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and "--quick" in r.stdout and "--seeds" in r.stdout


def test_clip_higher_testbed_clips_bind(monkeypatch):
    """The clip-higher study relies on the clip acting: with 16 updates per rollout step on the shipped warm start,
    tokens are up-clipped in several updates of the first step; with the Table 1 base's 2 updates, none are."""
    import torch
    from dataclasses import replace
    from dapo_ref.cli import load_config
    from dapo_ref.studies import STUDIES, clip_probe

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    base = replace(load_config(STUDIES["clip-higher"]["base"]), eps_high=0.2, seed=0)
    p16, p2 = clip_probe(base), clip_probe(replace(base, mini_batch_size=64))  # 128 responses / 64 = 2 updates
    assert (p16["updates"], p2["updates"]) == (16, 2)
    # A seeded probe (seed 0, one thread): measured clipfrac_high 7.3e-3, 5 of 16 updates clipping, 18 up-clipped
    # tokens; with 2 updates exactly 0. Another CPU can change sampled tokens through logit ulps, so the thresholds are
    # presence checks well below the measured values (2e-3: 3.6x below; 3 updates; 5 tokens: 3.6x below), not fits.
    assert p16["clipfrac_high"] > 2e-3, p16  # the Table 1 demo averages 2e-4 per step
    assert p16["updates_clipping"] >= 3 and p16["up_clipped_tokens"] >= 5, p16  # not one update's accident
    assert p2["clipfrac_high"] < p16["clipfrac_high"] / 10, (p2, p16)


def test_study_cli_errors(capsys):
    for argv, msg in [
        (["--study", "clip-hihger"], "--study clip-hihger is not a study; studies are: clip-higher"),
        (["--study", "clip-higher", "--rows", "1-grpo"], "give one or the other"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("dapo-ablate: error: ") and msg in err and err.count("\n") == 1, err


def _testbed_samples(n_problems=64, k=4, l_max=64, seed=0):
    "k responses at T = 1 to each of the first n_problems held-out problems, cut at l_max: (response ids, text, example)."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from dapo_ref.testbeds import testbed_model
    from dapo_ref.data import prompt_token_ids
    from dapo_ref.trainer import load_splits
    from dapo_ref.cli import load_config

    path = testbed_model(log=None)
    tok, model = (
        AutoTokenizer.from_pretrained(path),
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
    )
    torch.manual_seed(seed)
    out = []
    for ex in load_splits(load_config(ROOT / "recipes/ablation-testbed.yaml"))[1][:n_problems]:
        p = torch.tensor([prompt_token_ids(ex, tok)] * k)
        with torch.no_grad():
            o = model.generate(
                p,
                attention_mask=torch.ones_like(p),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=l_max,
                pad_token_id=tok.eos_token_id,
            )
        for row in o[:, p.shape[1] :].tolist():
            ids = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            out.append((ids, tok.decode(ids, skip_special_tokens=True), ex))
    return out, tok.eos_token_id


def test_testbed_has_what_the_length_studies_act_on():
    """The token-loss and overlong studies rely on the testbed policy producing, at L_max = 96, runaway responses (loops
    and runaway working: long, wrong, never ending), while every correct solution ends before L_max - L_cache = 80,
    as the paper sets the budget (Section 3.4): truncation and Eq. 13 reach only the runaways."""
    import torch
    from dapo_ref.cli import load_config
    from dapo_ref.reward import score_response

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "recipes/ablation-testbed.yaml")
    assert (cfg.model, cfg.l_max, cfg.l_cache) == ("tiny-testbed", 96, 16)
    samples, eos = _testbed_samples(l_max=cfg.l_max)
    cut = [(ids, t) for ids, t, _ in samples if eos not in ids]
    assert all(len(ids) == cfg.l_max for ids, _ in cut)
    lines = [t.strip().split("\n") for _, t in cut]
    loops = sum(any(a == b for a, b in zip(ls, ls[1:])) for ls in lines)
    finished = [(ids, t, ex) for ids, t, ex in samples if eos in ids]
    correct = [len(ids) for ids, t, ex in finished if score_response(t, ex.ground_truth, mode=cfg.reward)["acc"]]
    n = len(samples)
    print(
        f"{n} samples: {len(cut)} cut, {loops} loops, {len(finished)} finished, {len(correct)} correct (max {max(correct)})"
    )
    # measured (seed 0): 256 samples, 60 cut (36 exact loops, the rest runaway working), 196 finished, 32 correct of at
    # most 54 tokens. The sampling is seeded, so on one machine the counts are fixed; another CPU can change logits by
    # ulps and so the draws. Bounds >= 4 binomial standard errors below the measured fractions, se = sqrt(p (1-p) / 256):
    # cut 0.234 (se 0.026): 0.12 is 4.4 se below; loops 0.141 (se 0.022): 0.05 is 4.1 se below; finished 0.766
    # (se 0.026): 0.6 is 6.3 se below.
    assert len(cut) / n > 0.12, (len(cut), n)  # long responses for the token-level loss and the filter to act on
    assert loops / n > 0.05, (loops, n)  # among them, exact repetition
    assert len(finished) / n > 0.6
    assert correct and max(correct) < cfg.l_max - cfg.l_cache, correct  # sound answers fit: the budget is the paper's


@pytest.mark.slow
def test_table_quick_interrupted_resumed_and_cached(tmp_path):
    """The testbed's Table 1 on the --quick base (6 rows, one seed: the smallest table, and the first part of --all),
    interrupted after its first two runs; then (1) the same command resumes it: finished runs reused, the rest trained,
    table and figures written; (2) a third invocation reuses every run; (3) another base config is trained again.
    (Until #57 this rode on a whole `--all --quick` launch, 21 runs; the parts of --all: the study test and
    `test_all_runs_every_part_then_mechanisms` below.)"""
    from dapo_ref.ablate import TESTBED_TARGET

    table_dir = tmp_path / "testbed"
    cmd = _cmd(table_dir, "--base", "recipes/ablation-testbed.yaml", "--target", str(TESTBED_TARGET))
    argv = cmd[3:]  # the same arguments, for `main` in this process
    # 1. interrupted after its first two runs finished
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    try:
        while len(list(table_dir.glob("runs/*/seed-0/result.json"))) < 2:
            assert p.poll() is None, "the ablation ended before it could be interrupted"
            # a hang guard, not a speed claim: a --quick run takes ~3 s; 600 s only catches one that never finishes
            assert time.time() - t0 < 600, "no run finished within 600 s"
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait()
    finished = len(list(table_dir.glob("runs/*/seed-0/result.json")))
    assert 2 <= finished < 6

    # 2. the same command again resumes: the finished runs are reused, the rest are trained, the table is written
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)  # hang guard
    assert r.returncode == 0, r.stderr[-2000:]
    m = _meta(table_dir)
    assert m["runs"] == 6 and m["cached_runs"] == finished and m["quick"] and m["seeds"] == [0]
    # the testbed table ran on the 10-step testbed folder (--quick), not the full build
    assert m["base"]["model"] == str(quick_testbed("tiny-testbed")), m["base"]["model"]
    table = json.loads((table_dir / "table.json").read_text())["table"]
    assert [t["row"] for t in table] == [r[0] for r in ROWS]
    assert all(t["n_seeds"] == 1 for t in table)
    for t in table:
        assert 0.0 <= t["acc_end"] <= 1.0 and t["gen_rounds"] >= 1.0 and t["resp_len"] > 0
    assert table[-1]["gen_rounds"] >= 1.0 and all(t["gen_rounds"] == 1.0 for t in table[:-1])  # only row 6 resamples
    md = (table_dir / "table.md").read_text().splitlines()
    assert md[0].count("|") == len(COLUMNS) + 1 and len(md) == 2 + 6
    for c in ("held-out avg@k end", "updates to", "entropy", "resp len", "truncated", "gen rounds/step"):
        assert c in md[0]
    for f in FIGURES:
        assert (table_dir / f).stat().st_size > 1000, f
    for row, _, _ in ROWS:  # every run keeps its metrics and config, and no weights or checkpoints
        d = table_dir / "runs" / row / "seed-0"
        assert (d / "metrics.jsonl").exists() and (d / "config.yaml").exists()
        assert not (d / "checkpoints").exists() and not (d / "final").exists()
        cfg = json.loads((d / "result.json").read_text())["key"]["config"]
        assert {k: cfg[k] for k in row_switches(row)} == row_switches(row)

    # 3. a third invocation reuses every run: none is trained again. A trained run rewrites its folder (key.json, lock,
    # metrics.jsonl, result.json with new timings), so every file under runs/ unchanged, bytes and mtime, proves reuse
    # without timing anything
    table_argv = [*argv, "--no-figures"]
    before = _snapshot(table_dir / "runs")
    assert main(table_argv) == 0
    m3 = _meta(table_dir)
    assert m3["cached_runs"] == 6 and m3["runs"] == 6
    after = _snapshot(table_dir / "runs")
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before), sorted(
        k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
    )
    # 4. a different base config is not served from the cache
    assert main(["--rows", "1-grpo", *table_argv, "lr=1e-4"]) == 0
    assert _meta(table_dir)["cached_runs"] == 0


@pytest.mark.slow
def test_study_quick_cached_from_study_json(tmp_path):
    """The smallest study (clip-higher-testbed: 2 arms, one seed) on the --quick base: its arms, the --quick overrides,
    its figures; run again with its run folders deleted, it reuses both runs from study.json alone (the committed
    cache keeps only that file); another base config is trained again."""
    from dapo_ref.ablate import mechanism_table
    from dapo_ref.studies import STUDY_FIGURES

    out = tmp_path / "clip-higher-testbed"
    study_argv = ["--quick", "--study", "clip-higher-testbed", "--seeds", "0", "--out", str(out)]
    assert main(study_argv) == 0
    s = json.loads((out / "study.json").read_text())
    assert s["meta"]["runs"] == 2 and s["meta"]["cached_runs"] == 0 and s["meta"]["date"]
    assert s["meta"]["command"] == "dapo-ablate " + " ".join(study_argv)
    assert [a[0] for a in s["arms"]] == ["eps-high-0.20", "eps-high-0.28"]
    for arm, eps in (("eps-high-0.20", 0.2), ("eps-high-0.28", 0.28)):
        cfg = s["runs"][arm]["0"]["key"]["config"]
        assert cfg["eps_high"] == eps and cfg["mini_batch_size"] == 1 and cfg["seed"] == 0
        assert cfg["model"] == str(quick_testbed("tiny-testbed"))  # --quick: the 10-step testbed, not the full build
        steps = [m for m in s["runs"][arm]["0"]["metrics"] if m.get("step", 0) > 0]
        assert [m["grad_updates"] for m in steps] == [16, 32]  # 16 responses, 16 updates per step
    assert "entropy, mean over the run" in (out / "study.md").read_text()
    for f, *_ in STUDY_FIGURES["clip-higher-testbed"]:
        assert (out / f).stat().st_size > 1000, f
    # mechanisms.md's rows from a one-seed study: no standard error, so never "separated" (--all --quick builds it so)
    rows, md = mechanism_table(tmp_path)
    assert rows and all(r["study"] == "clip-higher-testbed" and not r["separated"] for r in rows), rows
    assert md.count("\n") == 1 + len(rows) and all(r["technique"] in md for r in rows)
    shutil.rmtree(out / "runs")
    assert main([*study_argv, "--no-figures"]) == 0
    s2 = json.loads((out / "study.json").read_text())
    assert s2["meta"]["cached_runs"] == 2 and s2["summaries"] == s["summaries"]
    assert main([*study_argv, "--no-figures", "lr=1e-4"]) == 0
    assert json.loads((out / "study.json").read_text())["meta"]["cached_runs"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("study, model", [("clip-higher-guesser", "tiny-guesser"), ("dynamic-sampling", "tiny")])
def test_quick_study_on_each_other_base(tmp_path, study, model):
    """The studies of --all stand on three bases: the testbed (the two tests above), the guesser testbed and Table 1's
    tiny model. One study on each of the other two, --quick, one seed: it runs (the guesser's 10-step testbed is built
    here), on that base, and writes its study and figures. The other studies differ from these only in the switches
    Table 1's rows set, which the table test above trains on the same testbed."""
    from dapo_ref.studies import STUDY_FIGURES

    out = tmp_path / study
    assert main(["--quick", "--study", study, "--seeds", "0", "--out", str(out)]) == 0
    s = json.loads((out / "study.json").read_text())
    assert s["meta"]["runs"] == 2 and s["meta"]["quick"] and f"--study {study}" in s["meta"]["command"]
    want = "tiny" if model == "tiny" else str(quick_testbed(model))
    assert all(r["0"]["key"]["config"]["model"] == want for r in s["runs"].values()), s["runs"]
    for f, *_ in STUDY_FIGURES[study]:
        assert (out / f).stat().st_size > 1000, f


def test_all_runs_every_part_then_mechanisms(tmp_path, monkeypatch):
    """`dapo-ablate --all --quick`: every part of ALL in order, each with one seed (--quick), its own recipe, --quick,
    the testbed target for the table and the command line; then mechanisms.md over the parts' study.json. The parts
    themselves are the two tests above (a table and a study, trained for real); here they are recorded, and each
    study part's study.json is the committed one (benchmarks/ablation): mechanisms.md is built from real studies, and
    each study's figures are drawn by `plot_study` from its committed runs' metrics."""
    from dapo_ref import ablate
    from dapo_ref.ablate import ALL, MECHANISMS, TESTBED_TARGET
    from dapo_ref.studies import STUDIES, STUDY_FIGURES, plot_study
    from dapo_ref.testbeds import TESTBEDS
    from dapo_ref.cli import load_config

    calls = []

    def part(kind):
        def run(name, seeds, *args, **kw):
            out = Path(args[1] if kind == "table" else args[0])
            assert kind == "study" or args[0] is None  # the table part: every row
            calls.append((kind, name, tuple(seeds), out.name, kw["quick"], kw.get("target"), kw["command"]))
            if kind == "study":  # the committed study: its study.json, and its figures drawn from its runs' metrics
                out.mkdir(parents=True)
                shutil.copy(ROOT / "benchmarks/ablation" / out.name / "study.json", out / "study.json")
                runs = json.loads((out / "study.json").read_text())["runs"]
                if kw["figures"]:
                    plot_study(name, {a: [r["metrics"] for r in by_seed.values()] for a, by_seed in runs.items()}, out)
            return dict(meta=dict(runs=len(seeds), cached_runs=0), markdown="")

        return run

    monkeypatch.setattr(ablate, "run_ablation", part("table"))
    monkeypatch.setattr(ablate, "run_study", part("study"))
    out = tmp_path / "abl"
    assert main(["--all", "--quick", "--out", str(out)]) == 0
    cmd = f"dapo-ablate --all --quick --out {out}"
    assert calls == [
        (kind, name, seeds[:1], folder, True, TESTBED_TARGET if kind == "table" else None, cmd)
        for kind, name, seeds, folder in ALL
    ]
    md = (out / "mechanisms.md").read_text()
    for tech, *_ in MECHANISMS:
        assert tech in md
    assert cmd in md
    for kind, name, _, folder in ALL:  # every study's figures, from real runs' metrics (every panel's metric read)
        for f, *_ in STUDY_FIGURES.get(name, []) if kind == "study" else []:
            assert (out / folder / f).stat().st_size > 1000, (folder, f)
    # each study's base: the dynamic-sampling studies on Table 1's tiny base, every other on a testbed (which --quick
    # replaces by the 10-step testbed: the study test above)
    for kind, name, _, _ in ALL:
        if kind == "study":
            model = load_config(STUDIES[name]["base"]).model
            assert (model == "tiny") == name.startswith("dynamic-sampling") and (model == "tiny" or model in TESTBEDS)


def test_all_refuses_a_part(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--all", "--study", "overlong"])
    assert e.value.code == 2 and "--all runs every part" in capsys.readouterr().err


def test_rows_add_one_switch_each():
    "Row 1 sets all six switches; each later row changes exactly what it adds (row 4 two: punishment on, filter off)."
    from dapo_ref.ablation import SWITCHES
    from dapo_ref.core import DAPOConfig

    assert set(row_switches("1-grpo")) == set(SWITCHES)
    for (a, _, _), (b, _, add) in zip(ROWS, ROWS[1:]):
        diff = {k for k in SWITCHES if row_switches(a)[k] != row_switches(b)[k]}
        assert diff == set(add) and len(diff) == (2 if b == "4-soft-punish" else 1)
    assert row_switches("6-dynamic-sampling") == dict(
        eps_low=0.2,
        eps_high=0.28,
        loss_agg="token-mean",
        overlong_filter=False,
        soft_overlong_punishment=True,
        dynamic_sampling=True,
    )
    assert row_switches("6-dynamic-sampling") == {k: getattr(DAPOConfig(), k) for k in SWITCHES}
    with pytest.raises(ValueError, match="rows are: 1-grpo"):
        row_switches("7-magic")


def test_the_soft_punishment_study_switches_it_alone():
    """Table 1's row 4 adds the soft punishment and drops the overlong filter at once, so rows 3 -> 4 cannot credit
    either; the soft-punishment study's arms are row 4 with and without Eq. 13: the only setting that differs."""
    from dapo_ref.core import DAPOConfig
    from dapo_ref.studies import STUDIES, study_config

    base = DAPOConfig()
    (a, _, _), (b, _, _) = STUDIES["soft-punishment"]["arms"]
    ca, cb = (study_config(base, "soft-punishment", arm, 0, "x") for arm in (a, b))
    diff = {f for f in vars(ca) if getattr(ca, f) != getattr(cb, f) and f != "output_dir"}
    assert diff == {"soft_overlong_punishment"} and (ca.soft_overlong_punishment, cb.soft_overlong_punishment) == (
        False,
        True,
    )
    assert cb.overlong_filter is False and {k: getattr(cb, k) for k in row_switches("4-soft-punish")} == dict(
        row_switches("4-soft-punish")
    )
