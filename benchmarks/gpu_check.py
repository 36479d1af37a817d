"""One-GPU check of the ZeRO-3 learner: two DAPO steps of a Qwen2.5-Math-1.5B-shaped model through `dapo-train`.

    python benchmarks/gpu_check.py                # one recent NVIDIA GPU; about 3-5 minutes, limit 8
    python benchmarks/gpu_check.py --cpu-tiny     # the same path on the CPU with a tiny Qwen2 (what CI runs)

Needs PyTorch with CUDA, transformers and DeepSpeed (`pip install <deepspeed wheel>`), no network: the model is a
Qwen2 config of Qwen2.5-Math-1.5B's shape (28 layers, d 1536, vocab 151936, tied embeddings; 1.54B parameters) built in
code with random weights and saved next to the tiny task's tokenizer; the prompts are tiny-task problems of equal
length in the DAPO-Math-17k schema. The run is `torchrun --nproc_per_node 1 ... dapo-train --config recipe.yaml`
with zero_stage 3, gradient checkpointing, the transformers rollout engine, bf16, l_max 1024, G 8, 4 prompts per
step, dynamic sampling off (random weights give every response the same reward, which dynamic sampling would
reject; the update still runs its full forward and backward), no held-out evaluation.

Printed: the measured peak GPU memory (the learner process's max allocated and reserved, and the device's used
memory sampled by nvidia-smi) next to `dapo-plan`'s prediction for the same recipe; learner tokens/s = (prompt +
response tokens trained) / (log-prob pass + update time) per step; model FLOPs utilisation = model FLOPs of those
passes (PaLM's convention: 6N + 6 L d S per trained token, 2N + 2 L d S per log-prob token, recomputation not
counted) / time / the GPU's dense bf16 peak (`--peak-tflops` for GPUs not in the table). A JSON summary is written
to OUT/gpu_check.json. Exit status: 0 done, 1 the run failed or ran past --timeout, 2 a missing requirement."""
from __future__ import annotations
import argparse, json, os, shutil, socket, subprocess, sys, tempfile, threading, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # Qwen2Config fields; "1.5b" is Qwen2.5-Math-1.5B's config.json (the 1-GPU recipe's model)
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
}
RUNS = {  # recipe fields of the two variants (plus the common ones in `recipe`)
    "gpu": dict(dtype="bfloat16", l_max=1024, l_cache=256, group_size=8, prompts_per_step=4, gen_batch_size=4,
                mini_batch_size=16, micro_token_budget=8192, lr=1e-6),
    "cpu": dict(dtype="float32", l_max=24, l_cache=8, group_size=4, prompts_per_step=2, gen_batch_size=2,
                mini_batch_size=4, micro_token_budget=512, lr=1e-4),
}
PEAK_BF16_TFLOPS = {"B200": 2250, "H200": 989, "GH200": 989, "H100": 989, "H800": 989, "A100": 312, "A800": 312,
                    "L40S": 362, "L40": 181, "RTX 6000 Ada": 364, "L4": 121, "A10": 125, "RTX 4090": 165, "A6000": 155}


def port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return str(s.getsockname()[1])


