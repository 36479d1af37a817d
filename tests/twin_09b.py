"""The CPU-sized twin of nbs/09b_one_gpu.ipynb: every code cell of the notebook, `gpu` cells included, in order, in one
process, as `nbdev_test --flags gpu` runs them on one GPU, with only these changes (each must match once, so an edit
of the notebook that moves one fails here rather than drifting):

- the `gpu` cell's "needs a GPU" assert is skipped;
- after the cell that finds AIME 2024 (the path search itself runs), the held-out set is a few tiny-task problems
  (the tiny model's 512 positions hold no AIME prompt);
- the training file is a tiny-task parquet, and the recipe's sizes are overridden (`TWIN`) to the tiny model and a
  one-step run in vLLM's CPU limits (eager, no chunked prefill).

Everything else is the notebook's own code: the 1-GPU recipe and its plan, `train(run)` with ZeRO-2 and the vLLM
engine (which evaluates the held-out set at step 0 and after the last step), then those evaluations read back from the
run's metrics rows: no second engine in the process.

    python tests/twin_09b.py WORK   # in .venv-vllm, from anywhere; prints one JSON line `twin: {...}`
"""

import json, os, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "nbs" / "09b_one_gpu.ipynb"

SUBSTITUTIONS = [  # (the notebook's text, the twin's)
    ('assert torch.cuda.is_available(), "this cell needs a GPU"', "pass  # the CPU twin"),
    (
        "aime = load_math_dataset(AIME) if AIME else []",
        "aime = load_math_dataset(AIME) if AIME else []\n"
        'assert AIME is not None, "the notebook found no AIME file"; AIME = TWIN["eval_data"]; aime = load_math_dataset(AIME)',
    ),
    ('TRAIN = ROOT / "data" / "dapo-math-17k.parquet"', 'TRAIN = Path(TWIN["train_data"])'),
    ("run = load_config(recipe, ov)", "run = load_config(recipe, {**ov, **TWIN})"),
]


def twin_cells(source_cells: list[str]) -> list[str]:
    "The notebook's code cells with SUBSTITUTIONS applied; each must occur exactly once in the whole notebook."
    text = "\n# <cell>\n".join(source_cells)
    for old, new in SUBSTITUTIONS:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"twin_09b: {old!r} occurs {n} times in {NB.name}; update tests/twin_09b.py")
        text = text.replace(old, new)
    return text.split("\n# <cell>\n")


def main(work: Path) -> dict:
    import torch
    from dapo_ref.data import save_math_dataset
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.tiny_ship import ensure_tiny_model

    torch.set_num_threads(1)
    train, held = tiny_splits(64, 4, seed=0)
    work.mkdir(parents=True, exist_ok=True)
    twin = dict(
        model=str(ensure_tiny_model()),
        train_data=str(save_math_dataset(train, work / "train.parquet")),
        eval_data=str(save_math_dataset(held, work / "held.parquet")),
        output_dir=str(work / "run"),
        total_steps=1,
        group_size=4,
        prompts_per_step=2,
        gen_batch_size=2,
        mini_batch_size=8,
        l_max=24,
        l_cache=8,
        max_prompt_length=256,
        dtype="float32",
        attn_implementation="sdpa",
        eval_k=1,
        eval_every=0,
        save_every=0,
        vllm_enforce_eager=True,
        vllm_enable_chunked_prefill=False,
        vllm_gpu_memory_utilization=0.3,
    )
    nb = json.loads(NB.read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    ns = {"TWIN": twin, "__name__": "__main__"}
    os.chdir(ROOT / "nbs")  # where nbdev_test runs a notebook
    for src in twin_cells(cells):
        exec(compile(src, str(NB), "exec"), ns)
    s, before, after = ns["summary"], ns["before"], ns["after"]
    return dict(
        backend=ns["backend"],
        zero_stage=ns["run"].zero_stage,
        steps=s["steps"],
        grad_updates=s["grad_updates"],
        evals=[before.get("eval_acc"), after.get("eval_acc")],
        eval_keys=sorted(set(before) & set(after)),
        final=(Path(s["output_dir"]) / "final").is_dir(),
    )


if __name__ == "__main__":
    print("twin: " + json.dumps(main(Path(sys.argv[1])), default=str))
