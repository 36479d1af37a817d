"""Nothing silent, round four (#60): each case ends in one line naming the input, the cause and the fix, before the
model loads where it can be known then, and leaves nothing behind; each failed on the code before (a symptom for
the cause, a traceback, a silent run, a misleading word). In process (`dapo_ref.train.main`), on the tiny recipe."""

import json, os
from pathlib import Path

import pytest

from dapo_ref.data import make_example, save_math_dataset
from dapo_ref.runs import read_metrics
from dapo_ref.train import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--threads", "1", "--quiet"]
# a step of 2 groups from rounds of 4 prompts (the default step is 16 of 32): the resume tests read files, not learning
SMALL = ["prompts_per_step=2", "gen_batch_size=4", "mini_batch_size=16"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_model_load(monkeypatch):
    "Fails the test if the run reads its data or model: the refusal must come first."
    import dapo_ref.trainer as trainer

    def load_splits(cfg):
        raise AssertionError("the data was read before the refusal")

    monkeypatch.setattr(trainer, "load_splits", load_splits)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- the cause, not the symptom
@pytest.mark.parametrize(
    "override, cause",
    [
        (["l_max=1", "l_cache=0"], "every one of the 8 responses reached l_max = 1 tokens without ending"),
        (
            ["top_k=1"],
            "every group's group_size = 4 responses were identical (temperature = 1.0, top_p = 1.0, top_k = 1",
        ),
        (["answer_format=boxed"], "no response had an answer the reward reads (answer_format = boxed)"),
    ],
)
def test_an_unfillable_batch_names_its_cause_first(tmp_path, capsys, override, cause):
    """Dynamic sampling cannot fill the batch because of a setting, not the data: the rounds' statistics say which
    (was: "found 0 of the groups it needs ... make the training data easier" alone). Rounds of 2 prompts x 4, 1 round."""
    small = ["total_steps=1", "prompts_per_step=2", "gen_batch_size=2", "group_size=4", "mini_batch_size=8"]
    args = [*small, "max_num_gen_batches=1", "eval_every=0", "val_before_train=false", f"output_dir={tmp_path / 'r'}"]
    assert main([*RECIPE, *args, *override]) == 1
    err = one_line(capsys)
    assert err.startswith(f"dapo-train: error: {cause}"), err
    assert "dynamic sampling found" in err  # the buffer's numbers follow the cause


# ---------------------------------------------------------------- tracebacks before
def test_an_output_dir_that_is_a_dangling_link_is_refused_first(tmp_path, capsys, no_model_load):
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "gone")
    assert main([*RECIPE, f"output_dir={link}"]) == 2
    err = one_line(capsys)
    assert f"output_dir = {link}: {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in err, err
    assert link.is_symlink() and not (tmp_path / "gone").exists()  # nothing made, nothing changed


def test_an_output_dir_under_a_dangling_link_is_refused_first(tmp_path, capsys, no_model_load):
    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    assert main([*RECIPE, f"output_dir={tmp_path / 'runs' / 'x'}"]) == 2
    assert f"{tmp_path / 'runs'} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in one_line(capsys)


def test_an_output_dir_name_past_the_file_systems_limit_is_refused_first(tmp_path, capsys, no_model_load):
    out = tmp_path / ("r" * 300)
    assert main([*RECIPE, f"output_dir={out}"]) == 2
    assert "is 300 bytes, and this file system takes names of at most 255" in one_line(capsys)


def test_resume_over_a_metrics_line_that_is_no_json_names_the_line(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*RECIPE, *SMALL, "total_steps=1", "eval_every=0", "save_every=1", "eval_k=1", f"output_dir={out}"]
    assert main(args) == 0
    capsys.readouterr()
    m = out / "metrics.jsonl"
    m.write_text(m.read_text() + '{"step": 2, "acc": 0.5\n')  # a torn write
    before = m.read_bytes()
    assert main([*args, "--resume"]) == 2
    err = one_line(capsys)
    assert f"{m}: line 3 is not a JSON row" in err and f"mv {m} {m}.bad" in err, err
    assert m.read_bytes() == before


