"""The one script to run first on a machine with one GPU: the GPU path of dapo_ref, phase by phase, in one process.

    python benchmarks/gpu_check.py            # one NVIDIA GPU with vLLM and DeepSpeed installed; about 3-6 minutes, limit 10
    python benchmarks/gpu_check.py --cpu      # the same phases on the CPU with a tiny Qwen2 (make test runs it in .venv-vllm)
    python benchmarks/gpu_check.py --without-vllm   # where vLLM cannot be installed: the learner's phases, HF engine

`--without-vllm` is asked for by name (without it a missing vLLM is refused): the engine is the HF one
(`rollout_backend: hf`), the `sync` phase compares the learner's packed, fused log-probs with a plain padded forward of
the engine's copy of the weights (streamed from the ZeRO-3 partitions after the step), and `free`/`restart` (vLLM's
sleep-mode allocator) are listed as skipped.

Needs PyTorch, transformers, DeepSpeed and vLLM (`pip install -e ".[scale]"`) and no network; pytest is not needed.
Without DeepSpeed the learner is the plain PyTorch one (`zero_stage: 0`) and the ZeRO-3 learner is listed as skipped,
so a machine with PyTorch and transformers alone runs `--without-vllm`'s phases: the model is a Qwen2 of
Qwen2.5-0.5B's shape (24 layers, d 896, vocab 151936, tied embeddings; ~0.5B parameters) built in code with random
weights next to the tiny task's tokenizer; the prompts are tiny-task problems of one length. One process holds both
sides, as one rank of the colocated run does: the DeepSpeed ZeRO-3 learner and a vLLM engine (compiled, with sleep
mode, on the GPU; eager and without sleep mode on the CPU, where vLLM has none). The phases, each followed by the
device's free memory (torch.cuda.mem_get_info) and the peak PyTorch allocated during the phase (`throughput.cuda_peaks`:
each phase's own peak, whatever the trainer's meter reads inside it), next to `dapo-plan`'s per-phase prediction;
the step's update peak is the trainer's own (`perf/peak_mem_gb/update`), printed beside the plan's update:

1. `build`:   `Trainer` with zero_stage 3 and rollout_backend vllm (learner, engine, the first weight sync; vLLM the
              only engine, no transformers copy of the policy beside it); the learner on attn_implementation
              flash_attention_2 where flash-attn is installed (the GPU recipes' kernel), else sdpa;
2. `step`:    one DAPO step (Algorithm 1: generate, reward, advantages, updates; the engine asleep during the update);
3. `sync`:    the engine's log-probs of freshly sampled tokens against the learner's on the same tokens (the weights the
              engine serves are the learner's after the step);
4. `fused`:   the lm head's fused log-prob backward in bf16 on the device (fused_bf16.py, tests/test_fused_bf16.py's
              derived bound);
5. `accum`:   (GPU, DeepSpeed) 16 bf16 micro-batches summed by ZeRO-2 and ZeRO-3, overlap_comm on and off, the
              optimizer on the GPU and offloaded, against the float64 sum and its fp32 bound (benchmarks/accum_bf16.py);
6. `sleep`:   (GPU, vLLM) free memory awake and asleep (level 1) against `throughput.sleeping_bytes`, what the
              per-phase peaks subtract; `seeds`: decode tokens per second with and without per-request seeds (vLLM's
              V1 sampler loops over seeded rows in Python; its default V2 runner seeds every row);
7. `free`:    the engine closed (its memory back; `close`'s own line on what was not), then `restart`: a new engine,
              the learner's weights loaded, the same log-prob comparison;
8. `lora`:    where PEFT is installed, the 7B LoRA recipe's adapters (r 64, alpha 128, lr 1e-5) on a plain learner,
              served by an engine that applies them as the learner does (vLLM's LoRA layers, a new adapter id per
              sync; or the HF engine's PEFT copy): 10 updates through the engine's own `around_update`, then its
              log-probs against the learner's (within the sync bound), the update's own move on the batch, and the
              share of the update's entries a bf16 merge would have lost (reported: nbs/07c_lora.ipynb).

A JSON summary goes to OUT/gpu_check.json. Exit status: 0 every check passed, 1 a check failed or the run ran past
--timeout, 2 a missing requirement or bad input (one line, before any work)."""

