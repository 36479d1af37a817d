"""The measured answer of nbs/04b_rollout_correction.ipynb: held-out accuracy with and without rollout correction when
the engine's distribution differs from the learner's.

    nice -n 10 .venv/bin/python benchmarks/rollout_correction.py --out benchmarks/rollout_correction \
        --engine-temperature 1.5 --steps 12 --seeds 0 1 2 3 4 5 --arms none token_truncate sequence_mask

Each run is recipes/tiny-cpu.yaml (the demo) for `--steps` rollout steps, held-out avg@8 at the start and the end,
with one change: the rollout engine is `TemperedEngine` (below), which samples at `--engine-temperature`
and reports that distribution's log-probs, while the learner's pi_old is at the recipe's temperature (1.0). The
held-out evaluation samples from the learner's weights as the recipe asks (the transformers engine, not the tempered
one). One JSON per (arm, seed) in --out; an existing one is kept (the runs resume).

The config refuses a correction with `rollout_backend: hf`, whose own engine returns no log-probs; this engine does,
so the learner's copy of the config is given the arm's correction after the trainer is built."""

import argparse, copy, json, statistics, sys, time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor

from dapo_ref.cli import load_config
from dapo_ref.interfaces import Completion, RolloutEngine, SamplingParams
from dapo_ref.packing import collate, forward_logprobs
from dapo_ref.trainer import Trainer


class TemperedEngine(RolloutEngine):
    "A rollout engine whose policy is not pi_old: a transformers engine sampling at `temperature`, returning that distribution's log-probs."

    def __init__(
        self,
        inner,  # an `HFRolloutEngine` (its `model` scores the samples)
        temperature: float,  # tau_engine: every call samples at it, whatever it is asked
        pad_token_id: int,
        chunk: int = 64,  # responses per scoring pass
    ):
        self.inner, self.temperature, self.pad_id, self.chunk = inner, temperature, pad_token_id, chunk

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, use_tqdm: bool = False) -> list[Completion]:
        "The inner engine's completions at `temperature`, each with its tokens' log-probs under softmax(logits / temperature)."
        comps = self.inner.generate(prompts, replace(params, temperature=self.temperature), use_tqdm)
        for s in range(0, len(comps), self.chunk):
            part = comps[s : s + self.chunk]
            mb = collate([prompts[c.prompt_index] for c in part], [c.token_ids for c in part], self.pad_id)
            logp, _ = forward_logprobs(self.inner.model, mb, self.temperature)  # (b, T)
            for j, c in enumerate(part):
                c.logprobs = logp[j, : len(c.token_ids)].tolist()
        return comps

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.inner.load_weights(named_tensors)


W_KEYS = (
    "rollout_logp_diff_mean",
    "rollout_kl_k3",
    "rollout_w_mean",
    "rollout_w_max",
    "rollout_w_truncated_frac",
    "rollout_w_masked_frac",
    "rollout_seq_log_w_std",
    "rollout_seq_masked_frac",
)


def run(arm: str, seed: int, tau: float, steps: int, runs: Path) -> dict:
    "One training run of the arm; its record."
    cfg = load_config(
        "recipes/tiny-cpu.yaml",
        dict(
            seed=seed,
            total_steps=steps,
            eval_every=0,
            save_every=0,
            samples_per_step=0,
            samples_max_mb=0,
            output_dir=str(runs / f"{arm}-seed-{seed}"),
        ),
    )
    tr = Trainer(cfg, progress=False, log=None)
    tr.local_rollout.engine = TemperedEngine(tr.engine, tau, tr.pad_id)  # training rollouts only; evaluation: tr.engine
    lc = copy.copy(cfg)  # the learner's config: past the config's hf rule (see the docstring)
    lc.rollout_correction = arm
    tr.learner.cfg = lc
    t0 = time.perf_counter()
    s = tr.fit(overwrite=True)
    rows = [r for r in tr.rows if r.get("step", 0) > 0 and "acc" in r]
    mean = lambda k: statistics.fmean(r[k] for r in rows)
    return dict(
        arm=arm,
        seed=seed,
        engine_temperature=tau,
        steps=steps,
        eval_start=s["eval_start"],
        eval_end=s["eval_end"],
        train_acc_mean=mean("acc"),
        wall=time.perf_counter() - t0,
        **{k: mean(k) for k in W_KEYS},
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/rollout_correction")
    ap.add_argument("--runs", default="/tmp/rollout_correction_runs", help="the runs' folders (checkpoints, exports)")
    ap.add_argument("--engine-temperature", type=float, default=1.5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--arms", nargs="+", default=["none", "token_truncate", "sequence_mask"])
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model: one thread (benchmarks/README.md, bench_phases)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds:  # seed-major: an interrupted study has every arm of its first seeds
        for arm in a.arms:
            f = out / f"{arm}-seed-{seed}.json"
            if f.exists():
                continue
            r = run(arm, seed, a.engine_temperature, a.steps, Path(a.runs))
            f.write_text(json.dumps(r, indent=1))
            print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