def test_resume_after_a_torn_last_metrics_line_goes_on_and_keeps_it(tmp_path, capsys):
    "A write killed half way leaves a last line without its newline: the resume keeps it aside, not refuses."
    out = tmp_path / "run"
    args = [*RECIPE, *SMALL, "eval_every=0", "save_every=1", "eval_k=1", "val_before_train=false", f"output_dir={out}"]
    assert main([*args, "total_steps=1"]) == 0
    m = out / "metrics.jsonl"
    m.write_text(m.read_text() + '{"step": 2, "ac')  # no newline: the writer was killed here
    assert main([*args, "total_steps=2", "--resume"]) == 0, capsys.readouterr().err
    assert read_metrics(m)[-1]["step"] == 2  # the resumed step, after the rows up to the checkpoint
    kept = [json.loads(l) for l in (out / "metrics.dropped.jsonl").read_text().splitlines()]
    assert kept[-1]["torn_line"] == '{"step": 2, "ac'


def test_dapo_data_into_a_folder_it_cannot_write_is_one_line(capsys):
    from dapo_ref.datasets import main as dapo_data

    with pytest.raises(SystemExit) as e:
        dapo_data(["--out", "/proc/dapo-data", "--only", "aime-2024"])
    assert e.value.code == 2
    assert "--out /proc/dapo-data: cannot write there" in one_line(capsys)


# ---------------------------------------------------------------- silent acceptances before
def test_resume_where_there_is_no_run_is_refused(tmp_path, capsys, no_model_load):
    "Was: 'resume: no checkpoint ...; starting from scratch', a new run, exit 0."
    assert main([*RECIPE, f"output_dir={tmp_path / 'never'}", "--resume"]) == 2
    assert "--resume: " in (err := one_line(capsys)) and "holds no run" in err and "drop --resume" in err, err


def test_a_training_set_smaller_than_a_step_is_refused(tmp_path, capsys):
    data = save_math_dataset([make_example(f"What is {i} + 1?", i + 1) for i in range(3)], tmp_path / "three.jsonl")
    assert main([*RECIPE, f"train_data={data}", "prompts_per_step=8", f"output_dir={tmp_path / 'r'}"]) == 2
    assert "holds 3 problems, fewer than prompts_per_step = 8" in one_line(capsys)


def test_held_out_problems_that_are_all_trained_on_are_refused(tmp_path, capsys):
    data = save_math_dataset([make_example(f"What is {i} + 1?", i + 1) for i in range(40)], tmp_path / "d.jsonl")
    assert main([*RECIPE, f"train_data={data}", f"eval_data={data}", f"output_dir={tmp_path / 'r'}"]) == 2
    assert "all 40 held-out problems are in train_data as well" in one_line(capsys)


def test_a_warm_up_longer_than_the_run_is_said(tmp_path, capsys):
    args = ["total_steps=1", "warmup_steps=5", "eval_every=0", "val_before_train=false", f"output_dir={tmp_path / 'r'}"]
    assert main([*RECIPE, *SMALL, *args]) == 0
    out = capsys.readouterr().out
    assert "warmup_steps = 5 > total_steps = 1: the learning rate rises over the whole run and never reaches" in out


# ---------------------------------------------------------------- words that misled
def test_a_yaml_merge_key_is_read_as_yaml_merges(tmp_path, capsys):
    "`<<: *base` was called a syntax error ('fix indentation'); a key given twice is still refused."
    from dapo_ref.cli import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("<<: &defaults {lr: 3.0e-6, group_size: 4}\ngroup_size: 8\n")
    cfg = load_config(recipe)
    assert (cfg.lr, cfg.group_size) == (3.0e-6, 8)  # as YAML merges: the key given here wins over the merged one
    recipe.write_text("lr: 1.0e-6\nlr: 2.0e-6\n")
    with pytest.raises(Exception, match="key 'lr' appears twice"):
        load_config(recipe)


