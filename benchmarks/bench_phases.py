"""Phase breakdown of DAPO rollout steps (generate / score / log-probs / update) and tokens per second.

    .venv/bin/python benchmarks/bench_phases.py                       # 5 steps of recipes/tiny-cpu.yaml
    .venv/bin/python benchmarks/bench_phases.py --steps 10 --threads 1 group_size=16

Runs `Trainer.step` a few times (no evaluation, no checkpoints) and prints, per phase, the seconds per
rollout step and the share of the step, then response tokens per second (over the whole step and over
generation alone) and gradient updates per second. The first step is reported separately (warm-up of the
allocator and the kernels) and excluded from the averages when there is more than one step.
"""

import argparse, os, platform, tempfile, time
from pathlib import Path

import torch

from dapo_ref.cli import load_config, parse_overrides
from dapo_ref.trainer import Trainer

PHASES = ("time_generate", "time_score", "time_logprobs", "time_update")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument("--steps", type=int, default=5, help="rollout steps to time")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # silence deepspeed's CPU notice
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = load_config(
        args.config,
        {
            **parse_overrides(args.overrides),
            "output_dir": tempfile.mkdtemp(),
            "total_steps": args.steps,
            "eval_every": 0,
            "save_every": 0,
        },
    )
    t0 = time.perf_counter()
    tr = Trainer(cfg, progress=False, log=None)
    setup = time.perf_counter() - t0
    rows = []
    for i in range(args.steps):
        rows.append(tr.step())
        r = rows[-1]
        print(
            f"step {i + 1}: {r['time_step']:.2f} s  (generate {r['time_generate']:.2f}, score {r['time_score']:.2f}, "
            f"log-probs {r['time_logprobs']:.2f}, update {r['time_update']:.2f}), rounds {r['gen_rounds']}, "
            f"acc {r['acc']:.3f}, mean length {r['resp_len_mean']:.1f}",
            flush=True,
        )
    use = rows[1:] if len(rows) > 1 else rows
    mean = lambda k: sum(r[k] for r in use) / len(use)
    step_s = mean("time_step")
    print(
        f"\n{cfg.model} on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, os.cpu_count() = {os.cpu_count()}; setup {setup:.1f} s"
    )
    print(
        f"G = {cfg.group_size}, prompts_per_step = {cfg.prompts_per_step}, gen_batch_size = {cfg.gen_batch_size}, "
        f"mini_batch_size = {cfg.mini_batch_size}, l_max = {cfg.l_max}; mean over steps "
        f"{'2' if len(rows) > 1 else '1'}..{len(rows)}"
    )
    print(f"{'phase':<10}{'s/step':>9}{'share':>8}")
    for k in PHASES:
        print(f"{k[5:]:<10}{mean(k):>9.2f}{mean(k) / step_s:>8.1%}")
    other = step_s - sum(mean(k) for k in PHASES)
    print(f"{'other':<10}{other:>9.2f}{other / step_s:>8.1%}")
    print(f"{'step':<10}{step_s:>9.2f}{1:>8.0%}")
    toks = mean("resp_len_mean") * sum(r["groups_seen"] for r in use) / len(use) * cfg.group_size
    print(
        f"response tokens per step {toks:.0f}; tokens/s {mean('tokens_per_s'):.0f} (whole step), "
        f"{mean('gen_tokens_per_s'):.0f} (generation only); "
        f"{cfg.prompts_per_step * cfg.group_size // cfg.mini_batch_size / step_s:.2f} gradient updates/s"
    )


if __name__ == "__main__":
    main()
