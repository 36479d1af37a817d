"""README.md's command lines run as written, in order, on a machine that ran the lines above them.

Every line of the README's ```bash blocks is walked as a reader on a fresh clone types it, in a scratch folder that
holds the repository's recipes: `make` names a target of the Makefile; `source .venv/bin/activate` puts the venv's
commands on PATH, and a `dapo-*` command before it fails (a fresh shell does not have them); `echo ... > f` writes f;
`dapo-data` runs its real argument parsing and output-path checks, with the hub fetch replaced by a small file of the
same schema written where the real one would be; `dapo-train` (alone, under torchrun or the deepspeed launcher) parses
its arguments, loads the recipe with the overrides, resolves `train_data` and `eval_data` through the trainer's own
`load_splits` against the files the lines above wrote (a hub dataset is read from a small stand-in, as the network is
not here), loads a reward plug-in as the run would (PYTHONPATH included), and asks of the machine what `check_run`
asks (vLLM installed by a line above for rollout_backend vllm, flash-attn for flash attention); a run folder is not
reused within a block without --resume / --overwrite; `dapo-eval` parses its arguments and resolves `--data`, and a
local `--model` must be a run's `final/` written above; `dapo-plan` runs. What needs a GPU or the network is checked
this way, by its argument parsing and the files it names; nothing is trained, fetched or generated."""

import contextlib, io, re, shlex, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_lines(text: str) -> list[list[str]]:
    "The logical lines of each ```bash block (continuations joined, comment-only lines dropped)."
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [re.sub(r"\\\n\s*", " ", b).splitlines() for b in blocks]
    return [[l for l in b if l.strip() and not l.lstrip().startswith("#")] for b in lines]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def extras() -> set[str]:
    return set(re.findall(r"^(\w+)_requirements\s*=", (ROOT / "settings.ini").read_text(), re.M))