from __future__ import annotations
import argparse, gc, importlib.util, json, os, shutil, subprocess, sys, tempfile, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # Qwen2Config fields; "0.5b" is Qwen2.5-0.5B's config.json
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),  # vLLM CPU: head_dim >= 32
}
RUNS = {  # recipe fields of the two variants
    "gpu": dict(
        dtype="bfloat16",
        l_max=512,
        l_cache=128,
        group_size=8,
        prompts_per_step=8,
        gen_batch_size=8,
        mini_batch_size=32,
        micro_token_budget=8192,
        lr=1e-6,
    ),
    "cpu": dict(
        dtype="float32",
        l_max=24,
        l_cache=8,
        group_size=4,
        prompts_per_step=2,
        gen_batch_size=2,
        mini_batch_size=4,
        micro_token_budget=512,
        lr=1e-4,
    ),
}
VLLM_FIELDS = {  # the engine's fields of each variant (an hf-backend config may not carry them)
    "gpu": dict(vllm_gpu_memory_utilization=0.4, vllm_enforce_eager=False, vllm_enable_chunked_prefill=True),
    "cpu": dict(
        vllm_gpu_memory_utilization=0.3,
        vllm_enforce_eager=True,
        vllm_enable_chunked_prefill=False,
        vllm_dtype="bfloat16",  # a bfloat16 engine beside the float32 learner: a real rollout-learner gap
        rollout_correction="token_truncate",  # the update weighted by the engine's own log-probs (nbs/04b)
    ),
}
# a sync check passes when the engine's and the learner's log-probs of the same tokens differ by less than this (mean
# |d|): float32 on both sides differs by kernel rounding (~1e-6); bf16 kernels by ~1e-2 (verl reports 1e-3..3e-2);
# an engine that kept its dummy weights, or missed the update, differs by ~1 (random weights: log-probs ~ -log V)
SYNC_TOL = {"float32": 1e-3, "bfloat16": 0.1}