def build_model(folder: Path, shape: str, dtype, device: str) -> int:
    "Save a random-weight Qwen2 of `shape` with the tiny task's tokenizer into `folder`; returns its parameter count."
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from dapo_ref.tiny import build_tiny_tokenizer
    tok = build_tiny_tokenizer(folder)
    cfg = Qwen2Config(**SHAPES[shape], bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda": torch.cuda.empty_cache()
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
    if len(chosen) < n: raise RuntimeError(f"only {len(chosen)} tiny prompts of {common} tokens")
    save_math_dataset(chosen, path)
    return common


def recipe(path: Path, model: Path, data: Path, out: Path, run: dict) -> Path:
    import yaml
    fields = dict(model=str(model), train_data=str(data), output_dir=str(out), total_steps=2, zero_stage=3,
                  gradient_checkpointing=True, rollout_backend="hf", dynamic_sampling=False, max_num_gen_batches=1,
                  max_prompt_length=256, eval_every=0, save_every=0, warmup_steps=0, **run)
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def child(result: Path, argv: list[str]) -> int:
    "Inside torchrun: `dapo-train argv`, then this process's peak CUDA memory into `result`."
    import torch
    from dapo_ref.train import main
    rc = main(argv)
    peaks = {}
    if torch.cuda.is_available():
        peaks = dict(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())
    result.write_text(json.dumps(dict(rc=rc, **peaks)))
    return rc


class DeviceMemory(threading.Thread):
    "Samples the GPU's used memory (nvidia-smi) every 0.2 s; `peak` in bytes, None without nvidia-smi."
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = None, threading.Event()
    def run(self):
        exe = shutil.which("nvidia-smi")
        while exe and not self.stop.is_set():
            try:
                out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                if out: self.peak = max(self.peak or 0, int(out[0]) * 2**20)
            except (subprocess.SubprocessError, ValueError): pass
            self.stop.wait(0.2)


def flops_per_step(row: dict, n_params: int, shape: dict, n_resp: int, prompt_len: int) -> tuple[int, float]:
    "(trained tokens, model FLOPs) of one step's log-prob pass and update (PaLM's MFU convention)."
    L, d = shape["num_hidden_layers"], shape["hidden_size"]
    seq = prompt_len + row["resp_len_mean"]            # mean sequence length
    tokens = n_resp * seq
    per_token = 6 * n_params + 6 * L * d * seq         # forward + backward of the update (causal attention: S/2 context)
    per_token += 2 * n_params + 2 * L * d * seq        # the old-policy log-prob forward
    return int(round(tokens)), tokens * per_token


def plan(recipe_path: Path, model: Path, gpu_gb: float) -> dict:
    "`dapo-plan --json` for the recipe (exit status 1 = does not fit still prints the plan)."
    p = subprocess.run([sys.executable, "-m", "dapo_ref.plan", str(recipe_path), "--model-arch", str(model),
                        "--gpu-memory-gb", f"{gpu_gb:.1f}", "--json"], capture_output=True, text=True, cwd=ROOT)
    try: return json.loads(p.stdout)
    except json.JSONDecodeError: return dict(error=(p.stderr or p.stdout).strip().splitlines()[-1:])


def requirements(cpu: bool) -> str | None:
    "A one-line message naming what is missing, or None."
    try: import torch
    except ImportError: return "PyTorch is not installed"
    try: import transformers, deepspeed  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed: pip install its wheel (e.g. pip install deepspeed-0.19.8-py3-none-any.whl)"
    if not cpu and not torch.cuda.is_available():
        return "no CUDA GPU visible to PyTorch; run with --cpu-tiny for the CPU variant"
    return None


def warnings_before_run(cpu: bool) -> list[str]:
    "Things that may stop the GPU run later, said up front."
    out = []
    if not cpu and not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        out.append("no nvcc (CUDA toolkit) found: DeepSpeed JIT-compiles its fused AdamW on first use; if the run fails "
                   "building 'fused_adam', install the toolkit or a DeepSpeed wheel built with DS_BUILD_FUSED_ADAM=1")
    return out


def peak_tflops(name: str) -> float | None:
    "Dense bf16 peak of a GPU named `name` (longest matching table key), None if not in the table."
    if "H100" in name and "PCIe" in name: return 756.0
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name: return float(PEAK_BF16_TFLOPS[key])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]: return child(Path(argv[1]), argv[2:])  # inside torchrun
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-tiny", action="store_true", help="the same path on the CPU with a tiny Qwen2 (CI)")
    ap.add_argument("--out", default=None, help="a new (or empty) work folder; default: a temporary one, large files removed")
    ap.add_argument("--keep", action="store_true", help="keep the model and the run's checkpoints in the work folder")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    ap.add_argument("--timeout", type=float, default=450.0, help="seconds for the whole check (default 450: under 8 min)")
    args = ap.parse_args(argv)
    cpu = args.cpu_tiny
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"gpu_check: --out {args.out} exists and is not empty; name a new folder", file=sys.stderr); return 2
    missing = requirements(cpu)
    if missing: print(f"gpu_check: {missing}", file=sys.stderr); return 2
    t_start = time.perf_counter()
    import torch, transformers, deepspeed
    for w in warnings_before_run(cpu): print(f"gpu_check: warning: {w}", file=sys.stderr)
    work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-")); work.mkdir(parents=True, exist_ok=True)
    shape, run = ("tiny", RUNS["cpu"]) if cpu else ("1.5b", RUNS["gpu"])
    gpu_name = "CPU" if cpu else torch.cuda.get_device_name(0)
    gpu_gb = 80.0 if cpu else torch.cuda.get_device_properties(0).total_memory / 2**30
    n_params = build_model(work / "model", shape, torch.float32 if cpu else torch.bfloat16, "cpu" if cpu else "cuda")
    prompt_len = write_prompts(work / "prompts.parquet", work / "model")
    rec = recipe(work / "recipe.yaml", work / "model", work / "prompts.parquet", work / "run", run)
    predicted = plan(rec, work / "model", gpu_gb)
    t_setup = time.perf_counter() - t_start

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cpu: env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", port(),
           str(Path(__file__).resolve()), "--child", str(work / "child.json"), "--config", str(rec), "--quiet",
           *(["--threads", "1"] if cpu else [])]
    mon = DeviceMemory()
    if not cpu: mon.start()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=max(10.0, args.timeout - (time.perf_counter() - t_start)))
    except subprocess.TimeoutExpired:
        print(f"gpu_check: dapo-train ran past --timeout {args.timeout:.0f} s (setup took {t_setup:.0f} s)", file=sys.stderr)
        return 1
    finally: mon.stop.set()
    if p.returncode or not (work / "child.json").exists():
        print(f"gpu_check: dapo-train failed (exit status {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
        return 1
    peaks = json.loads((work / "child.json").read_text())
    rows = [json.loads(l) for l in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time_update" in r]
    n_resp = run["prompts_per_step"] * run["group_size"]
    tflops = args.peak_tflops or (None if cpu else peak_tflops(gpu_name))
    per_step = []
    for r in steps:
        tokens, flops = flops_per_step(r, n_params, SHAPES[shape], n_resp, prompt_len)
        t = r["time_logprobs"] + r["time_update"]
        per_step.append(dict(step=r["step"], learner_tokens=tokens, learner_s=t, tokens_per_s=tokens / t,
                             mfu=flops / t / (tflops * 1e12) if tflops else None, generate_s=r.get("time_generate"),
                             resp_len_mean=r["resp_len_mean"]))
    wall = time.perf_counter() - t_start
    summary = dict(device=gpu_name, versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                                                  deepspeed=deepspeed.__version__), n_params=n_params, shape=shape, recipe=run, prompt_len=prompt_len, peak=peaks,
                   device_used_peak=mon.peak, plan=predicted, steps=per_step, peak_tflops=tflops, wall_s=wall)
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    report(summary)
    if not args.keep:
        for d in ("model", "run"): shutil.rmtree(work / d, ignore_errors=True)
    print(f"summary: {work / 'gpu_check.json'}")
    return 0 if len(per_step) == 2 else 1


def report(s: dict):
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.1f} GiB"
    r = s["recipe"]
    print(f"gpu_check on {s['device']}: Qwen2 of {s['n_params'] / 1e6:,.1f}M parameters (random weights), {r['dtype']}, ZeRO-3 + gradient "
          f"checkpointing, transformers engine, l_max {r['l_max']}, {r['prompts_per_step']} prompts x G {r['group_size']}; "
          + ", ".join(f"{k} {v}" for k, v in s["versions"].items()))
    pk = s["peak"]
    print(f"peak GPU memory, measured: max allocated {gib(pk.get('max_allocated'))}, max reserved "
          f"{gib(pk.get('max_reserved'))}, device used {gib(s['device_used_peak'])} (nvidia-smi)")
    pl = s["plan"]
    if "phases_gb" in pl:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in pl["phases_gb"].items())
        print(f"peak GPU memory, dapo-plan: {pl['peak_gb']:.1f} GiB ({phases} GiB; its rollout row models vLLM)")
    else: print(f"dapo-plan: {pl.get('error')}")
    for st in s["steps"]:
        mfu = "n/a" if st["mfu"] is None else f"{100 * st['mfu']:.1f}%"
        print(f"step {st['step']}: learner {st['learner_tokens']} tokens in {st['learner_s']:.1f} s = "
              f"{st['tokens_per_s']:,.0f} tokens/s, MFU {mfu}; generation {st['generate_s']:.1f} s, "
              f"mean response {st['resp_len_mean']:.0f} tokens")
    print(f"wall {s['wall_s']:.0f} s (limit 8 min)")


if __name__ == "__main__":
    sys.exit(main())