class Reader:
    "A fresh clone's shell in `cwd`: what the lines so far made (the venv, extras, files, run folders), and what failed."

    def __init__(self, cwd: Path, monkeypatch):
        self.cwd, self.mp = cwd, monkeypatch
        self.venv = self.active = False
        self.installed: set[str] = set()  # extras and packages the lines installed
        self.made: set[str] = set()  # paths a command wrote that are not written here (runs' final/, results, _docs)
        self.runs: set[str] = set()  # run folders of this block
        self.problems: list[str] = []

    def fail(self, line: str, why: str):
        self.problems.append(f"{line[:110]}\n    -> {why}")

    def run(self, line: str):
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            k, _, v = words.pop(0).partition("=")
            env[k] = v
        cmd, args = words[0], words[1:]
        if cmd == "make":
            self.make(line, args[0])
        elif cmd == "source":
            if args != [".venv/bin/activate"] or not self.venv:
                return self.fail(line, "sources a venv that no line above made")
            self.active = True
        elif cmd == "echo" and ">" in args:
            (self.cwd / args[args.index(">") + 1]).write_text(args[0] + "\n")
        elif cmd == "pip":
            self.pip(line, args)
        elif cmd in ("python", "python3"):
            self.python(line, args)
        elif cmd == "torchrun":
            self.dapo(line, args[args.index("--no-python") + 1 :], env)
        elif cmd == "deepspeed":
            i = args.index("--module")
            assert args[i + 1] == "dapo_ref.train", line
            self.dapo(line, ["dapo-train", *args[i + 2 :]], env)
        elif cmd == "sbatch":
            if not (ROOT / args[0]).is_file():
                self.fail(line, f"{args[0]} does not exist")
        elif cmd.startswith("dapo-"):
            self.dapo(line, words, env)
        else:
            self.fail(line, f"{cmd}: a command this test does not know; teach it, so that the line is checked")

    def make(self, line: str, target: str):
        if target not in make_targets():
            return self.fail(line, f"the Makefile has no target {target}")
        if target in ("demo", "test", "install", "lab"):
            self.venv = True
        if target == "test":
            self.installed.add("dev")  # tensorboard, wandb: the dev extra
        if target == "docs":
            self.made.add("_docs")

    def pip(self, line: str, args: list[str]):
        if not self.active:
            return self.fail(line, "pip outside the venv installs into another Python")
        for a in (a for a in args[1:] if not a.startswith("-")):
            if m := re.fullmatch(r"\.\[([\w,]+)\]", a):  # this package with extras: -e ".[scale]"
                if unknown := set(m.group(1).split(",")) - extras():
                    self.fail(line, f"settings.ini has no extra {sorted(unknown)}")
                self.installed.update(m.group(1).split(","))
            else:  # a package: flash-attn
                self.installed.add(a)

    def python(self, line: str, args: list[str]):
        if args[:2] == ["-m", "http.server"]:
            if args[args.index("-d") + 1] not in self.made:
                self.fail(line, "serves a folder that no line above made")
        elif not (ROOT / args[0]).is_file():
            self.fail(line, f"{args[0]} does not exist")

    def dapo(self, line: str, words: list[str], env: dict):
        if not self.active and not words[0].startswith(".venv/bin/"):
            self.fail(line, f"{words[0]} is not on PATH here: the venv is not active (source .venv/bin/activate)")
        prog, args = words[0].rsplit("/", 1)[-1], words[1:]
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                getattr(self, prog.replace("-", "_"))(line, args, env)
        except SystemExit as e:
            self.fail(line, f"exit {e.code}: {out.getvalue().strip()[-300:]}")
        except Exception as e:
            self.fail(line, f"{type(e).__name__}: {e}")

    def dapo_data(self, line: str, args: list[str], env: dict):
        from dapo_ref import datasets

        assert datasets.main(args) == 0

    def dapo_plan(self, line: str, args: list[str], env: dict):
        from dapo_ref.plan import main

        assert main(args) == 0, "the plan does not fit"

    def dapo_train(self, line: str, args: list[str], env: dict):
        from dapo_ref.cli import load_config, parse_overrides, strict_bool
        from dapo_ref.data import check_answer_sources
        from dapo_ref.reward_pool import check_plugin, is_plugin
        from dapo_ref.track import check_trackers
        from dapo_ref.train import _parser
        from dapo_ref.trainer import load_splits

        a = _parser().parse(args)
        ov = parse_overrides(a.overrides)
        resume = strict_bool("resume", ov.pop("resume", False)) or a.resume
        cfg = load_config(a.config, ov)
        if cfg.rollout_backend == "vllm" and "scale" not in self.installed:
            self.fail(line, "rollout_backend vllm, and no line above installed the scale extra (vLLM)")
        if cfg.attn_implementation.startswith("flash") and "flash-attn" not in self.installed:
            self.fail(line, f"attn_implementation {cfg.attn_implementation}, and no line above installed flash-attn")
        if cfg.report_to != "none":
            check_trackers(cfg.report_to)
            if "wandb" in cfg.report_to and env.get("WANDB_MODE") != "offline":
                self.fail(line, "report_to wandb without a W&B login: WANDB_MODE=offline")
        if is_plugin(cfg.reward):
            with self.mp.context() as m:
                if env.get("PYTHONPATH") == ".":
                    m.syspath_prepend(str(self.cwd))
                for name in [n for n in sys.modules if n.split(".")[0] in ("my_rewards", "my_pkg")]:
                    m.delitem(sys.modules, name)
                check_plugin(cfg.reward)
        if cfg.train_data or cfg.eval_data:
            train, held = load_splits(cfg)
            check_answer_sources(cfg.answer_format, train, held)
        if cfg.output_dir in self.runs and not (resume or a.overwrite):
            self.fail(line, f"output_dir {cfg.output_dir} already holds a run from a line above")
        self.runs.add(cfg.output_dir)
        self.made.add(f"{cfg.output_dir}/final")

    def dapo_eval(self, line: str, args: list[str], env: dict):
        from dapo_ref.eval_cli import _parser, data_files

        a = _parser().parse(args)
        data_files(a.data)
        if a.backend == "vllm" and "scale" not in self.installed:
            self.fail(line, "--backend vllm, and no line above installed the scale extra (vLLM)")
        local = a.model.startswith(("runs/", "./", "/", "~"))
        if local and a.model not in self.made:
            self.fail(line, f"--model {a.model} is no folder a line above wrote ({sorted(self.made)})")
        if a.out in self.made and not a.overwrite:
            self.fail(line, f"--out {a.out} exists from a line above")
        self.made.add(a.out)


def fake_hub(monkeypatch, tmp: Path):
    "Hub datasets (no network here): a spec's rows from a small file in the schema its mapping names."
    from dapo_ref import data

    def files(spec, setting=None):
        rows = [(f"What is {i} + 1?", i + 1) for i in range(3)]
        f = tmp / "hub" / f"{spec.path.replace('/', '--')}.parquet"
        if spec.columns:
            import pyarrow as pa, pyarrow.parquet as pq

            f.parent.mkdir(exist_ok=True)
            cols = {spec.columns["prompt"]: [q for q, _ in rows], spec.columns["answer"]: [a for _, a in rows]}
            pq.write_table(pa.table(cols), f)
        else:
            data.save_math_dataset([data.make_example(q, a, "math_dapo") for q, a in rows], f)
        return [(f, f"{spec.path}/{f.name}")]

    monkeypatch.setattr(data, "hub_files", files, raising=False)


