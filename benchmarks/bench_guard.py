"""What the learner's update guard (`runs.UpdateGuard`) costs per update, measured side by side in one process.

    .venv/bin/python benchmarks/bench_guard.py [--updates 6] [--threads 2] [--offload | --no-offload]

The 57M-parameter Qwen2 of the scale tests (random weights), the DeepSpeed ZeRO-3 learner on one rank with the
optimizer offloaded to the CPU (as the 32B recipe runs it), one mini-batch of 8 sequences (64 prompt + 192 response
tokens). Every update runs the same learner code; only the check after the step differs, cycled
update by update (A, B, C, A, B, C, ...) so that drift in the machine's speed falls on all three alike:

- `none`:    no check after the step;
- `guard`:   `UpdateGuard.after_step`: one max-reduction of |w| over this rank's fp32 master partition (every ZeRO
             sub-group); DeepSpeed itself skips a step whose global gradient norm is not finite.
(The guard before these, which previewed AdamW's step: benchmarks/README.md has its measurement.)

It prints the mean seconds per update of each and the overhead against `none`.
"""

import argparse, os, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=6, help="timed updates per variant (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-offload", dest="offload", action="store_false", help="keep the optimizer with the parameters")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from dapo_ref import dist
    from dapo_ref.cli import config_from_dict
    from dapo_ref.scale import DeepSpeedLearner
    from dapo_ref.interfaces import RolloutBatch

    transformers.logging.set_verbosity_error()
    dist.init_distributed(single=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=14,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
    )
    n = sum(p.numel() for p in model.parameters())
    cfg = config_from_dict(
        dict(
            zero_stage=3,
            offload_optimizer=args.offload,
            lr=1e-6,
            warmup_steps=0,
            micro_token_budget=4096,
            mini_batch_size=8,
            group_size=8,
            prompts_per_step=1,
        )
    )
    learner = DeepSpeedLearner(model, cfg, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4096, (64,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(1, 4096, (192,), generator=g).tolist() for _ in range(8)]
    batch = RolloutBatch(
        prompts,
        responses,
        torch.tensor([1.0, -1.0] * 4),
        torch.zeros(8, dtype=torch.bool),
        torch.tensor([1.0, -1.0] * 4),
    )
    guard = learner.guard
    real_after = guard.after_step
    modes = {
        "none": lambda: None,
        "guard": real_after,
    }  # the DeepSpeed learner's guard: after_step only (DeepSpeed skips non-finite norms)
    times, guard_times = {k: [] for k in modes}, {k: [] for k in modes}
    for r in range(args.updates + 1):
        for name, after in modes.items():
            spent = [0.0]

            def timed(f):
                def w():
                    t = time.perf_counter()
                    out = f()
                    spent[0] += time.perf_counter() - t
                    return out

                return w

            guard.after_step = timed(after)
            old, _ = learner.compute_logprobs(batch)
            t0 = time.perf_counter()
            m = learner.update(batch, old)
            dt = time.perf_counter() - t0
            assert m["skipped"] == 0.0 and guard.blown is None, (name, guard.reason, guard.blown)
            if r:
                times[name].append(dt)
                guard_times[name].append(spent[0])  # round 0: warm-up
    base = statistics.mean(times["none"])
    print(
        f"57M Qwen2 ({n / 1e6:.1f}M parameters), DeepSpeed ZeRO-3 on 1 rank, optimizer offloaded: {args.offload}, "
        f"torch {torch.__version__}, {args.threads} threads, os.cpu_count() = {os.cpu_count()}; "
        f"{args.updates} updates per variant, interleaved"
    )
    print(f"{'variant':<9}{'s/update':>10}{'sd':>8}{'guard s':>9}{'overhead':>10}")
    for name in modes:
        ts = times[name]
        print(
            f"{name:<9}{statistics.mean(ts):>10.3f}{statistics.stdev(ts) if len(ts) > 1 else 0:>8.3f}"
            f"{statistics.mean(guard_times[name]):>9.3f}{(statistics.mean(ts) - base) / base:>+10.1%}"
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
