"""Bad input through the real command line.

Every case runs one command, in a folder that holds files a user already had (an earlier
evaluation's results, a run with metrics and a checkpoint), and asserts:

- exit status 2;
- stderr has exactly one `prog: error: ...` line, and it names the input and the fix (`expect` fragments);
- no Python traceback anywhere in stderr;
- every file that existed before is intact byte for byte, and no new file appeared (folders may).

Each case runs in a forked child of `tests/cli_server.py`, which imported the commands once and then does what
their console scripts do (`sys.exit(main())` with the case's argv, environment and working directory), so a case
does not pay for importing torch again (tests/README.md has what that saved). `test_console_scripts` starts one case of each command as its
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
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
}


def command(prog: str) -> list[str]:
    "The installed console script next to this Python, else `python -m` of its module."
    exe = Path(sys.executable).parent / prog
    if exe.exists():
        return [str(exe)]
    mod, _, fn = MODULES[prog].partition(":")
    return [sys.executable, "-c", f"import sys; from {mod} import {fn or 'main'} as m; sys.exit(m())", prog]


@dataclass
class World:
    "What a case can use: its own folder `dir` (the working directory, holding the user's files) and shared inputs."

    dir: Path  # per case; the command runs here
    model: Path  # a small random Qwen2 with a byte-level tokenizer, saved with save_pretrained
    data: Path  # a valid JSONL file of 3 problems

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.dir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p


@dataclass
class Case:
    id: str
    prog: str  # dapo-train | dapo-eval | dapo-plan | dapo-ablate
    argv: Callable[[World], list]  # builds the bad input under w.dir, returns the arguments
    expect: tuple[str, ...]  # fragments of the error line: the input and the fix
    env: dict = field(default_factory=dict)  # extra environment variables


# ---------------------------------------------------------------- the user's files and the shared inputs


def user_files(d: Path) -> None:
    "Files a user already has in the working directory: none of them may change."
    from dapo_ref.runs import write_marker

    (d / "results.json").write_text(json.dumps({"avg@k": 0.4, "note": "an earlier evaluation"}))
    run = d / "runs" / "old"  # an earlier dapo-train run (its marker, metrics and a checkpoint folder)
    write_marker(run, "run")
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "grad_updates": 2, "acc": 0.5}\n{"step": 2, "grad_updates": 4, "acc": 0.6}\n'
    )
    (run / "config.yaml").write_text("model: tiny\ntotal_steps: 2\n")
    (run / "checkpoints" / "step-000002" / "model.safetensors").write_bytes(os.urandom(4096))
    mine = d / "mine"  # a folder of the user's that happens to use a run's names
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "keep.txt").write_text("the user's")
    (mine / "notes.md").write_text("# my notes\n")


def snapshot(*dirs: Path) -> dict:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()
    }


def jsonl_rows(problems) -> str:
    from dapo_ref.data import PROMPT_TEMPLATE

    return "".join(
        json.dumps(
            {
                "data_source": "t",
                "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=q)}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(a), "style": "rule"},
            }
        )
        + "\n"
        for q, a in problems
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("shared")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    (d / "eval.jsonl").write_text(jsonl_rows([("What is 1 + 1?", 2), ("What is 2 * 3?", 6), ("What is 10 - 3?", 7)]))
    return d


# ---------------------------------------------------------------- cases


def recipe(content: str | bytes, name="recipe.yaml"):
    "A case input: a recipe file with this content."
    return lambda w: [str(w.write(name, content))]


def eval_args(w: World, *extra, data=None, model=None):
    "dapo-eval arguments that are fine, with the flags in `extra` replacing or adding to them (each flag is given once)."
    args = {
        "--model": str(model or w.model),
        "--data": str(data or w.data),
        "--k": "1",
        "--max-tokens": "2",
        "--out": str(w.dir / "new-results.json"),
    }
    extra = [str(e) for e in extra]
    for i, e in enumerate(extra):
        if e.startswith("--"):
            args[e] = extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else None
    return [x for k, v in args.items() for x in ([k] if v is None else [k, v])]


def train_args(w: World, *extra, out="runs/old", data=None, saved=False, lock=False):
    """dapo-train arguments: the tiny-cpu recipe into `out` (the user's earlier run by default), then `extra`; `lock`:
    the run is live, its lock held by this test's process (alive, on this host)."""
    if lock:
        from dapo_ref.writers import LOCK, process_start
        import socket

        holder = dict(host=socket.gethostname(), pid=os.getpid(), start=process_start(os.getpid()), token="live")
        (w.dir / "runs" / "old" / LOCK).write_text(json.dumps({**holder, "since": "now", "command": "dapo-train"}))
    if saved:  # the earlier run's config.yaml as dapo-train writes it (every field)
        from dapo_ref.cli import load_config, save_config

        save_config(
            load_config(ROOT / "recipes" / "tiny-cpu.yaml", {"output_dir": "runs/old"}),
            w.dir / "runs" / "old" / "config.yaml",
        )
    return ["--config", "recipes/tiny-cpu.yaml", f"output_dir={out}", *([f"train_data={data}"] if data else []), *extra]


def stale_build_lock(w: World) -> list:
    "The lock a build of DeepSpeed's shm op killed twenty minutes ago left in ext/ (TORCH_EXTENSIONS_DIR); no arguments."
    import time

    lock = w.write("ext/deepspeed_shm_comm/lock", "")
    os.utime(lock, (time.time() - 1200, time.time() - 1200))  # 2 x writers.BUILD_LOCK_AGE_S
    return []


def foreign_inside(w: World) -> list:
    "Another run's folder inside the user's earlier run (made before such nesting was refused); no arguments."
    from dapo_ref.runs import write_marker

    write_marker(w.dir / "runs" / "old" / "exports" / "inner", "run")
    (w.dir / "runs" / "old" / "exports" / "inner" / "metrics.jsonl").write_text('{"step": 0, "grad_updates": 0}\n')
    return []


def model_copy(w: World, name: str, damage=None) -> Path:
    "A copy of the shared model under `w.dir/name`; `damage(folder)` then breaks it."
    import shutil

    dst = w.dir / name
    shutil.copytree(w.model, dst)
    if damage:
        damage(dst)
    return dst


def truncate(folder: Path):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def nan_weight(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        m.model.norm.weight[0] = float("nan")
    m.save_pretrained(folder)


def tiny_folder(w: World, name: str, *extra: str) -> Path:
    "A folder dapo-tiny would have written (its tiny_build.json lists its files), plus the user's `extra` files."
    d = w.dir / name
    d.mkdir()
    (d / "tiny_build.json").write_text(json.dumps({"files": {"config.json": "0" * 64}, "source_hash": "0" * 64}))
    (d / "config.json").write_text("{}")
    for e in extra:
        (d / e).write_text("the user's")
    return d


RECIPE_CASES = [  # (id, the recipe file, fragments); run through every command that reads a recipe
    (
        "empty-recipe",
        recipe("# nothing here yet\n"),
        ("recipe.yaml holds no config keys", "recipes/tiny-cpu.yaml", "{}"),
    ),
    (
        "duplicate-key",
        recipe("model: tiny\nlr: 1e-6\nlr: 1e-2\n"),
        ("recipe.yaml: key 'lr' appears twice (lines 2 and 3)", "keep one"),
    ),
    (
        "yaml-syntax",
        recipe("model: tiny\ngroup_size: [4,\n"),
        ("recipe.yaml: YAML syntax error at line 3", "fix that line"),
    ),
    ("inf-lr", recipe("model: tiny\nlr: .inf\n"), ("recipe.yaml: lr = inf is not a finite number", "allowed lr > 0")),
    (
        "nan-temperature",
        recipe("model: tiny\ntemperature: nan\n"),
        ("temperature = nan is not a finite number", "temperature > 0"),
    ),
    ("inf-eps-high", recipe("model: tiny\neps_high: inf\n"), ("eps_high = inf is not a finite number",)),
    ("inf-weight-decay", recipe("model: tiny\nweight_decay: -.inf\n"), ("weight_decay = -inf is not a finite number",)),
    (
        "latin1-recipe",
        recipe(b"model: tiny\n# r\xe9glage\n"),
        ("recipe.yaml: not UTF-8 text (byte 0xe9 on line 2)", "save the recipe as UTF-8"),
    ),
    (
        "unknown-key",
        recipe("model: tiny\ngrup_size: 4\n"),
        ("recipe.yaml: unknown config key 'grup_size'", "did you mean 'group_size'"),
    ),
    ("not-a-mapping", recipe("- model: tiny\n"), ("expected a mapping of config keys",)),
    (
        "verl-kl-key",
        recipe("model: tiny\nactor_rollout_ref.actor.use_kl_loss: true\n"),
        (
            "recipe.yaml: actor_rollout_ref.actor.use_kl_loss (verl ppo_trainer.yaml) has no equivalent here",
            "remove it",
        ),
    ),
    (
        "recipe-is-folder",
        lambda w: [str(w.dir / "runs" / "old")],
        ("is a folder, not a YAML recipe", "did you mean", "config.yaml"),
    ),
    ("missing-recipe", lambda w: [str(w.dir / "recipes" / "nope.yaml")], ("no recipe file at", "nope.yaml")),
]
RECIPE_FLAG = {"dapo-train": "--config", "dapo-ablate": "--base", "dapo-plan": None}  # None: a positional argument


def recipe_case(prog, id, build, expect):
    flag = RECIPE_FLAG[prog]
    return Case(f"{prog}-{id}", prog, lambda w: ([flag] if flag else []) + build(w), expect)


FAST = {
    "empty-recipe",
    "yaml-syntax",
    "inf-lr",
    "recipe-is-folder",
}  # dapo-train starts slowly: only a few of its cases

CASES = [
    *(recipe_case("dapo-ablate", *c) for c in RECIPE_CASES),
    *(recipe_case("dapo-train", *c) for c in RECIPE_CASES if c[0] in FAST),
    *(recipe_case("dapo-plan", *c) for c in RECIPE_CASES if c[0] in {"yaml-syntax", "duplicate-key"}),
    Case(
        "dapo-train-override-inf",
        "dapo-train",
        lambda w: ["--config", "recipes/tiny-cpu.yaml", "lr=inf"],
        ("lr = inf is not a finite number", "allowed lr > 0"),
    ),
    Case(
        "train-flash-on-cpu",
        "dapo-train",
        lambda w: train_args(w, "attn_implementation=flash_attention_2", "dtype=bfloat16", "lora_r=4", out="runs/new"),
        (
            "attn_implementation = flash_attention_2 needs the flash-attn package and a CUDA GPU",
            "set attn_implementation: sdpa",
        ),
    ),
    Case(
        "train-flash-in-float32",
        "dapo-train",
        lambda w: train_args(w, "attn_implementation=flash_attention_3", out="runs/new"),
        ("attn_implementation = flash_attention_3 runs in fp16/bf16 only, but dtype = float32", "set dtype: bfloat16"),
    ),
    Case(
        "dapo-train-override-twice",
        "dapo-train",
        lambda w: ["--config", "recipes/tiny-cpu.yaml", "lr=1e-6", "lr=1e-5"],
        ("override lr= is given twice", "keep one"),
    ),
    # dapo-train: the run folder, resume and the run options, all refused before the model loads
    Case(
        "train-existing-run",
        "dapo-train",
        lambda w: train_args(w),
        (
            "output_dir = runs/old already holds a run (metrics.jsonl; 1 checkpoint folder(s): step-000002)",
            "pass --resume to continue it, choose a new output_dir, or pass --overwrite to replace it",
        ),
    ),
    Case(
        "train-resume-changes-experiment",
        "dapo-train",
        lambda w: train_args(w, "--resume", "group_size=4", "lr=0.01", saved=True),
        (
            "--resume: runs/old was trained with a different experiment (group_size 8 -> 4, lr 0.0003 -> 0.01)",
            "drop those overrides",
            "or train in a new output_dir",
        ),
    ),
    Case(
        "train-resume-and-overwrite",
        "dapo-train",
        lambda w: train_args(w, "--resume", "--overwrite"),
        ("--resume and --overwrite ask for opposite things", "pass one of them"),
    ),
    # one writer per run (nbs/00c_one_writer.ipynb): a live holder of runs/old (this test's own process) refuses a second
    # dapo-train on it whatever the flags, naming the holder; a run inside another run's folder; an --overwrite that
    # would remove a folder another command marked (tests/test_concurrency.py: the same with two real processes)
    *(
        Case(
            f"train-live-run{'-' + flag[2:] if flag else ''}",
            "dapo-train",
            lambda w, flag=flag: train_args(w, *([flag] if flag else []), lock=True),
            (
                f"output_dir = runs/old is being written by another run (PID {os.getpid()} on this host",
                "Wait for it to end or stop it, then --resume continues it",
            ),
        )
        for flag in ("", "--resume", "--overwrite")
    ),
    # sizes no machine holds: refused by the host-memory estimate before any model loads (07_rollout)
    Case(
        "train-prompts-per-step-no-machine-holds",
        "dapo-train",
        # 1.6e11 responses: 10.5 TiB even at one token each (an eval batch of --k 1e11 responses: 19.6 TiB)
        lambda w: train_args(w, "prompts_per_step=10000000000", "gen_batch_size=10000000000", out="runs/new"),
        ("160,000,000,000 responses at once need", "on the host even at one token each", "lower prompts_per_step"),
    ),
    Case(
        "eval-k-no-machine-holds",
        "dapo-eval",
        lambda w: eval_args(w, "--k", "100000000000"),
        ("--k x --batch-prompts: 300,000,000,000 responses at once need", "even at one token each", "lower --k"),
    ),
    Case(
        "train-stale-build-lock",
        "dapo-train",
        lambda w: stale_build_lock(w) + train_args(w, "zero_stage=2", out="runs/new"),
        ("the C++ op deepspeed_shm_comm", "has a build lock whose builder is gone", "rm ext/deepspeed_shm_comm/lock"),
        env={"TORCH_EXTENSIONS_DIR": "ext"},  # (relative: the case's folder)
    ),
    Case(
        "train-group-of-one-with-dynamic-sampling",
        "dapo-train",
        lambda w: train_args(w, "group_size=1", "mini_batch_size=16", out="runs/new"),
        ("group_size = 1 with dynamic_sampling", "Eq. 11 would drop every group", "dynamic_sampling: false"),
    ),
    Case(
        "train-inside-another-run",
        "dapo-train",
        lambda w: train_args(w, out="runs/old/exports/inner"),
        ("output_dir = runs/old/exports/inner is inside", "another run's folder", "choose a folder outside it"),
    ),
    Case(
        "train-overwrite-removes-a-foreign-folder",
        "dapo-train",
        lambda w: foreign_inside(w) + train_args(w, "--overwrite"),
        (
            "--overwrite would remove",
            "runs/old/exports/inner, a dapo_ref run folder this run did not write",
            "move it out",
        ),
    ),
    Case(
        "train-keep-checkpoints",
        "dapo-train",
        lambda w: train_args(w, "--keep-checkpoints", "-1"),
        ("--keep-checkpoints -1 is out of range", "0 keeps every checkpoint"),
    ),
    Case(
        "train-threads",
        "dapo-train",
        lambda w: train_args(w, "--threads", "-1"),
        ("--threads -1 is out of range", ">= 1"),
    ),
    Case(
        "train-sampling-timeout",
        "dapo-train",
        lambda w: train_args(w, "--sampling-timeout", "0"),
        ("--sampling-timeout 0 is out of range", "seconds > 0"),
    ),
    Case(
        "train-output-blocked",
        "dapo-train",
        lambda w: train_args(w, out="results.json/run"),
        ("output_dir = results.json/run: results.json is a file", "choose another output_dir"),
    ),
    Case(
        "train-output-unwritable",
        "dapo-train",
        lambda w: train_args(w, out="/proc/dapo-no-such/run"),
        ("output_dir = /proc/dapo-no-such/run: cannot write in /proc", "choose another output_dir"),
    ),
    Case(
        "train-prompt-too-long",
        "dapo-train",
        lambda w: train_args(
            w,
            f"model={w.model}",
            "max_prompt_length=400",
            out="runs/new",
            data=w.write(
                "long.jsonl",
                jsonl_rows([("What is 1 + 1?", 2), ("What is 1 + 1?", 2), ("What is 2 + 2?", 4), ("x" * 1000, 1)]),
            ),
        ),
        (
            "max_prompt_length = 400: 1 of 3 prompts are longer (first: row 3 of long.jsonl",
            "raise max_prompt_length or drop those rows",
        ),
    ),
    # dapo-ablate's own flags
    Case("dapo-ablate-threads", "dapo-ablate", lambda w: ["--threads", "-1"], ("--threads -1 is out of range", ">= 1")),
    Case("dapo-ablate-seeds", "dapo-ablate", lambda w: ["--seeds", "0", "0"], ("--seeds 0 0", "give each once")),
    Case(
        "dapo-ablate-out-file",
        "dapo-ablate",
        lambda w: ["--out", "results.json"],
        ("--out results.json is a file", "give a folder"),
    ),
    Case(
        "dapo-ablate-row",
        "dapo-ablate",
        lambda w: ["--rows", "3-clip-hihger"],
        ("unknown ablation row '3-clip-hihger'", "rows are: 1-grpo"),
    ),
    # dapo-eval: the results file, checked before anything runs
    Case(
        "eval-out-folder",
        "dapo-eval",
        lambda w: eval_args(w, "--out", w.dir / "runs"),
        ("--out", "runs is a folder; give a file name", "runs/results.json"),
    ),
    Case(
        "eval-out-exists",
        "dapo-eval",
        lambda w: eval_args(w, "--out", "results.json"),
        ("--out results.json already exists", "pass --overwrite", "choose another --out"),
    ),
    Case(
        "eval-out-blocked",
        "dapo-eval",
        lambda w: eval_args(w, "--out", "results.json/r.json"),
        ("--out results.json/r.json: cannot write in results.json", "choose another --out"),
    ),
    Case(
        "eval-out-unwritable",
        "dapo-eval",
        lambda w: eval_args(w, "--out", "/proc/dapo-no-such/r.json"),
        ("--out /proc/dapo-no-such/r.json: cannot write in /proc/dapo-no-such", "choose another --out"),
    ),
    # dapo-eval: the data
    Case(
        "eval-prompt-too-long",
        "dapo-eval",
        lambda w: eval_args(
            w,
            data=w.write(
                "long.jsonl",
                jsonl_rows([("What is 1 + 1?", 2), ("What is 1 + 1?", 2), ("What is 2 + 2?", 4), ("x" * 100_000, 1)]),
            ),
        ),
        (
            "--max-prompt-length = 2048: 1 of 3 prompts are longer (first: row 3 of long.jsonl",
            "raise --max-prompt-length or drop those rows",
        ),
    ),
    Case(
        "eval-memory",
        "dapo-eval",
        # 1e6 tokens: 13 GiB on the host for 192 responses (fits a 24 GiB machine), ~100 GB of KV cache does not
        lambda w: eval_args(w, "--k", 64, "--max-batch-size", 4096, "--max-tokens", 1_000_000),
        (
            "192 rows (--max-batch-size 4096) x (longest prompt",
            "+ --max-tokens 1000000) tokens may need",
            "GiB is free on cpu",
            "lower --max-batch-size or --max-tokens, or pass --dtype bfloat16",
        ),
    ),
    Case(
        "eval-not-parquet",
        "dapo-eval",
        lambda w: eval_args(w, data=w.write("d.parquet", "data_source,prompt\nx,y\n")),
        ("d.parquet: not a readable parquet file", "save the rows as .jsonl"),
    ),
    Case(
        "eval-latin1-jsonl",
        "dapo-eval",
        lambda w: eval_args(
            w, data=w.write("d.jsonl", jsonl_rows([("What is 1 + 1?", 2)]).encode() + b'{"prompt": "caf\xe9"}\n')
        ),
        ("row 1 of d.jsonl (line 2): not valid UTF-8 (byte 0xe9", "as UTF-8"),
    ),
    Case(
        "eval-data-folder",
        "dapo-eval",
        lambda w: eval_args(w, data=(w.dir / "parts.parquet").mkdir() or w.dir / "parts.parquet"),
        ("--data", "parts.parquet is a folder", "give one .parquet or .jsonl file"),
    ),
    Case(
        "eval-data-second-missing",
        "dapo-eval",
        lambda w: (a := eval_args(w))[: a.index("--data") + 2] + ["missing.jsonl"] + a[a.index("--data") + 2 :],
        ("--data missing.jsonl: no such file", "give a .parquet or .jsonl file, or a name dapo-data fetches"),
    ),
    Case(
        "eval-data-second-missing-comma",
        "dapo-eval",
        lambda w: eval_args(w, data=f"{w.data},missing.parquet"),
        ("--data missing.parquet: no such file", "give a .parquet or .jsonl file"),
    ),
    Case(
        "eval-data-name-unfetched",
        "dapo-eval",
        lambda w: eval_args(w, data=f"{w.data},aime-2024"),
        ("--data item 2 of 2 names aime-2024, but data/aime-2024.parquet is absent", "`dapo-data --only aime-2024`"),
    ),
    Case(
        "eval-temperature-inf",
        "dapo-eval",
        lambda w: eval_args(w, "--temperature", "inf"),
        ("--temperature = inf is out of range", "finite"),
    ),
    # dapo-eval: the model
    Case(
        "eval-hub-offline",
        "dapo-eval",
        lambda w: eval_args(w, model="no-such-org/no-such-model"),
        (
            "--model no-such-org/no-such-model: not a local folder and not in the Hugging Face cache",
            "HF_HUB_OFFLINE=1 forbids downloading it",
            "give a local folder",
        ),
    ),
    Case(
        "eval-model-no-config",
        "dapo-eval",
        lambda w: eval_args(w, model=(w.dir / "empty-model").mkdir() or w.dir / "empty-model"),
        ("empty-model: no config.json in this folder", "save_pretrained"),
    ),
    Case(
        "eval-model-no-tokenizer",
        "dapo-eval",
        lambda w: eval_args(w, model=w.write("bare/config.json", (w.model / "config.json").read_bytes()).parent),
        ("bare: no tokenizer files in this folder", "tokenizer.save_pretrained"),
    ),
    Case(
        "eval-model-is-file",
        "dapo-eval",
        lambda w: eval_args(w, model=w.dir / "results.json"),
        ("results.json is a file; give the model's folder",),
    ),
    # dapo-export: the checkpoint and the folder it writes
    Case(
        "export-no-checkpoint",
        "dapo-export",
        lambda w: ["runs/old/checkpoints/step-9", "--out", "exp"],
        ("runs/old/checkpoints/step-9: no such checkpoint folder", "give a run's checkpoints/step-N"),
    ),
    Case(
        "export-broken-checkpoint",
        "dapo-export",
        lambda w: ["runs/old/checkpoints/step-000002", "--out", "exp"],
        ("is not a checkpoint that loads (state.json is missing)",),
    ),
    Case(
        "export-out-run-folder",
        "dapo-export",
        lambda w: ["runs/old/checkpoints/step-000002", "--out", "runs/old"],
        ("--out = runs/old is a dapo_ref run folder", "not a model folder; choose a new or empty folder"),
    ),
    # ---- family: the folder is the user's (no command writes into a folder it did not make, --overwrite or not)
    *(
        Case(
            f"train-user-folder{'-' + f[2:] if f else ''}{'-cwd' if out == '.' else ''}",
            "dapo-train",
            lambda w, f=f, out=out: train_args(w, *([f] if f else []), out=out),
            (
                f"output_dir = {out} holds files no dapo_ref command wrote",
                "nothing there is touched, --overwrite or not",
            ),
        )
        for f, out in [("", "mine"), ("--overwrite", "mine"), ("--resume", "mine"), ("--overwrite", ".")]
    ),
    Case(
        "train-into-ablation-folder",
        "dapo-train",
        lambda w: (__import__("dapo_ref.runs").runs.write_marker(w.dir / "abl", "ablation"), train_args(w, out="abl"))[
            1
        ],
        ("output_dir = abl is a dapo_ref ablation folder", "not a run folder"),
    ),
    Case(
        "train-overwrite-its-own-model",
        "dapo-train",
        lambda w: (model_copy(w, "runs/old/final"), train_args(w, "--overwrite", "model=runs/old/final"))[1],
        (
            "model = runs/old/final is inside",
            "runs/old/final, which this run removes (--overwrite) and writes",
            "copy it out of",
        ),
    ),
    Case(
        "eval-out-is-data",
        "dapo-eval",
        lambda w: eval_args(w, "--out", w.data, "--overwrite"),
        ("--out", "eval.jsonl is the --data input; the results would replace it"),
    ),
    Case(
        "eval-overwrite-user-file",
        "dapo-eval",
        lambda w: eval_args(w, "--out", "results.json", "--overwrite"),
        (
            "--out results.json exists and is not a dapo-eval results file",
            "--overwrite replaces only an earlier result",
        ),
    ),
    Case(
        "export-overwrite-user-folder",
        "dapo-export",
        lambda w: ["runs/old/checkpoints/step-000002", "--out", "mine", "--overwrite"],
        ("--out = mine holds files no dapo_ref command wrote", "nothing there is touched"),
    ),
    Case(
        "ablate-out-user-folder",
        "dapo-ablate",
        lambda w: ["--quick", "--out", "mine"],
        ("--out = mine holds files no dapo_ref command wrote",),
    ),
    Case(
        "ablate-out-run-folder",
        "dapo-ablate",
        lambda w: ["--quick", "--out", "runs/old"],
        ("--out = runs/old is a dapo_ref run folder", "not a ablation folder"),
    ),
    Case(
        "tiny-out-user-folder",
        "dapo-tiny",
        lambda w: ["--out", "mine", "--overwrite"],
        ("mine exists and is not a tiny model folder", "pick a new or empty folder"),
    ),
    Case(
        "tiny-out-without-overwrite",
        "dapo-tiny",
        lambda w: ["--out", tiny_folder(w, "tm")],
        ("tm already holds a tiny model; pass --overwrite to rebuild it",),
    ),
    Case(
        "tiny-out-with-user-files",
        "dapo-tiny",
        lambda w: ["--out", tiny_folder(w, "tm", "notes.md"), "--overwrite"],
        ("tm holds files dapo-tiny did not write (notes.md)", "move them out first"),
    ),
    # ---- family: values that parse but mean nothing
    Case(
        "train-resume-nope",
        "dapo-train",
        lambda w: train_args(w, "resume=nope", out="runs/new"),
        ("resume='nope': expected true or false",),
    ),
    Case(
        "train-data-unset-variable",
        "dapo-train",
        lambda w: train_args(w, "train_data=", out="runs/new"),
        ("override 'train_data=' has no value after '=' (an unset shell variable?)",),
    ),
    Case(
        "train-output-dir-empty",
        "dapo-train",
        lambda w: ["--config", *recipe("model: tiny\noutput_dir: ''\n")(w)],
        ("output_dir is empty", "give a path"),
    ),
    Case(
        "train-data-tilde",
        "dapo-train",
        lambda w: (w.write("empty.jsonl", ""), train_args(w, "train_data=~/empty.jsonl", out="runs/new"))[1],
        ("train_data = ./empty.jsonl holds no problems",),
        env={"HOME": "."},
    ),  # ~ is HOME
    Case(
        "train-eval-data-empty",
        "dapo-train",
        lambda w: (w.write("empty.jsonl", ""), train_args(w, "eval_data=empty.jsonl", out="runs/new"))[1],
        ("eval_data = empty.jsonl holds no problems", "eval_data=null"),
    ),
    Case(
        "train-eval-data-second-file-absent",
        "dapo-train",
        lambda w: train_args(w, f"eval_data={w.data},nope.jsonl", out="runs/new"),
        ("eval_data item 2 of 2: nope.jsonl is absent", "give a .parquet or .jsonl file"),
    ),
    Case(
        "train-eval-data-list-empty-item",
        "dapo-train",
        lambda w: train_args(w, f"eval_data=[{w.data}, '']", out="runs/new"),
        ("eval_data item 2 of 2 is empty", "separate paths with single commas"),
    ),
    Case(
        "train-eval-data-name-not-fetched",
        "dapo-train",
        lambda w: train_args(w, "eval_data=aime-2024", out="runs/new"),
        ("eval_data names aime-2024, but data/aime-2024.parquet is absent", "dapo-data --only aime-2024"),
    ),
    Case(
        "train-config-twice",
        "dapo-train",
        lambda w: ["--config", "recipes/tiny-cpu.yaml", "--config", "recipes/ablation-tiny.yaml"],
        ("--config is given twice ('recipes/tiny-cpu.yaml' and 'recipes/ablation-tiny.yaml'); give it once",),
    ),
    Case(
        "train-flag-style-override",
        "dapo-train",
        lambda w: train_args(w, "--lr", "1e-5", out="runs/new"),
        ("unrecognized arguments: --lr 1e-5", "config fields are set as key=value, e.g. lr=1e-5"),
    ),
    Case(
        "train-dotted-key",
        "dapo-train",
        lambda w: train_args(w, "optimizer.lr=1e-5", out="runs/new"),
        ("unknown config key 'optimizer.lr'; did you mean 'lr'? (DAPOConfig is flat",),
    ),
    Case(
        "train-trl-name-without-equivalent",
        "dapo-train",
        lambda w: train_args(w, "beta=0.04", out="runs/new"),
        ("beta (TRL GRPOConfig) has no equivalent here: DAPO has no KL term", "remove it"),
    ),
    Case(
        "train-trl-name-in-other-unit",
        "dapo-train",
        lambda w: train_args(w, "max_steps=100", out="runs/new"),
        (
            "max_steps (TRL GRPOConfig) is not read here: it counts optimizer steps, total_steps rollout steps",
            "set total_steps",
        ),
    ),
    Case(
        "train-bf16-without-master-copy",
        "dapo-train",
        lambda w: train_args(w, "dtype=bfloat16", out="runs/new"),
        (
            "dtype = bfloat16 with zero_stage = 0 and lora_r = 0",
            "set zero_stage: 2 (DeepSpeed keeps an fp32 master copy) or dtype: float32",
        ),
    ),
    Case(
        "train-huge-seed",
        "dapo-train",
        lambda w: train_args(w, "seed=99999999999999999999", out="runs/new"),
        ("seed = 99999999999999999999 is out of range", "0 <= seed < 2**31"),
    ),
    Case(
        "train-long-value",
        "dapo-train",
        lambda w: ["--config", *recipe("model: tiny\ngroup_size: '" + "x" * 200_000 + "'\n")(w)],
        ("group_size: got 'xxxx", "(200002 characters)", "expected int"),
    ),
    Case(
        "plan-override-after-flag",
        "dapo-plan",
        lambda w: ["recipes/tiny-cpu.yaml", "--json", "lr=inf"],
        ("lr = inf is not a finite number",),
    ),
    Case(
        "plan-flag-style-override",
        "dapo-plan",
        lambda w: ["recipes/tiny-cpu.yaml", "--nnodes", "2"],
        ("e.g. nnodes=2",),
    ),
    Case(
        "ablate-override-after-flag",
        "dapo-ablate",
        lambda w: ["--quick", "--threads", "1", "lr=inf"],
        ("lr = inf is not a finite number",),
    ),
    Case(
        "ablate-out-twice",
        "dapo-ablate",
        lambda w: ["--out", "a", "--out", "b"],
        ("--out is given twice ('a' and 'b')",),
    ),
    Case(
        "eval-reward-conflict",
        "dapo-eval",
        lambda w: eval_args(w, "--math-verify", "--reward", "dapo-strict"),
        ("--math-verify and --reward dapo-strict disagree",),
    ),
    Case(
        "eval-reward-unknown",
        "dapo-eval",
        lambda w: eval_args(w, "--reward", "exact"),
        ("--reward exact: use one of dapo-reference, dapo-strict, math-verify, or a plug-in package.module:function",),
    ),
    Case(
        "eval-reward-plugin-missing",
        "dapo-eval",
        lambda w: eval_args(w, "--reward", "no_such_pkg.rewards:judge"),
        ("reward = no_such_pkg.rewards:judge: cannot load it",),
    ),
    Case(
        "train-reward-plugin-missing",
        "dapo-train",
        lambda w: train_args(w, "reward=no_such_pkg.rewards:judge", out="runs/new"),
        ("reward = no_such_pkg.rewards:judge: cannot load it",),
    ),
    Case(
        "train-reward-plugin-no-form",
        "dapo-train",
        lambda w: train_args(w, "reward=math:sqrt", out="runs/new"),
        ("reward = math:sqrt: sqrt(x, /) cannot be called as sqrt(response, ground_truth), nor as verl's",),
    ),
    Case(
        "train-reward-weights-count",
        "dapo-train",
        lambda w: train_args(w, "reward_weights=[1.0, 0.5]", out="runs/new"),
        ("reward_weights = 1.0,0.5: 2 weights for 1 rewards; give one per reward",),
    ),
    Case(
        "train-answer-format-unknown",
        "dapo-train",
        lambda w: train_args(w, "answer_format=box", out="runs/new"),
        ("answer_format = 'box' is out of range: allowed answer_line or boxed",),
    ),
    Case(
        "train-answer-format-source-absent",
        "dapo-train",
        lambda w: train_args(w, "answer_format=answer_line,aime-2024=boxed", out="runs/new"),
        (
            "answer_format = answer_line,aime-2024=boxed: no training or evaluation row has data_source aime-2024 "
            "(the published AIME-2024 file's rows are math_dapo); the rows' sources are tiny:",
        ),
    ),
    Case(
        "eval-answer-format-source-absent",
        "dapo-eval",
        lambda w: eval_args(w, "--answer-format", "answer_line,math-500=boxed"),
        ("--answer-format = answer_line,math-500=boxed: no training or evaluation row has data_source math-500;", "t:"),
    ),
    Case(
        "eval-answer-format-unknown",
        "dapo-eval",
        lambda w: eval_args(w, "--answer-format", "latex"),
        ("--answer-format latex: use answer_line or boxed",),
    ),
    Case(
        "eval-reward-plugin-no-form",
        "dapo-eval",
        lambda w: eval_args(w, "--reward", "math:sqrt"),
        ("reward = math:sqrt: sqrt(x, /) cannot be called as sqrt(response, ground_truth)",),
    ),
    Case(
        "train-report-to-unknown",
        "dapo-train",
        lambda w: train_args(w, "report_to=comet", out="runs/new"),
        ("report_to = 'comet' is out of range", "tensorboard, wandb"),
    ),
    Case(
        "eval-device-unknown",
        "dapo-eval",
        lambda w: eval_args(w, "--device", "gpu"),
        ("--device gpu is not a device torch knows",),
    ),
    Case(
        "export-typo-flag",
        "dapo-export",
        lambda w: ["runs/old/checkpoints/step-000002", "--out", "x", "--ouput", "y"],
        ("did you mean --out?",),
    ),
    # ---- family: the model, the device and the environment, checked before the run
    Case(
        "train-model-hub-offline",
        "dapo-train",
        lambda w: train_args(w, "model=no-such-org/no-such-model", out="runs/new"),
        (
            "model = no-such-org/no-such-model: not a local folder and not in the Hugging Face cache",
            "give a local folder",
        ),
    ),
    Case(
        "train-model-no-config",
        "dapo-train",
        lambda w: train_args(w, f"model={(w.dir / 'empty-model').mkdir() or 'empty-model'}", out="runs/new"),
        ("model = empty-model: no config.json in this folder", "save_pretrained"),
    ),
    Case(
        "train-model-truncated",
        "dapo-train",
        lambda w: train_args(w, f"model={model_copy(w, 'cut', truncate)}", out="runs/new"),
        ("model = cut: model.safetensors is truncated", "copy or export the model again"),
    ),
    Case(
        "train-model-nan",
        "dapo-train",
        lambda w: train_args(
            w,
            f"model={model_copy(w, 'nan', nan_weight)}",
            "total_steps=0",
            *("prompts_per_step=2", "gen_batch_size=2", "mini_batch_size=16"),  # w.data holds 3 problems
            "max_prompt_length=1000",
            out="runs/new",
            data=w.data,
        ),
        ("model = nan: some weights hold NaN or infinite values", "start from another model"),
    ),
    Case(
        "eval-model-truncated",
        "dapo-eval",
        lambda w: eval_args(w, model=model_copy(w, "cut", truncate)),
        ("--model", "cut: model.safetensors is truncated"),
    ),
    Case(
        "eval-model-nan",
        "dapo-eval",
        lambda w: eval_args(w, model=model_copy(w, "nan", nan_weight)),
        ("nan: weight model.norm.weight holds NaN or infinite values", "evaluate another one"),
    ),
    Case(
        "train-cache-is-file",
        "dapo-train",
        lambda w: train_args(w, out="runs/new"),
        ("DAPO_REF_CACHE = results.json: results.json is a file, not a folder",),
        env={"DAPO_REF_CACHE": "results.json"},
    ),
]
if not __import__("torch").cuda.is_available():
    CASES.append(
        Case(
            "eval-device-cuda",
            "dapo-eval",
            lambda w: eval_args(w, "--device", "cuda"),
            ("--device cuda: this machine has no CUDA GPU", "pass --device cpu"),
        )
    )


class CLIServer:
    "tests/cli_server.py in a subprocess: `run` a command's case in a forked child, get (returncode, stdout, stderr)."

    def __init__(self, tmp: Path):
        self.tmp, self.n = tmp, 0
        self.p = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "cli_server.py")],
            cwd=tmp,
            env=ENV,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp / "server.err").open("w"),
        )
        assert "ready" in self._reply(300), (tmp / "server.err").read_text()[-3000:]  # hang guard: the imports

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            self.p.kill()
            raise TimeoutError(
                f"cli_server: no reply within {timeout} s (hang guard); its stderr: "
                + (self.tmp / "server.err").read_text()[-2000:]
            )
        line = self.p.stdout.readline()
        assert line, "cli_server exited: " + (self.tmp / "server.err").read_text()[-3000:]
        return json.loads(line)

    def run(self, prog: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        self.p.stdin.write(
            json.dumps(dict(prog=prog, argv=argv, cwd=str(cwd), env=env, stdout=str(out), stderr=str(err))) + "\n"
        )
        self.p.stdin.flush()
        rc = self._reply(120)["rc"]  # hang guard
        return subprocess.CompletedProcess([prog, *argv], rc, out.read_text(), err.read_text())

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


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
    assert len(lines[0]) <= 2400, f"the error line is {len(lines[0])} characters long"  # long values are cut
    line = lines[0].replace(str(w.dir) + "/", "")
    for frag in case.expect:
        assert frag in line, (frag, line)
    assert snapshot(w.dir, w.model.parent) == before, "a file the user had changed, or a new file appeared"
    return r


def fresh_process(prog: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    "The installed console script (else `python -m`) in a new process."
    return subprocess.run(
        command(prog) + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )  # hang guard


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, shared, cli, tmp_path):
    run_case(case, World(tmp_path, shared / "model", shared / "eval.jsonl"), cli.run)


ENTRY = [
    "dapo-train-empty-recipe",
    "eval-out-exists",
    "dapo-plan-yaml-syntax",
    "dapo-ablate-threads",
    "export-no-checkpoint",
]


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


# ---------------------------------------------------------------- nothing the user had changes, whatever the command

NAMES = [
    "checkpoints",
    "final",
    "exports",
    "tb",
    "metrics.jsonl",
    "config.yaml",
    "summary.json",
    "curves.png",
    "results.json",
    "model.safetensors",
    "config.json",
    "tiny_build.json",
    ".dapo_ref.json",
    "notes.md",
    "data.jsonl",
]


def user_tree(rng, d: Path, depth: int = 0) -> None:
    "A folder of the user's at `d`: random names (many of them the ones dapo_ref writes), random bytes, up to 3 levels."
    d.mkdir(parents=True, exist_ok=True)
    for _ in range(rng.randint(1, 5)):
        name = rng.choice(
            NAMES + ["".join(rng.choice("abcxyz_-.0") for _ in range(rng.randint(1, 8))).strip(".") or "x"]
        )
        p = d / name
        if p.exists():
            continue
        if depth < 2 and rng.random() < 0.35:
            user_tree(rng, p, depth + 1)
        else:
            p.write_bytes(rng.randbytes(rng.randint(0, 300)))


def tree_state(d: Path) -> dict:
    "Every file's sha256 and every folder under `d`: what must not change."
    return {
        str(p.relative_to(d)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
    }


@pytest.mark.parametrize("seed", range(5))
def test_no_command_changes_a_folder_of_user_files(seed, shared, cli, tmp_path):
    "Every writing command pointed at (or into) a generated folder of user files, with and without --overwrite: refused in one line, every file byte-identical."
    import random

    rng = random.Random(seed)
    u = tmp_path / "u"
    user_tree(rng, u)
    files = [p.relative_to(tmp_path) for p in u.rglob("*") if p.is_file()]
    dirs = [p.relative_to(tmp_path) for p in u.rglob("*") if p.is_dir() and any(p.iterdir())]
    ckpt = tmp_path / "ckpt"  # a checkpoint folder outside u (broken: the folder checks come first)
    ckpt.mkdir()
    train = ["--config", "recipes/tiny-cpu.yaml"]
    runs = [
        ("dapo-train", [*train, "output_dir=u"]),
        ("dapo-train", [*train, "output_dir=u", "--overwrite"]),
        ("dapo-train", [*train, "output_dir=u", "--resume"]),
        ("dapo-export", [str(ckpt), "--out", "u", "--overwrite"]),
        ("dapo-ablate", ["--quick", "--out", "u"]),
        ("dapo-tiny", ["--out", "u", "--overwrite"]),
    ]
    if dirs:
        runs += [
            ("dapo-train", [*train, f"output_dir={rng.choice(dirs)}", "--overwrite"]),
            ("dapo-export", [str(ckpt), "--out", str(rng.choice(dirs)), "--overwrite"]),
        ]
    if files:
        runs.append(
            (
                "dapo-eval",
                [
                    "--model",
                    str(shared / "model"),
                    "--data",
                    str(shared / "eval.jsonl"),
                    "--k",
                    "1",
                    "--max-tokens",
                    "2",
                    "--out",
                    str(rng.choice(files)),
                    "--overwrite",
                ],
            )
        )
    before = tree_state(u)
    for prog, argv in runs:
        r = cli.run(prog, argv, tmp_path, ENV)
        assert "Traceback" not in r.stderr, (prog, argv, r.stderr[-3000:])
        assert r.returncode == 2 and len([l for l in r.stderr.splitlines() if l.startswith(f"{prog}: error: ")]) == 1, (
            prog,
            argv,
            r.returncode,
            r.stderr[-2000:],
        )
        assert tree_state(u) == before, (prog, argv, "changed the user's folder")
    r = cli.run("dapo-plan", ["recipes/tiny-cpu.yaml"], tmp_path, ENV)  # reads only
    assert r.returncode == 0 and tree_state(u) == before
    if seed == 0:  # what a command may do: add its own new file beside the user's
        r = cli.run(
            "dapo-eval",
            [
                "--model",
                str(shared / "model"),
                "--data",
                str(shared / "eval.jsonl"),
                "--k",
                "1",
                "--max-tokens",
                "2",
                "--out",
                "u/new-results.json",
            ],
            tmp_path,
            ENV,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        after = tree_state(u)
        assert after.pop("u/new-results.json".split("/", 1)[1]) and after == before


def test_ctrl_c_is_one_line_with_the_command_that_continues(tmp_path):
    "Ctrl-C in the middle of dapo-train: exit status 130, no traceback, one line naming the command that continues the run."
    import signal, time

    # a first checkpoint soon: no evaluation, a step of 2 groups from rounds of 4 prompts
    small = ["val_before_train=false", "eval_every=0", "prompts_per_step=2", "gen_batch_size=4", "mini_batch_size=16"]
    argv = ["--config", str(ROOT / "recipes" / "tiny-cpu.yaml"), "output_dir=run", "save_every=1", *small, "--quiet"]
    # SIGINT as a terminal delivers it: a job started in the background (make -j, `&`) inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler, so the child gets the default disposition back first
    p = subprocess.Popen(
        command("dapo-train") + argv,
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    t0 = time.time()
    while (
        not list((tmp_path / "run" / "checkpoints").glob("step-*[0-9]")) and p.poll() is None and time.time() - t0 < 300
    ):
        time.sleep(0.2)  # hang guard: 300 s to the first checkpoint
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)  # hang guard
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-3000:])
    lines = [l for l in err.splitlines() if l.startswith("dapo-train: ")]
    assert len(lines) == 1 and lines[0].startswith("dapo-train: interrupted; continue from run/checkpoints/step-"), err
    assert lines[0].endswith(" with: dapo-train " + " ".join(argv) + " --resume"), lines[0]
