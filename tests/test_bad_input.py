"""Bad input through the real command line.

Every case runs one command, in a folder that holds files a user already had (an earlier
evaluation's results, a run with metrics and a checkpoint), and asserts:

- exit status 2;
- stderr has exactly one `prog: error: ...` line, and it names the input and the fix (`expect` fragments);
- no Python traceback anywhere in stderr;
- every file that existed before is intact byte for byte, and no new file appeared (folders may).

Each case runs in a forked child of `tests/cli_server.py`, which imported the commands once and then does what
their console scripts do (`sys.exit(main())` with the case's argv, environment and working directory): 48 fresh
processes spent about 170 CPU-seconds importing torch. `test_console_scripts` starts one case of each command as its
real console script in a fresh process, and asserts the same outcome as the server gave.

Adding a case is one `Case(...)` in `CASES`: an id, the command, a function that builds the bad input in the
case's folder and returns the arguments, and the fragments the error line must contain. Cases that need the
trainer (a run folder, resume, checkpoints) belong here too, with `prog="dapo-train"`.
"""
import hashlib, json, os, select, subprocess, sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from cli_server import MODULES  # command -> module[:function]
from test_eval import byte_tokenizer  # 256 byte tokens + <|endoftext|>, built in code

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def command(prog: str) -> list[str]:
    "The installed console script next to this Python, else `python -m` of its module."
    exe = Path(sys.executable).parent / prog
    if exe.exists(): return [str(exe)]
    mod, _, fn = MODULES[prog].partition(":")
    return [sys.executable, "-c", f"import sys; from {mod} import {fn or 'main'} as m; sys.exit(m())", prog]


@dataclass
class World:
    "What a case can use: its own folder `dir` (the working directory, holding the user's files) and shared inputs."
    dir: Path     # per case; the command runs here
    model: Path   # a small random Qwen2 with a byte-level tokenizer, saved with save_pretrained
    data: Path    # a valid JSONL file of 3 problems

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.dir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p


@dataclass
class Case:
    id: str
    prog: str                               # dapo-train | dapo-eval | dapo-plan | dapo-ablate
    argv: Callable[[World], list]           # builds the bad input under w.dir, returns the arguments
    expect: tuple[str, ...]                 # fragments of the error line: the input and the fix
    env: dict = field(default_factory=dict) # extra environment variables


# ---------------------------------------------------------------- the user's files and the shared inputs

def user_files(d: Path) -> None:
    "Files a user already has in the working directory: none of them may change."
    (d / "results.json").write_text(json.dumps({"avg@k": 0.4, "note": "an earlier evaluation"}))
    run = d / "runs" / "old"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "acc": 0.5}\n{"step": 2, "acc": 0.6}\n')
    (run / "config.yaml").write_text("model: tiny\ntotal_steps: 2\n")
    (run / "checkpoints" / "step-000002" / "model.safetensors").write_bytes(os.urandom(4096))


def snapshot(*dirs: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}



def jsonl_rows(problems) -> str:
    from dapo_ref.data import PROMPT_TEMPLATE
    return "".join(json.dumps({"data_source": "t", "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=q)}],
                               "ability": "MATH", "reward_model": {"ground_truth": str(a), "style": "rule"}}) + "\n"
                   for q, a in problems)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    d = tmp_path_factory.mktemp("shared")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    (d / "eval.jsonl").write_text(jsonl_rows([("What is 1 + 1?", 2), ("What is 2 * 3?", 6), ("What is 10 - 3?", 7)]))
    return d


# ---------------------------------------------------------------- cases

def recipe(content: str | bytes, name="recipe.yaml"):
    "A case input: a recipe file with this content."
    return lambda w: [str(w.write(name, content))]

def eval_args(w: World, *extra, data=None, model=None):
    "dapo-eval arguments that are fine, then `extra` (a repeated flag: argparse keeps the last)."
    return ["--model", str(model or w.model), "--data", str(data or w.data), "--k", "1", "--max-tokens", "2",
            "--out", str(w.dir / "new-results.json"), *map(str, extra)]

def train_args(w: World, *extra, out="runs/old", data=None, saved=False):
    "dapo-train arguments: the tiny-cpu recipe into `out` (the user's earlier run by default), then `extra`."
    if saved:  # the earlier run's config.yaml as dapo-train writes it (every field)
        from dapo_ref.core import load_config, save_config
        save_config(load_config(ROOT / "recipes" / "tiny-cpu.yaml", {"output_dir": "runs/old"}), w.dir / "runs" / "old" / "config.yaml")
    return ["--config", "recipes/tiny-cpu.yaml", f"output_dir={out}", *([f"train_data={data}"] if data else []), *extra]