def fake_fetch(name, out_dir, revision=None, answer_format="answer_line"):
    "`fetch_dataset` without the hub: a small file of the schema `dapo-data` writes, where it writes it."
    from dapo_ref.data import PROMPT_TEMPLATES, make_example, save_math_dataset
    from dapo_ref.datasets import RECIPE_DATASETS

    source = "math_dapo" if name in RECIPE_DATASETS else name  # the published files' rows, or the converted set's
    exs = [make_example(f"{name}: what is {i} + 2?", i + 2, source, PROMPT_TEMPLATES[answer_format]) for i in range(3)]
    out = save_math_dataset(exs, Path(out_dir) / f"{name}.parquet")
    return dict(name=name, repo="-", file="-", rows=3, unique=3, source_sha256="0" * 64, out=str(out), sha256="0" * 64)


def walk(text: str, tmp: Path, monkeypatch) -> list[str]:
    from dapo_ref import datasets

    (tmp / "recipes").symlink_to(ROOT / "recipes")
    monkeypatch.chdir(tmp)
    monkeypatch.setattr(datasets, "fetch_dataset", fake_fetch)
    fake_hub(monkeypatch, tmp)
    reader = Reader(tmp, monkeypatch)
    for block in bash_lines(text):
        reader.runs = set()  # a block is one way to do it: the 32B launch is shown three ways, each its own run
        for line in block:
            reader.run(line)
    return reader.problems


def test_readme_commands_run_in_order(tmp_path, monkeypatch):
    problems = walk(README.read_text(), tmp_path, monkeypatch)
    assert not problems, "README lines that would fail as written:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "lines, why",
    [
        ("make demo\ndapo-data", "dapo-data is not on PATH here"),
        ("make demo\nsource .venv/bin/activate\ndapo-data --only nope", "exit 2: dapo-data: error: argument --only"),
        (
            "make demo\nsource .venv/bin/activate\ndapo-data\n"
            "dapo-train --config recipes/dapo-qwen2.5-1.5b-1gpu.yaml train_data=dapo-math-17k.parquet",
            "dapo-math-17k.parquet is absent",
        ),
        (
            "make demo\nsource .venv/bin/activate\ndapo-train --config recipes/tiny-cpu.yaml\n"
            "dapo-train --config recipes/tiny-cpu.yaml samples_per_step=4",
            "output_dir runs/tiny-cpu already holds a run",
        ),
        (
            "make demo\nsource .venv/bin/activate\ndapo-train --config recipes/tiny-cpu.yaml reward=my_pkg.rewards:judge",
            "reward = my_pkg.rewards:judge: cannot load it",
        ),
        (
            "make demo\nsource .venv/bin/activate\ndapo-eval --model runs/x/final --data aime-2024",
            "data/aime-2024.parquet is absent",
        ),
        (
            "make demo\nsource .venv/bin/activate\ndapo-data --only aime-2024\n"
            "dapo-eval --model runs/x/final --data aime-2024",
            "--model runs/x/final is no folder a line above wrote",
        ),
        (
            "make demo\nsource .venv/bin/activate\ndapo-plan recipes/dapo-qwen2.5-1.5b-1gpu.yaml\n"
            "dapo-train --config recipes/dapo-qwen2.5-1.5b-1gpu.yaml",
            "no line above installed the scale extra",
        ),
    ],
)
def test_walk_catches_what_fails_as_written(tmp_path, monkeypatch, lines, why):
    "The walk finds each kind of line that would fail (each was in the README once)."
    problems = walk(f"```bash\n{lines}\n```\n", tmp_path, monkeypatch)
    assert any(why in p for p in problems), problems


def test_dapo_eval_data_takes_the_specs_eval_data_takes(tmp_path):
    "`dapo-eval --data`, space- or comma-separated, resolves a mapped file and a hub dataset as `eval_data` does."
    import pyarrow as pa, pyarrow.parquet as pq

    from dapo_ref.eval_cli import data_files

    pq.write_table(pa.table({"problem": ["What is 3 + 3?"], "answer": [6]}), tmp_path / "mine.parquet")
    specs = data_files([f"{tmp_path / 'mine.parquet'}:prompt=problem:answer=answer,hub:o/n@v2:split=test", "hub:o/m"])
    assert [str(s) for s in specs] == [
        f"{tmp_path / 'mine.parquet'}:prompt=problem:answer=answer",
        "hub:o/n@v2:split=test",
        "hub:o/m",
    ]