def build_model(folder: Path, shape: str, dtype, device: str) -> int:
    "Save a random-weight Qwen2 of `shape` with the tiny task's tokenizer into `folder`; returns its parameter count."
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from dapo_ref.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(folder)
    cfg = Qwen2Config(
        **SHAPES[shape], bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return n


def write_prompts(path: Path, tokenizer_dir: Path, n: int = 64) -> int:
    "`n` tiny-task prompts that all have the same token count (so trained tokens are exact); returns that count."
    from collections import Counter
    from transformers import AutoTokenizer
    from dapo_ref.data import prompt_token_ids, save_math_dataset
    from dapo_ref.tiny import tiny_splits

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pool = tiny_splits(20 * n, 0)[0]
    lens = [len(prompt_token_ids(ex, tok)) for ex in pool]
    common = Counter(lens).most_common(1)[0][0]
    chosen = [ex for ex, l in zip(pool, lens) if l == common][:n]
    if len(chosen) < n:
        raise RuntimeError(f"only {len(chosen)} tiny prompts of {common} tokens")
    save_math_dataset(chosen, path)
    return common


def config(model: Path, data: Path, out: Path, run: dict, backend: str = "vllm"):
    from dapo_ref.cli import config_from_dict

    return config_from_dict(
        dict(
            model=str(model),
            train_data=str(data),
            output_dir=str(out),
            total_steps=1,
            rollout_backend=backend,
            dynamic_sampling=False,
            max_num_gen_batches=1,
            temperature=1.0,
            max_prompt_length=256,
            eval_every=0,
            save_every=0,
            warmup_steps=0,
            **run,
        )
    )


def recipe(path: Path, cfg) -> Path:
    "The config as a recipe file, for dapo-plan."
    from dapo_ref.cli import save_config

    save_config(cfg, path)
    return path


def free_gib(cpu: bool) -> float | None:
    if cpu:
        return None
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / 2**30


def peak_gib(cpu: bool) -> float | None:
    """The most memory PyTorch's allocator held since the last call (the phase's own peak, read through the process's one
    `PeakMemory`, so the trainer's meter resetting the same counter inside a phase does not cut it short)."""
    if cpu:
        return None
    from dapo_ref.throughput import cuda_peaks

    return cuda_peaks().take("gpu_check") / 2**30


def learner_gib(plan: dict, phase: str) -> float | None:
    "dapo-plan's prediction for the learner's side of a phase: every item but the vLLM engine's (an HF engine has none)."
    items = plan.get("items", {})
    return sum(v[phase] for k, v in items.items() if not k.startswith("vllm_")) if items else None


def engine_logprobs(engine, prompts: list[list[int]], comps) -> list[list[float]]:
    "Log-probs of each completion's tokens by a plain padded forward of the engine's own model (the HF engine returns none)."
    import torch

    out = []
    with torch.no_grad():
        for c in comps:
            p = prompts[c.prompt_index]
            ids = torch.tensor([p + c.token_ids], device=engine.device)  # (1, T)
            logits = engine.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()  # (R, V) the logits of the R tokens
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p) :, None])[:, 0]  # (R,)
            out.append(lp.double().cpu().tolist())
    return out


def logprob_gap(engine, learner, prompts: list[list[int]], max_tokens: int) -> dict:
    """Sample 2 responses per prompt with the engine; mean and max |engine log-prob - learner log-prob| over their
    tokens (the engine's own log-probs where it returns them, vLLM; else a plain forward of its model, HF)."""
    import torch
    from dapo_ref.interfaces import RolloutBatch
    from dapo_ref.interfaces import SamplingParams

    comps = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens, seed=7))
    comps = [c for c in comps if c.token_ids]
    if all(c.logprobs is None for c in comps):
        ref = engine_logprobs(engine, prompts, comps)
    else:
        comps = [c for c in comps if c.logprobs is not None]
        ref = [c.logprobs for c in comps]
    batch = RolloutBatch(
        [prompts[c.prompt_index] for c in comps],
        [c.token_ids for c in comps],
        torch.zeros(len(comps)),
        torch.zeros(len(comps), dtype=torch.bool),
        torch.zeros(len(comps)),
    )
    old, _ = learner.compute_logprobs(batch)
    d = torch.cat([(o.double().cpu() - torch.tensor(r, dtype=torch.float64)).abs() for o, r in zip(old, ref)])
    return dict(tokens=int(d.numel()), mean=float(d.mean()), max=float(d.max()))