RECIPE_CASES = [  # (id, the recipe file, fragments); run through every command that reads a recipe
    ("empty-recipe", recipe("# nothing here yet\n"), ("recipe.yaml holds no config keys", "recipes/tiny-cpu.yaml", "{}")),
    ("duplicate-key", recipe("model: tiny\nlr: 1e-6\nlr: 1e-2\n"), ("recipe.yaml: key 'lr' appears twice (lines 2 and 3)", "keep one")),
    ("yaml-syntax", recipe("model: tiny\ngroup_size: [4,\n"), ("recipe.yaml: YAML syntax error at line 3", "fix that line")),
    ("inf-lr", recipe("model: tiny\nlr: .inf\n"), ("recipe.yaml: lr = inf is not a finite number", "allowed lr > 0")),
    ("nan-temperature", recipe("model: tiny\ntemperature: nan\n"), ("temperature = nan is not a finite number", "temperature > 0")),
    ("inf-eps-high", recipe("model: tiny\neps_high: inf\n"), ("eps_high = inf is not a finite number",)),
    ("inf-weight-decay", recipe("model: tiny\nweight_decay: -.inf\n"), ("weight_decay = -inf is not a finite number",)),
    ("latin1-recipe", recipe(b"model: tiny\n# r\xe9glage\n"), ("recipe.yaml: not UTF-8 text (byte 0xe9 on line 2)", "save the recipe as UTF-8")),
    ("unknown-key", recipe("model: tiny\ngrup_size: 4\n"), ("recipe.yaml: unknown config key 'grup_size'", "did you mean 'group_size'")),
    ("not-a-mapping", recipe("- model: tiny\n"), ("expected a mapping of config keys",)),
    ("recipe-is-folder", lambda w: [str(w.dir / "runs" / "old")], ("is a folder, not a YAML recipe", "did you mean", "config.yaml")),
    ("missing-recipe", lambda w: [str(w.dir / "recipes" / "nope.yaml")], ("no recipe file at", "nope.yaml")),
]
RECIPE_FLAG = {"dapo-train": "--config", "dapo-ablate": "--base", "dapo-plan": None}  # None: a positional argument

def recipe_case(prog, id, build, expect):
    flag = RECIPE_FLAG[prog]
    return Case(f"{prog}-{id}", prog, lambda w: ([flag] if flag else []) + build(w), expect)

FAST = {"empty-recipe", "yaml-syntax", "inf-lr", "recipe-is-folder"}  # dapo-train starts slowly: only a few of its cases

