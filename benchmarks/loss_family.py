"""DAPO, Dr. GRPO, GSPO and CISPO side by side on the tiny task: held-out accuracy, response length and entropy.

    python benchmarks/loss_family.py --jobs 2              # 4 variants x seeds 0 1 2 (about 15 minutes on 2 cores)
    python benchmarks/loss_family.py --quick               # the machinery: 2 rollout steps a run

The base is Table 1's (`recipes/ablation-tiny.yaml`, whose switches are row 6: DAPO); each variant changes only the
fields of its loss (`nbs/04c_loss_family.ipynb`), every other technique stays on. The DAPO arm is row 6 itself: its runs
live where `dapo-ablate` keeps them (`benchmarks/ablation/runs/6-dynamic-sampling/seed-<s>`) and are reused when cached.
Writes `benchmarks/loss-family/family.json` (per variant and seed: the metrics rows that the figures plot, the run's key
and wall time) and `family.md` (the table); the notebook reads both. A run's folder holds a checkpoint and its logs
(`runs/`, not committed)."""

import argparse, json, os, sys, time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name: the fields that make the variant (`DAPOConfig` spells them as TRL and verl do)
    "DAPO": {},
    "Dr. GRPO": dict(scale_rewards="none", loss_agg="seq-mean-token-sum-norm"),
    "GSPO": dict(importance_sampling_level="sequence", loss_agg="seq-mean-token-mean", clip_c=None),
    "CISPO": dict(loss_mode="cispo", clip_c=None),
}
KEYS = ("step", "grad_updates", "eval_acc", "resp_len_mean", "entropy", "clipfrac_high", "ratio_max")


def configs(base, seeds, out: Path) -> dict:
    "{(variant, seed): DAPOConfig}: the base with the variant's fields and the seed; DAPO's runs are Table 1's row 6."
    # the folder exactly as `dapo-ablate` (run from the repository's root) names it: the cached run's key holds its
    # output_dir, and an absolute spelling of the same folder would not match (the run would be trained again)
    table_runs = Path("benchmarks") / "ablation" / "runs" / "6-dynamic-sampling"
    cfgs = {}
    for name, fields in VARIANTS.items():
        for s in seeds:
            folder = table_runs / f"seed-{s}" if not fields else out / "runs" / name.replace(". ", "-") / f"seed-{s}"
            cfgs[(name, s)] = replace(base, **fields, seed=s, output_dir=str(folder))
    return cfgs


def summary(rows: list[dict]) -> dict:
    "A run's numbers for the table: held-out accuracy at the end and over the run, length and entropy over the run."
    ev = [r["eval_acc"] for r in rows if r.get("eval_acc") is not None]
    mean = lambda k: sum(r[k] for r in rows if k in r) / max(1, sum(k in r for r in rows))
    return dict(
        acc_end=ev[-1], acc_mean=sum(ev) / len(ev), len_mean=mean("resp_len_mean"), entropy_mean=mean("entropy")
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: benchmarks/loss-family")
    ap.add_argument("--quick", action="store_true", help="2 rollout steps a run, 8 held-out problems: the machinery")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve() if a.out else ROOT / "benchmarks" / "loss-family"
    os.chdir(ROOT)  # the run folders are named relative to the repository's root, as dapo-ablate names them
    out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    from dapo_ref.cli import load_config
    from dapo_ref.jobs import compare_arms, mean_se, run_many
    from dapo_ref.testbeds import model_fingerprint

    base = load_config(ROOT / "recipes" / "ablation-tiny.yaml")
    if a.quick:
        base = replace(base, total_steps=2, eval_every=1, save_every=0)
        out = out / "quick"
    cfgs = configs(base, a.seeds, out)
    if a.quick:  # never write into Table 1's runs
        cfgs = {
            k: replace(c, output_dir=str(out / "runs" / k[0].replace(". ", "-") / f"seed-{k[1]}"))
            for k, c in cfgs.items()
        }
    t0 = time.perf_counter()

    def done(k, r):
        print(f"{k[0]:>9s} seed {k[1]}: " + ("cached" if r["cached"] else f"{r['wall']:.0f} s"), flush=True)

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
        for n in VARIANTS
    }
    sums = {n: [summary(runs[n][str(s)]["rows"]) for s in a.seeds] for n in VARIANTS}
    lines = [
        "| variant | held-out, end | held-out, mean of evals | length (tokens) | entropy (nats) |",
        "|---|---|---|---|---|",
    ]
    for n in VARIANTS:
        cell = lambda k, sc=1.0: "{:.3g} ± {:.2g}".format(*(sc * v for v in mean_se([x[k] for x in sums[n]])[:2]))
        lines.append(
            f"| {n} | {cell('acc_end', 100)} | {cell('acc_mean', 100)} | {cell('len_mean')} | {cell('entropy_mean')} |"
        )
    lines += [
        "",
        "| variant - DAPO | held-out, end | held-out, mean of evals | length | entropy |",
        "|---|---|---|---|---|",
    ]
    for n in list(VARIANTS)[1:]:
        c = {k: compare_arms([x[k] for x in sums["DAPO"]], [x[k] for x in sums[n]]) for k in sums[n][0]}
        f = lambda k, sc=1.0: f"{sc * c[k]['diff']:+.3g} ± {sc * c[k]['se']:.2g}" + (" *" if c[k]["separated"] else "")
        lines.append(f"| {n} | {f('acc_end', 100)} | {f('acc_mean', 100)} | {f('len_mean')} | {f('entropy_mean')} |")
    md = (
        "\n".join(lines)
        + f"\n\nmean ± standard error over seeds {a.seeds}; accuracy in points (held-out avg@4); * beyond 2 standard errors"
    )
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        command="python benchmarks/loss_family.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        seeds=a.seeds,
        variants=VARIANTS,
        wall_this_invocation=time.perf_counter() - t0,
        wall_runs_total=sum(r["wall"] for r in res.values()),
        date=time.strftime("%Y-%m-%d"),
    )
    (out / "family.json").write_text(json.dumps(dict(meta=meta, summaries=sums, runs=runs), indent=1) + "\n")
    (out / "family.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