@pytest.mark.parametrize("kind", ["null", "fifo"])
def test_a_device_or_a_fifo_as_train_data_is_called_what_it_is(tmp_path, capsys, kind):
    "Was: '/dev/null is absent'."
    path = "/dev/null" if kind == "null" else tmp_path / "pipe.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    assert main([*RECIPE, f"train_data={path}", f"output_dir={tmp_path / 'r'}"]) == 2
    err = one_line(capsys)
    assert f"{path} is {'a device or socket' if kind == 'null' else 'a FIFO (named pipe)'}, not a file" in err, err


def test_dapo_eval_of_weights_that_do_not_fit_the_config_is_one_line(tmp_path, capsys):
    """A Llama-style checkpoint (no attention biases, a weight Qwen2 has no place for) under a Qwen2 config.json: was
    evaluated with the biases left random, transformers' table the only word of it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from dapo_ref.eval_cli import main as dapo_eval
    from dapo_ref.tiny_ship import ensure_tiny_model

    model = tmp_path / "llama-as-qwen2"
    shutil.copytree(ensure_tiny_model(verbose=False), model)
    w = {k: v for k, v in load_file(model / "model.safetensors").items() if not k.endswith("bias")}
    save_file({**w, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, model / "model.safetensors")
    data = save_math_dataset([make_example("What is 1 + 1?", 2)], tmp_path / "one.jsonl")
    out = tmp_path / "results.json"
    args = ["--model", str(model), "--data", str(data), "--k", "1", "--max-tokens", "2", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        dapo_eval(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' "Loading weights" bar
    assert "cannot load its weights (the weights do not fit Qwen2ForCausalLM (config.json): 6 missing, left" in err, err
    assert "1 unused (e.g. model.layers.0.mlp.extra.weight)" in err and "use the config.json saved" in err, err
    assert not out.exists()


def test_a_reward_plugin_cannot_write_the_runs_files(tmp_path, capsys, monkeypatch):
    """A plug-in that appends to the run's metrics.jsonl (was: its lines landed there, beside the run's rows): its
    server holds no right to write beneath the run's folder (Landlock), so the call fails, the run stops in one line
    naming the plug-in and PermissionError, and metrics.jsonl holds the run's rows alone."""
    from dapo_ref.verify_server import landlock_abi

    if not landlock_abi():
        pytest.skip("this kernel has no Landlock (Linux >= 5.13): the run says so instead (a note line)")
    out = tmp_path / "run"
    (tmp_path / "sneaky.py").write_text(
        "def score(response, ground_truth):\n"
        f"    with open({str(out / 'metrics.jsonl')!r}, 'a') as f:\n"
        '        f.write(\'{"step": 99, "acc": 1.0}\\n\')\n'
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = ["reward=sneaky:score", "total_steps=1", "eval_every=0", "val_before_train=false", f"output_dir={out}"]
    assert main([*RECIPE, *args]) == 1
    err = one_line(capsys)
    assert "reward = sneaky:score failed on" in err and "PermissionError" in err, err
    assert '"step": 99' not in (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else True


def test_a_long_generation_says_how_far_it_got(monkeypatch):
    "Was: after the memory estimate, nothing until the end (or the machine's limit). A line every PROGRESS_S seconds."
    import dapo_ref.rollout as rollout
    from dapo_ref.interfaces import SamplingParams
    from dapo_ref.policy import load_policy

    model, tok = load_policy("tiny")
    said = []
    engine = rollout.HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch_size=2)
    engine.log = said.append
    monkeypatch.setattr(rollout, "PROGRESS_S", 0.0)  # every chunk
    prompts = [tok.encode(f"{i} + 1 =") for i in range(3)]
    engine.generate(prompts, SamplingParams(n=2, max_tokens=3, seed=0))
    assert [s.split(",")[0] for s in said] == ["generating: 2 of 6 responses", "generating: 4 of 6 responses"]