CASES = [
    *(recipe_case("dapo-ablate", *c) for c in RECIPE_CASES),
    *(recipe_case("dapo-train", *c) for c in RECIPE_CASES if c[0] in FAST),
    *(recipe_case("dapo-plan", *c) for c in RECIPE_CASES if c[0] in {"yaml-syntax", "duplicate-key"}),
    Case("dapo-train-override-inf", "dapo-train", lambda w: ["--config", "recipes/tiny-cpu.yaml", "lr=inf"],
         ("lr = inf is not a finite number", "allowed lr > 0")),
    Case("dapo-train-override-twice", "dapo-train", lambda w: ["--config", "recipes/tiny-cpu.yaml", "lr=1e-6", "lr=1e-5"],
         ("override lr= is given twice", "keep one")),
    # dapo-train: the run folder, resume and the run options, all refused before the model loads
    Case("train-existing-run", "dapo-train", lambda w: train_args(w),
         ("output_dir = runs/old already holds a run (metrics.jsonl; 1 checkpoint folder(s): step-000002)",
          "pass --resume to continue it, choose a new output_dir, or pass --overwrite to replace it")),
    Case("train-resume-changes-experiment", "dapo-train", lambda w: train_args(w, "--resume", "group_size=4", "lr=0.01", saved=True),
         ("--resume: runs/old was trained with a different experiment (group_size 8 -> 4, lr 0.0003 -> 0.01)",
          "drop those overrides", "or train in a new output_dir")),
    Case("train-resume-and-overwrite", "dapo-train", lambda w: train_args(w, "--resume", "--overwrite"),
         ("--resume and --overwrite ask for opposite things", "pass one of them")),
    Case("train-keep-checkpoints", "dapo-train", lambda w: train_args(w, "--keep-checkpoints", "-1"),
         ("--keep-checkpoints -1 is out of range", "0 keeps every checkpoint")),
    Case("train-threads", "dapo-train", lambda w: train_args(w, "--threads", "-1"), ("--threads -1 is out of range", ">= 1")),
    Case("train-sampling-timeout", "dapo-train", lambda w: train_args(w, "--sampling-timeout", "0"),
         ("--sampling-timeout 0 is out of range", "seconds > 0")),
    Case("train-output-blocked", "dapo-train", lambda w: train_args(w, out="results.json/run"),
         ("output_dir = results.json/run: results.json is a file", "choose another output_dir")),
    Case("train-output-unwritable", "dapo-train", lambda w: train_args(w, out="/proc/dapo-no-such/run"),
         ("output_dir = /proc/dapo-no-such/run: cannot write in /proc", "choose another output_dir")),
    Case("train-prompt-too-long", "dapo-train",
         lambda w: train_args(w, f"model={w.model}", "max_prompt_length=400", out="runs/new",
                              data=w.write("long.jsonl", jsonl_rows([("What is 1 + 1?", 2), ("What is 1 + 1?", 2),
                                                                    ("What is 2 + 2?", 4), ("x" * 1000, 1)]))),
         ("max_prompt_length = 400: 1 of 3 prompts are longer (first: row 3 of long.jsonl", "raise max_prompt_length or drop those rows")),
    # dapo-ablate's own flags
    Case("dapo-ablate-threads", "dapo-ablate", lambda w: ["--threads", "-1"], ("--threads -1 is out of range", ">= 1")),
    Case("dapo-ablate-seeds", "dapo-ablate", lambda w: ["--seeds", "0", "0"], ("--seeds 0 0", "give each once")),
    Case("dapo-ablate-out-file", "dapo-ablate", lambda w: ["--out", "results.json"], ("--out results.json is a file", "give a folder")),
    Case("dapo-ablate-row", "dapo-ablate", lambda w: ["--rows", "3-clip-hihger"], ("unknown ablation row '3-clip-hihger'", "rows are: 1-grpo")),
    # dapo-eval: the results file, checked before anything runs
    Case("eval-out-folder", "dapo-eval", lambda w: eval_args(w, "--out", w.dir / "runs"),
         ("--out", "runs is a folder; give a file name", "runs/results.json")),
    Case("eval-out-exists", "dapo-eval", lambda w: eval_args(w, "--out", "results.json"),
         ("--out results.json already exists", "pass --overwrite", "choose another --out")),
    Case("eval-out-blocked", "dapo-eval", lambda w: eval_args(w, "--out", "results.json/r.json"),
         ("--out results.json/r.json: cannot write in results.json", "choose another --out")),
    Case("eval-out-unwritable", "dapo-eval", lambda w: eval_args(w, "--out", "/proc/dapo-no-such/r.json"),
         ("--out /proc/dapo-no-such/r.json: cannot write in /proc/dapo-no-such", "choose another --out")),
    # dapo-eval: the data
    Case("eval-prompt-too-long", "dapo-eval",
         lambda w: eval_args(w, data=w.write("long.jsonl", jsonl_rows([("What is 1 + 1?", 2), ("What is 1 + 1?", 2),
                                                                        ("What is 2 + 2?", 4), ("x" * 100_000, 1)]))),
         ("--max-prompt-length = 2048: 1 of 3 prompts are longer (first: row 3 of long.jsonl", "raise --max-prompt-length or drop those rows")),
    Case("eval-memory", "dapo-eval", lambda w: eval_args(w, "--k", 64, "--max-batch-size", 4096, "--max-tokens", 100_000_000),
         ("192 rows (--max-batch-size 4096) x (longest prompt", "+ --max-tokens 100000000) tokens may need", "GiB is free on cpu",
          "lower --max-batch-size or --max-tokens, or pass --dtype bfloat16")),
    Case("eval-not-parquet", "dapo-eval", lambda w: eval_args(w, data=w.write("d.parquet", "data_source,prompt\nx,y\n")),
         ("d.parquet: not a readable parquet file", "save the rows as .jsonl")),
    Case("eval-latin1-jsonl", "dapo-eval",
         lambda w: eval_args(w, data=w.write("d.jsonl", jsonl_rows([("What is 1 + 1?", 2)]).encode() + b'{"prompt": "caf\xe9"}\n')),
         ("row 1 of d.jsonl (line 2): not valid UTF-8 (byte 0xe9", "as UTF-8")),
    Case("eval-data-folder", "dapo-eval", lambda w: eval_args(w, data=(w.dir / "parts.parquet").mkdir() or w.dir / "parts.parquet"),
         ("--data", "parts.parquet is a folder", "give one .parquet or .jsonl file")),
    Case("eval-temperature-inf", "dapo-eval", lambda w: eval_args(w, "--temperature", "inf"),
         ("--temperature = inf is out of range", "finite")),
    # dapo-eval: the model
    Case("eval-hub-offline", "dapo-eval", lambda w: eval_args(w, model="no-such-org/no-such-model"),
         ("--model no-such-org/no-such-model: not a local folder and not in the Hugging Face cache",
          "HF_HUB_OFFLINE=1 forbids downloading it", "give a local folder")),
    Case("eval-model-no-config", "dapo-eval", lambda w: eval_args(w, model=(w.dir / "empty-model").mkdir() or w.dir / "empty-model"),
         ("empty-model: no config.json in this folder", "save_pretrained")),
    Case("eval-model-no-tokenizer", "dapo-eval",
         lambda w: eval_args(w, model=w.write("bare/config.json", (w.model / "config.json").read_bytes()).parent),
         ("bare: no tokenizer files in this folder", "tokenizer.save_pretrained")),
    Case("eval-model-is-file", "dapo-eval", lambda w: eval_args(w, model=w.dir / "results.json"),
         ("results.json is a file; give the model's folder",)),
    # dapo-export: the checkpoint and the folder it writes
    Case("export-no-checkpoint", "dapo-export", lambda w: ["runs/old/checkpoints/step-9", "--out", "exp"],
         ("runs/old/checkpoints/step-9: no such checkpoint folder", "give a run's checkpoints/step-N")),
    Case("export-broken-checkpoint", "dapo-export", lambda w: ["runs/old/checkpoints/step-000002", "--out", "exp"],
         ("is not a checkpoint that loads (state.json is missing)",)),
    Case("export-out-exists", "dapo-export", lambda w: ["runs/old/checkpoints/step-000002", "--out", "runs/old"],
         ("--out runs/old already exists", "pass --overwrite")),
]


