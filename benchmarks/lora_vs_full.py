"""LoRA against full fine-tuning on the tiny task (the demo's recipe, `recipes/tiny-cpu.yaml`): held-out accuracy over
seeds, wall time, and the learner's model states (parameters, gradients, AdamW) counted from its tensors.

    python benchmarks/lora_vs_full.py --jobs 2      # 3 arms x seeds 0 1 2 (about 15 minutes on 2 cores)
    python benchmarks/lora_vs_full.py --quick       # the machinery: 2 rollout steps a run

Arms: full fine-tuning (the recipe as it is: lr 3e-4); LoRA rank 8 on every linear layer (alpha 16) at the same
learning rate; and at ten times it (3e-3: LoRA's update starts from B = 0 and is scaled by alpha / r, and LoRA runs are
usually given a larger learning rate). Writes `benchmarks/lora/lora.json` (per arm and seed: the metrics rows, wall
time, the run's key) and `lora.md` (the table); `nbs/07c_lora.ipynb` reads both. Run folders go to `runs/` (not
committed)."""

import argparse, json, os, sys, time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {  # name: the fields that make the arm
    "full fine-tuning": {},
    "LoRA r 8, lr 3e-4": dict(lora_r=8, lora_alpha=16),
    "LoRA r 8, lr 3e-3": dict(lora_r=8, lora_alpha=16, lr=3e-3),
}
KEYS = ("step", "grad_updates", "eval_acc", "resp_len_mean", "entropy")


def state_bytes(cfg) -> dict:
    "The learner's model states after one update, counted from its tensors: parameters, gradients, AdamW's m and v."
    import torch
    from dapo_ref.algorithm import train_on
    from dapo_ref.interfaces import RolloutBatch
    from dapo_ref.learner import TorchLearner
    from dapo_ref.policy import load_policy

    model, tok = load_policy(cfg.model)
    learner = TorchLearner(model, cfg, pad_token_id=tok.pad_token_id)
    ids = tok("Q: 1+1=? Answer:")["input_ids"]
    b = RolloutBatch(
        [ids] * 2, [ids[:3], ids[:2]], torch.tensor([1.0, -1.0]), torch.zeros(2, dtype=torch.bool), torch.zeros(2)
    )
    train_on(learner, b, 2)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    params = list(learner.model.parameters())
    return dict(
        params=size(params),
        trained=sum(p.numel() for p in params if p.requires_grad),
        grads=size(p.grad for p in params if p.grad is not None),
        optimizer=size(v for st in learner.opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: benchmarks/lora")
    ap.add_argument("--quick", action="store_true", help="2 rollout steps a run, 8 held-out problems: the machinery")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve() if a.out else ROOT / "benchmarks" / "lora"
    os.chdir(ROOT)
    out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    from dapo_ref.cli import load_config
    from dapo_ref.jobs import compare_arms, mean_se, run_many
    from dapo_ref.testbeds import model_fingerprint

    base = load_config(ROOT / "recipes" / "tiny-cpu.yaml")
    if a.quick:
        base = replace(base, total_steps=2, eval_every=1, save_every=0)
        out = out / "quick"
    folder = lambda n, s: str(
        Path("runs") / ("lora-quick" if a.quick else "lora") / n.replace(" ", "-").replace(",", "") / f"seed-{s}"
    )
    cfgs = {(n, s): replace(base, **f, seed=s, output_dir=folder(n, s)) for n, f in ARMS.items() for s in a.seeds}
    t0 = time.perf_counter()
    done = lambda k, r: print(
        f"{k[0]:>20s} seed {k[1]}: " + ("cached" if r["cached"] else f"{r['wall']:.0f} s"), flush=True
    )
    res = run_many(cfgs, model_fingerprint(base.model), 8 if a.quick else None, a.jobs, 1, done=done)
    runs = {
        n: {
            str(s): dict(
                wall=res[(n, s)]["wall"],
                key=res[(n, s)]["key"],
                rows=[{k: r[k] for k in KEYS if k in r} for r in res[(n, s)]["metrics"]],
            )
            for s in a.seeds
        }
        for n in ARMS
    }
    ev = lambda rows: [r["eval_acc"] for r in rows if r.get("eval_acc") is not None]
    sums = {
        n: [
            dict(
                acc_start=ev(runs[n][str(s)]["rows"])[0],
                acc_end=ev(runs[n][str(s)]["rows"])[-1],
                wall=runs[n][str(s)]["wall"],
            )
            for s in a.seeds
        ]
        for n in ARMS
    }
    states = {n: state_bytes(replace(base, **f)) for n, f in ARMS.items()}
    lines = [
        "| arm | held-out, start | held-out, end | wall per run (s) | trained params | model states (MB) |",
        "|---|---|---|---|---|---|",
    ]
    cell = lambda n, k, sc=1.0: "{:.3g} ± {:.2g}".format(*(sc * v for v in mean_se([x[k] for x in sums[n]])[:2]))
    for n in ARMS:
        st = states[n]
        mb = (st["params"] + st["grads"] + st["optimizer"]) / 1e6
        lines.append(
            f"| {n} | {cell(n, 'acc_start', 100)} | {cell(n, 'acc_end', 100)} | {cell(n, 'wall')} | {st['trained']:,} | {mb:.2f} |"
        )
    lines += ["", "| arm - full | held-out, end | wall per run |", "|---|---|---|"]
    for n in list(ARMS)[1:]:
        c = {k: compare_arms([x[k] for x in sums[list(ARMS)[0]]], [x[k] for x in sums[n]]) for k in ("acc_end", "wall")}
        f = lambda k, sc=1.0: f"{sc * c[k]['diff']:+.3g} ± {sc * c[k]['se']:.2g}" + (" *" if c[k]["separated"] else "")
        lines.append(f"| {n} | {f('acc_end', 100)} | {f('wall')} |")
    md = "\n".join(lines) + (
        f"\n\nmean ± standard error over seeds {a.seeds}; accuracy in points (held-out avg@{base.eval_k}); "
        "* beyond 2 standard errors; wall: each run alone in its process, 2 at a time on 2 cores. The end is one "
        "evaluation: read it against the curves (nbs/07c_lora.ipynb), where an arm that peaked early may have drifted"
    )
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        command="python benchmarks/lora_vs_full.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        seeds=a.seeds,
        arms=ARMS,
        wall_this_invocation=time.perf_counter() - t0,
        date=time.strftime("%Y-%m-%d"),
    )
    (out / "lora.json").write_text(
        json.dumps(dict(meta=meta, summaries=sums, states=states, runs=runs), indent=1) + "\n"
    )
    (out / "lora.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