def lora_phase(
    cfg, model: Path, make_engine, prompts: list[list[int]], max_tokens: int, pad_id: int, updates: int = 10
) -> dict:
    """The 7B LoRA recipe's adapters (r 64, alpha 128, lr 1e-5, all-linear; recipes/dapo-qwen2.5-7b-lora-1gpu.yaml) on a
    plain learner over `model` (the base frozen), served by an engine that applies them as the learner does
    (`make_engine(lcfg, learner)`: vLLM's LoRA layers, or the HF engine's PEFT copy): 10 updates through the engine's
    own `around_update` (vLLM: sleep(1), wake, a new adapter id per sync), then the engine's log-prob gap to the learner
    on tokens it samples, how far the 10 updates moved the learner's log-probs of the batch (what a stale engine would
    miss), and the share of the update's entries a bf16 merge into W0 would have lost (the design this replaced)."""
    import dataclasses
    import torch
    from dapo_ref.algorithm import train_on
    from dapo_ref.interfaces import RolloutBatch, SamplingParams
    from dapo_ref.learner import TorchLearner
    from dapo_ref.policy import load_model
    from dapo_ref.zero import plain_from_pretrained
    from peft.tuners.lora import LoraLayer

    lcfg = dataclasses.replace(
        cfg,
        zero_stage=0,
        lora_r=64,
        lora_alpha=128,
        lora_target_modules="all-linear",
        lr=1e-5,
        warmup_steps=0,
        offload_params=False,
        offload_optimizer=False,
        rollout_correction="none",
    )  # updates on a batch without the engine's log-probs: this phase checks the sync, not the correction
    with plain_from_pretrained():  # whole, not partitioned: the ZeRO-3 learner's config is still alive in this process
        base = load_model(str(model), lcfg.dtype, "sdpa").to("cuda" if torch.cuda.is_available() else "cpu")
    learner = TorchLearner(base, lcfg, pad_token_id=pad_id)  # on the base's device
    engine = make_engine(lcfg, learner)
    try:
        comps = [
            c for c in engine.generate(prompts, SamplingParams(n=4, max_tokens=max_tokens, seed=11)) if c.token_ids
        ]
        n = len(comps) - len(comps) % 2
        batch = RolloutBatch(
            [prompts[c.prompt_index] for c in comps[:n]],
            [c.token_ids for c in comps[:n]],
            torch.tensor([1.0, -1.0] * (n // 2)),  # half pushed up, half down: the policy moves
            torch.zeros(n, dtype=torch.bool),
            torch.zeros(n),
        )
        before, _ = learner.compute_logprobs(batch)
        for _ in range(updates):  # the 10 on a GPU; --cpu runs 3 (its engine decodes ~8x slower with LoRA)
            engine.around_update(lambda: train_on(learner, batch, n), learner.sync_weights)
        after, _ = learner.compute_logprobs(batch)
        moved = float(torch.cat([(a.double() - b.double()).abs().cpu() for a, b in zip(after, before)]).mean())
        gap = logprob_gap(engine, learner, prompts, max_tokens)
        syncs = getattr(engine, "_lora_syncs", None)  # vLLM: one adapter id per sync, the first at the start
    finally:
        if hasattr(engine, "close"):
            engine.close()
    lost = kept = 0  # the update's entries a bf16 W0 would swallow in a merge: W0 + BA rounded to W0 itself
    with torch.no_grad():
        for m in learner.model.modules():
            if isinstance(m, LoraLayer) and m.active_adapters:
                w0 = m.get_base_layer().weight.to(torch.bfloat16)
                delta = m.get_delta_weight(m.active_adapters[0]).float()
                merged = (w0.float() + delta).to(torch.bfloat16)
                moved_entries = delta != 0
                lost += int(((merged == w0) & moved_entries).sum())
                kept += int(moved_entries.sum())
    trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    return dict(
        trained=trained,
        moved_mean=moved,
        adapter_syncs=syncs,
        bf16_merge_lost_frac=lost / max(kept, 1),
        **{f"gap_{k}": v for k, v in gap.items()},
    )


def plan(recipe_path: Path, model: Path, gpu_gb: float) -> dict:
    "`dapo-plan --json` for the recipe (exit status 1 = does not fit still prints the plan)."
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_ref.plan",
            str(recipe_path),
            "--model-arch",
            str(model),
            "--gpu-memory-gb",
            f"{gpu_gb:.1f}",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        return dict(error=(p.stderr or p.stdout).strip().splitlines()[-1:])


def requirements(cpu: bool, with_vllm: bool = True) -> str | None:
    "A one-line message naming what is missing, or None (DeepSpeed is optional: without it the plain learner runs)."
    for mod, fix in (
        ("torch", "pip install torch"),
        ("transformers", 'pip install -e ".[scale]"'),
        ("vllm", 'pip install -e ".[scale]" (on a CPU: make venv-vllm), or --without-vllm for the learner\'s phases'),
    ):
        if importlib.util.find_spec(mod) is None and (with_vllm or mod != "vllm"):
            return f"{mod} is not installed, and every phase needs it: {fix}; nothing was run"
    import torch

    if not cpu and not torch.cuda.is_available():
        return "no CUDA GPU visible to PyTorch; run with --cpu for the CPU variant"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the same phases on the CPU with a tiny Qwen2 (make test)")
    ap.add_argument(
        "--out", default=None, help="a new (or empty) work folder; default: a temporary one, the model removed"
    )
    ap.add_argument(
        "--without-vllm",
        action="store_true",
        help="where vLLM cannot be installed: the HF engine, the learner's phases (free/restart skipped)",
    )
    ap.add_argument(
        "--timeout", type=float, default=540.0, help="seconds for the whole check (default 540: under 10 min)"
    )
    args = ap.parse_args(argv)
    cpu, with_vllm = args.cpu, not args.without_vllm
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"gpu_check: --out {args.out} exists and is not empty; name a new folder", file=sys.stderr)
        return 2
    if missing := requirements(cpu, with_vllm):
        print(f"gpu_check: {missing}", file=sys.stderr)
        return 2
    from dapo_ref.core import InputError
    from dapo_ref.writers import check_build_locks

    try:
        check_build_locks()  # a killed build of a DeepSpeed op would make the learner wait on its lock forever
    except InputError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, beside the learner
    if cpu:
        os.environ.update(DS_ACCELERATOR="cpu", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    t0 = time.perf_counter()
    import torch, transformers
    from dapo_ref.trainer import Trainer

    if not cpu:
        from dapo_ref.throughput import cuda_peaks

        cuda_peaks().start("gpu_check")  # the first phase's peak counts from here
    with_ds = importlib.util.find_spec("deepspeed") is not None

    work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    shape, run = ("tiny", RUNS["cpu"]) if cpu else ("0.5b", RUNS["gpu"])
    device = "CPU" if cpu else torch.cuda.get_device_name(0)
    gpu_gb = 80.0 if cpu else torch.cuda.get_device_properties(0).total_memory / 2**30
    n_params = build_model(work / "model", shape, torch.float32 if cpu else torch.bfloat16, "cpu" if cpu else "cuda")
    write_prompts(work / "prompts.parquet", work / "model")
    flash = not cpu and importlib.util.find_spec("flash_attn") is not None
    fields = dict(run, attn_implementation="flash_attention_2" if flash else "sdpa", zero_stage=3)
    if with_vllm:
        fields.update(VLLM_FIELDS["cpu" if cpu else "gpu"])
    if not with_ds:
        # the plain PyTorch learner: every phase but ZeRO-3's partitioning still runs; float32, as its config must be
        # (bf16 weights without DeepSpeed's fp32 master copy round lr 1e-6 updates away: refused, nbs/00_core)
        fields.update(zero_stage=0, dtype="float32")
    cfg = config(work / "model", work / "prompts.parquet", work / "run", fields, backend="vllm" if with_vllm else "hf")
    predicted = plan(recipe(work / "recipe.yaml", cfg), work / "model", gpu_gb)
    skipped = []
    if cpu and with_vllm:
        skipped += [
            "compiled engine (vLLM on the CPU runs eager here: torch.compile of the model takes minutes on 2 cores)",
            "sleep/wake (vLLM's CPU backend has no sleep mode)",
        ]
    if cpu:
        skipped.append("free GPU memory per phase (no GPU)")
    if not with_vllm:
        skipped += [
            "the vLLM engine: compiled graphs, sleep/wake, its log-probs against the learner's (--without-vllm)",
            "free and restart (vLLM's sleep-mode allocator; --without-vllm)",
        ]
    if not with_ds:
        skipped.append(
            "the ZeRO-3 learner (DeepSpeed is not installed: pip install 'deepspeed>=0.19.8,<0.20'); "
            "the plain PyTorch learner ran"
        )
    if not cpu and not flash:
        skipped.append("the learner on flash_attention_2 (flash-attn is not installed: pip install flash-attn)")
    phases, checks = [], {}

    def phase(name, **info):
        peak = peak_gib(cpu)
        phases.append(
            dict(phase=name, free_gib=free_gib(cpu), peak_gib=peak, s=round(time.perf_counter() - t0, 1), **info)
        )
        print(f"gpu_check: {name}: " + ", ".join(f"{k} {v}" for k, v in phases[-1].items() if k != "phase"), flush=True)
        if time.perf_counter() - t0 > args.timeout:
            raise TimeoutError(f"past --timeout {args.timeout:.0f} s after {name}")

    def fused():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from fused_bf16 import fused_grad_ratio  # no pytest: it runs where only the library is installed

        ratio = fused_grad_ratio(1.0, device="cpu" if cpu else "cuda")
        phase("fused", max_err_over_bound=ratio)
        checks["fused lm-head weight gradient in bf16 within its derived bound"] = ratio <= 1

    torch.set_num_threads(1 if cpu else torch.get_num_threads())
    stage = "build"
    try:
        tr = Trainer(cfg, progress=False, log=None)  # ZeRO-3 learner, the engine, the first weight sync
        order = getattr(tr.engine, "update_order", None)  # vLLM's order of weight loading
        phase(
            "build",
            engine=type(tr.engine).__name__,
            learner=type(tr.learner).__name__,
            **(
                dict(
                    update_order=" ".join(order),
                    eager=cfg.vllm_enforce_eager,
                    engine_dtype=str(tr.engine.llm.llm_engine.vllm_config.model_config.dtype).replace("torch.", ""),
                )
                if order is not None
                else {}
            ),
            attn=cfg.attn_implementation,
            linear_is_torchs=torch.nn.functional.linear is torch._C._nn.linear,
        )
        checks[f"F.linear is torch's own after the {'ZeRO-3 ' if cfg.zero_stage == 3 else ''}learner's build"] = phases[
            -1
        ]["linear_is_torchs"]
        if with_vllm:  # vLLM generates: no transformers copy of the policy may sit beside it (a second model's memory)
            copies = [
                k
                for k, v in vars(tr).items()
                if v is not tr.learner.model
                and type(v).__name__.endswith(("ForCausalLM", "RolloutEngine"))
                and type(v).__name__ != "VLLMRolloutEngine"
            ]
            checks["vLLM is the only engine: no transformers copy of the policy beside it"] = (
                type(tr.engine).__name__ == "VLLMRolloutEngine" and not copies
            )
        stage = "step"
        row = tr.step()
        phase(
            "step",
            grad_updates=row["grad_updates"],
            skipped=row.get("skipped_updates", 0),
            rollout_logp_diff_mean=row.get("rollout_logp_diff_mean"),
            **{k: v for k, v in row.items() if k.startswith(("rollout_w_", "rollout_seq_"))},  # rollout correction
            **{k: row[k] for k in ("time_generate", "time_logprobs", "time_update", "tokens_per_s") if k in row},
            **{k.split("/")[-1] + "_peak_gib": row[k] for k in row if k.startswith("perf/peak_mem_gb/")},
        )
        checks["one DAPO step applied its updates"] = row["grad_updates"] >= 1 and not row.get("skipped_updates", 0)
        stage = "sync"
        probe, tol = tr.prompt_ids[:4], SYNC_TOL[cfg.vllm_dtype or cfg.dtype]  # the engine's dtype bounds the gap
        gap = logprob_gap(tr.engine, tr.learner, probe, run["l_max"])
        phase("sync", **{f"gap_{k}": v for k, v in gap.items()})
        checks[f"engine log-probs = learner's after the step (mean |d| < {tol:g})"] = gap["mean"] < tol
        stage = "fused"
        fused()
        if with_ds and not cpu:  # the CPU's DeepSpeed has neither overlap_comm nor an offload to speak of
            stage = "accum"
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from accum_bf16 import accumulation_ratio

            ratios = {
                f"z{st}_{'overlap' if ov else 'serial'}_{'offload' if off else 'gpu'}": accumulation_ratio(
                    st, str(work / f"accum-{st}{ov}{off}"), overlap=ov, offload=off
                )
                for st in (2, 3)
                for ov in (True, False)
                for off in (False, True)
            }
            phase("accum", **{f"max_err_over_bound_{k}": v for k, v in ratios.items()})
            checks["16 bf16 micro-batches summed within the fp32 bound: ZeRO-2/3, overlap_comm on/off, offload"] = all(
                r <= 1 for r in ratios.values()
            )
        if with_vllm and not cpu:
            stage = "sleep"
            from dapo_ref.throughput import sleeping_bytes

            awake = free_gib(cpu)
            tr.engine.sleep(level=1)
            asleep, counted = free_gib(cpu), sleeping_bytes() / 2**30
            tr.engine.wake()
            phase("sleep", free_awake_gib=awake, free_asleep_gib=asleep, sleeping_gib=round(counted, 2))
            # sleep gives the engine's share back to the device, and the per-phase peaks subtract what it unmapped
            checks["sleep frees the engine's memory and sleeping_bytes counts it (within 1 GiB)"] = (
                abs((asleep - awake) - counted) < 1.0 and counted > 0
            )
        if with_vllm:
            stage = "seeds"
            from dapo_ref.interfaces import SamplingParams

            prompts = [tr.prompt_ids[i % len(tr.prompt_ids)] for i in range(16 if cpu else 64)]  # --cpu: that it runs
            sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=run["l_max"], seed=1)
            rates = {}
            for seeded in (True, False, True):  # the first call warms up; the last two are compared
                tr.engine.seeded_requests = seeded
                t1 = time.perf_counter()
                comps = tr.engine.generate(prompts, sp)
                rates[seeded] = sum(len(c.token_ids) for c in comps) / (time.perf_counter() - t1)
            tr.engine.seeded_requests = True
            runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default")
            phase("seeds", seeded_tok_s=round(rates[True]), unseeded_tok_s=round(rates[False]), v2_runner=runner)
        if with_vllm:
            from dapo_ref.vllm_rollout import VLLMRolloutEngine

            stage = "free"
            line = tr.engine.close()
            phase("free", close=line)
            stage = "restart"
            engine = VLLMRolloutEngine.from_config(
                cfg, model_path=work / "model", world=1, eos_token_id=tr.engine.eos_ids
            )
            engine.load_weights(tr.learner.named_weights())
            gap2 = logprob_gap(engine, tr.learner, probe, run["l_max"])
            phase("restart", **{f"gap_{k}": v for k, v in gap2.items()})
            checks[f"a restarted engine serves the learner's weights (mean |d| < {tol:g})"] = gap2["mean"] < tol
        if with_vllm:
            engine.close()  # one engine at a time: the LoRA phase starts its own (LoRA is a start-time setting)
        if importlib.util.find_spec("peft") is not None:
            stage = "lora"
            eos = tr.engine.eos_ids

            def lora_engine(lcfg, learner):
                "An engine serving `learner`'s adapters: vLLM's LoRA layers (its dtype: the run's engine dtype), or HF."
                from dapo_ref.lora import adapter_config
                from dapo_ref.rollout import HFRolloutEngine

                if not with_vllm:
                    return HFRolloutEngine(learner.policy_copy(), eos_token_id=eos, pad_token_id=tr.pad_id)
                e = VLLMRolloutEngine.from_config(
                    lcfg, model_path=work / "model", world=1, eos_token_id=eos, lora_config=adapter_config(lcfg)
                )
                e.load_weights(learner.sync_weights())
                return e

            updates = 3 if cpu else 10
            lo = lora_phase(cfg, work / "model", lora_engine, probe, run["l_max"], tr.pad_id, updates)
            phase("lora", **lo)
            checks[
                f"LoRA at the 7B recipe's settings: the engine serves the learner's adapters (mean |d| < {tol:g})"
            ] = lo["gap_mean"] < tol and lo["adapter_syncs"] in (None, updates + 1)
        else:
            skipped.append("the LoRA phase (PEFT is not installed: pip install peft)")
    except TimeoutError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a phase that raises is a failed check, reported with the rest (one run may be all we get)
        traceback.print_exc()
        checks[f"{stage} ran ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"] = False
        if stage in ("build", "step", "sync"):
            try:  # the fused check needs none of the phases before it
                fused()
            except Exception as e2:
                traceback.print_exc()
                checks[f"fused ran ({type(e2).__name__})"] = False
    versions = dict(torch=torch.__version__, transformers=transformers.__version__)
    if with_ds:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    if with_vllm:
        import vllm

        versions["vllm"] = vllm.__version__
    summary = dict(
        device=device,
        backend=cfg.rollout_backend,
        versions=versions,
        n_params=n_params,
        shape=shape,
        recipe=dict(run, zero_stage=cfg.zero_stage),
        plan=predicted,
        phases=phases,
        checks=checks,
        skipped=skipped,
        wall_s=time.perf_counter() - t0,
    )
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    report(summary)
    if not args.out:
        shutil.rmtree(work / "model", ignore_errors=True)
    print(f"summary: {work / 'gpu_check.json'}")
    return 0 if all(checks.values()) else 1


def report(s: dict):
    learner = next((p["learner"] for p in s["phases"] if "learner" in p), None)
    learner = (
        "plain PyTorch learner"
        if learner in ("TorchLearner", None) and s["recipe"].get("zero_stage") == 0
        else "ZeRO-3 learner"
    )
    print(
        f"gpu_check on {s['device']}: Qwen2 of {s['n_params'] / 1e6:,.1f}M parameters (random weights), "
        f"{s['recipe']['dtype']}, {learner} + {'vLLM' if s['backend'] == 'vllm' else 'HF'} engine in one process; "
        + ", ".join(f"{k} {v}" for k, v in s["versions"].items())
    )
    pl = s["plan"]
    if "phases_gb" in pl:
        print(
            "dapo-plan per GPU: "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in pl["phases_gb"].items())
            + f"; peak {pl['peak_gb']:.1f} GiB"
        )
    else:
        print(f"dapo-plan: {pl.get('error')}")
    learner_side = (
        s["backend"] != "vllm"
    )  # with vLLM the device also holds the engine's pool, which the plan counts apart
    for p in s["phases"]:
        free = "n/a" if p["free_gib"] is None else f"{p['free_gib']:.1f} GiB"
        peak = "" if p.get("peak_gib") is None else f", peak allocated {p['peak_gib']:.1f} GiB"
        pred = learner_gib(pl, "load") if p["phase"] == "build" and learner_side and peak else None
        pred = "" if pred is None else f" (dapo-plan load, learner side: {pred:.1f} GiB)"
        if p["phase"] == "step" and p.get("update_peak_gib") is not None:  # the trainer's own update peak
            upd = learner_gib(pl, "update") if learner_side else None
            pred = f"; its update {p['update_peak_gib']:.1f} GiB" + (
                "" if upd is None else f" (dapo-plan update, learner side: {upd:.1f} GiB)"
            )
        print(f"  {p['phase']:<8} at {p['s']:6.1f} s   free device memory {free}{peak}{pred}")
    for name, ok in s["checks"].items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    for name in s["skipped"]:
        print(f"  [skipped] {name}")
    print(f"wall {s['wall_s']:.0f} s (limit 10 min)")


if __name__ == "__main__":
    sys.exit(main())