class CLIServer:
    "tests/cli_server.py in a subprocess: `run` a command's case in a forked child, get (returncode, stdout, stderr)."
    def __init__(self, tmp: Path):
        self.tmp, self.n = tmp, 0
        self.p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_server.py")], cwd=tmp, env=ENV, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp / "server.err").open("w"))
        assert "ready" in self._reply(300), (tmp / "server.err").read_text()[-3000:]  # hang guard: the imports

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            self.p.kill()
            raise TimeoutError(f"cli_server: no reply within {timeout} s (hang guard); its stderr: "
                               + (self.tmp / "server.err").read_text()[-2000:])
        line = self.p.stdout.readline()
        assert line, "cli_server exited: " + (self.tmp / "server.err").read_text()[-3000:]
        return json.loads(line)

    def run(self, prog: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        self.p.stdin.write(json.dumps(dict(prog=prog, argv=argv, cwd=str(cwd), env=env, stdout=str(out), stderr=str(err))) + "\n")
        self.p.stdin.flush()
        rc = self._reply(120)["rc"]  # hang guard
        return subprocess.CompletedProcess([prog, *argv], rc, out.read_text(), err.read_text())

    def close(self):
        self.p.stdin.close(); self.p.wait(timeout=60)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    s = CLIServer(tmp_path_factory.mktemp("cli"))
    yield s
    s.close()


def run_case(case: Case, w: World, runner) -> subprocess.CompletedProcess:
    "Build the case's input in `w.dir` among the user's files, run it with `runner`, check the outcome; returns the result."
    w.dir.mkdir(parents=True, exist_ok=True)
    user_files(w.dir)
    argv = [str(a) for a in case.argv(w)]
    before = snapshot(w.dir, w.model.parent)
    r = runner(case.prog, argv, w.dir, {**ENV, **case.env})
    err = r.stderr
    assert "Traceback" not in err, err[-3000:]
    assert r.returncode == 2, (r.returncode, err[-2000:], r.stdout[-1000:])
    lines = [l for l in err.splitlines() if l.startswith(f"{case.prog}: error: ")]
    assert len(lines) == 1, err
    line = lines[0].replace(str(w.dir) + "/", "")
    for frag in case.expect:
        assert frag in line, (frag, line)
    assert snapshot(w.dir, w.model.parent) == before, "a file the user had changed, or a new file appeared"
    return r


def fresh_process(prog: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    "The installed console script (else `python -m`) in a new process."
    return subprocess.run(command(prog) + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)  # hang guard


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, shared, cli, tmp_path):
    run_case(case, World(tmp_path, shared / "model", shared / "eval.jsonl"), cli.run)


ENTRY = ["dapo-train-empty-recipe", "eval-out-exists", "dapo-plan-yaml-syntax", "dapo-ablate-threads", "export-no-checkpoint"]

@pytest.mark.parametrize("id", ENTRY)
def test_console_scripts(id, shared, cli, tmp_path):
    "One case of each command as its console script in a fresh process: the same status, error line and untouched files."
    case = next(c for c in CASES if c.id == id)
    a = run_case(case, World(tmp_path / "fresh", shared / "model", shared / "eval.jsonl"), fresh_process)
    b = run_case(case, World(tmp_path / "served", shared / "model", shared / "eval.jsonl"), cli.run)
    strip = lambda r, d: r.stderr.replace(str(tmp_path / d) + "/", "")
    assert a.returncode == b.returncode == 2 and strip(a, "fresh") == strip(b, "served"), (a.stderr, b.stderr)


def test_cases_have_unique_ids():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
