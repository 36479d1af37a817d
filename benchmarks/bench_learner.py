"""The learner at DAPO's lengths: packed vs padded micro-batches, fused vs unfused log-probs, the 32B step's balance.

    .venv/bin/python benchmarks/bench_learner.py            # about 2.5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_learner.py --quick    # a smoke run (seconds)

Three measurements, side by side in one run:

(a) One `TorchLearner.update` (forward + backward + AdamW) on a small Qwen2 model (built here, saved with
    `save_pretrained`, loaded with `from_pretrained`) and one batch of DAPO-like lengths: (c)'s first setting scaled
    to L_max = 2048 (responses lognormal, median L_max / 51.2, sigma 1, cut at L_max, plus 5% of them exactly L_max
    long, the truncated ones; prompts lognormal around 15 tokens; micro_token_budget 1.1 L_max, as 22528 / 20480). The same batch and token budget through the packed layout (the learner's) and
    the padded one (`collate`, `pack_micro_batches(padded=True)`); real tokens per second of each, the best of
    6 runs each, interleaved, and the two losses (the same mini-batch loss up to float32 rounding).
(b) Peak memory above the start (this process's VmHWM, Linux) of log-probs forward + backward at V = 152064 for T
    = 4096 response positions: the logits then `token_logprobs` vs `fused_token_logprobs`, each in a fresh process.
(c) The 32B recipe's learner step on 128 ranks, simulated with the project's own balancing (`sharded_learner.balanced_share`,
    by prompt + response tokens) and packing (`packing.pack_micro_batches`): 512 x 16 responses, mini-batches of
    512, micro_token_budget 22528. A pass costs its tokens plus one all-gather of the weights (every rank waits for
    the slowest at each pass, and a rank with fewer micro-batches runs dummy passes that still gather); the ideal
    step spreads every mini-batch's tokens evenly in the fewest passes. Two length settings (mean response about
    1.7k and 4.8k tokens, 5% at L_max = 20480), without and with Ulysses sequence parallelism (groups of SP ranks
    share every sequence, each holding 1/SP of its tokens; the budget is per rank); the summary reports the worse
    setting at the recipe's own `sequence_parallel_size` (8).

The last line is the summary:
    bench_learner: packed X.XXx the padded tokens/s; log-prob peak Y MiB fused vs Z MiB unfused; 32B recipe learner step W.WWx ideal
"""

import argparse, math, os, platform, subprocess, sys, tempfile, time
from pathlib import Path

import torch


def lengths(n: int, l_max: int, median: float, sigma: float, p_max: float, seed: int) -> list[int]:
    "n response lengths: lognormal(median, sigma) cut to [1, l_max], then a fraction p_max set to l_max (truncated)."
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * sigma + math.log(median)).exp().round().clamp(1, l_max)
    x[torch.rand(n, generator=g, dtype=torch.float64) < p_max] = l_max
    return [int(v) for v in x]


def small_qwen2(folder: Path, vocab: int, hidden: int, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def bench_update(a) -> dict:
    "(a): real tokens per second of one learner update, packed vs padded, on one batch."
    from transformers import AutoModelForCausalLM
    from dapo_ref import learner as L
    from dapo_ref.core import DAPOConfig
    from dapo_ref.learner import TorchLearner
    from dapo_ref.interfaces import RolloutBatch
    from dapo_ref.packing import collate, pack_micro_batches

    torch.set_num_threads(a.threads)
    folder = small_qwen2(Path(tempfile.mkdtemp()) / "qwen2-small", 4096, a.hidden, a.layers)
    scale = a.l_max / 20480  # (c)'s first setting (median response 400 of L_max 20480, prompts around 150) scaled down
    resp = lengths(a.batch, a.l_max, 400 * scale, 1.0, 0.05, seed=0)
    prm = lengths(a.batch, 2048, 150 * scale, 0.5, 0.0, seed=1)
    g = torch.Generator().manual_seed(2)
    P = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in prm]
    R = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in resp]
    adv = torch.randn(a.batch, generator=g)
    batch = RolloutBatch(P, R, adv, torch.tensor([n == a.l_max for n in resp]), torch.zeros(a.batch))
    budget = int(1.1 * a.l_max)  # the 32B recipe's micro_token_budget / L_max = 22528 / 20480
    cfg = DAPOConfig(
        model=str(folder), micro_token_budget=budget, l_max=a.l_max, l_cache=a.l_max // 4, lr=1e-6, warmup_steps=0
    )
    out, real = {}, sum(prm) + sum(resp)
    for layout in ("packed", "padded", "packed", "padded")[: 2 if a.quick else 4]:  # the first two warm up; then timed
        best, loss, passes = out.get(layout, {}).get("seconds", math.inf), None, None
        for _ in range(a.repeats):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            lrn = TorchLearner.build(cfg, 0, model=model)
            old = [torch.full((len(r),), -8.0) for r in R]  # near log(1/4096): ratios about 1 on this random model
            saved = L.pack, lrn.micro_batches
            if layout == "padded":
                L.pack = lambda p, r: collate(p, r, pad_id=0)
                lrn.micro_batches = lambda b: pack_micro_batches(
                    [(len(p), len(r)) for p, r in zip(b.prompt_ids, b.response_ids)], budget, padded=True
                )
            try:
                t0 = time.perf_counter()
                m = lrn.update(batch, old)
                dt = time.perf_counter() - t0
                passes = len(lrn.micro_batches(batch))
            finally:
                L.pack = saved[0]
                lrn.__dict__.pop("micro_batches", None)
            best, loss = min(best, dt), m["loss"]
        out[layout] = dict(seconds=best, tokens_per_s=real / best, loss=loss, passes=passes)  # the best of all runs
    pad_tokens = sum(
        len(mb) * (max(prm[i] for i in mb) + max(resp[i] for i in mb))
        for mb in pack_micro_batches(list(zip(prm, resp)), budget, padded=True)
    )
    out.update(real_tokens=real, padded_tokens=pad_tokens, mean_response=sum(resp) / len(resp))
    return out


def child_peak(mode: str, T: int, V: int, H: int, threads: int) -> int:
    "(b), in a fresh process: peak bytes above the start of log-prob forward + backward."
    from dapo_ref.logprobs import fused_token_logprobs, token_logprobs
    from dapo_ref.zero import PeakRSS

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g, dtype=torch.bfloat16).requires_grad_()
    W = (torch.randn(V, H, generator=g, dtype=torch.bfloat16) / H**0.5).requires_grad_()
    lab = torch.randint(0, V, (T,), generator=g)
    W.grad = torch.zeros_like(W)
    h.grad = torch.zeros_like(h)  # the gradients' own memory is outside the comparison
    with PeakRSS() as m:
        if mode == "fused":
            lp = fused_token_logprobs(h, W, lab)[0]
        else:
            lp = token_logprobs((h @ W.T)[None], lab[None])[0]  # the lm head's bf16 logits, then fp32 chunks
        lp.sum().backward()
    return m.extra


def simulate_32b(
    median: float,
    seed: int,
    sp: int = 1,
    world: int = 128,
    prompts: int = 512,
    G: int = 16,
    mini: int = 512,
    budget: int = 22528,
    l_max: int = 20480,
    gather_tokens: float = 1333.0,
) -> dict:
    """(c): the learner step of one rollout step, in token-equivalents, against the ideal balanced step. With `sp` > 1,
    Ulysses sequence parallelism: groups of `sp` ranks share their sequences, each rank holding 1/sp of every token."""
    from dapo_ref.packing import pack_micro_batches
    from dapo_ref.sharded_learner import balanced_share

    B, groups = prompts * G, world // sp
    resp = lengths(B, l_max, median, 1.0, 0.05, seed)
    prm = [n for n in lengths(prompts, 2048, 150, 0.5, 0.0, seed + 1) for _ in range(G)]  # G responses share a prompt
    tot = [p + r for p, r in zip(prm, resp)]
    shares = [balanced_share(tot, mini, r, groups) for r in range(groups)]  # shares[group][mini-batch] -> indices
    step = ideal = dummy = passes_all = 0.0
    for k in range(B // mini):
        per = [pack_micro_batches([(prm[i], resp[i]) for i in shares[r][k]], budget * sp) for r in range(groups)]
        cost = [[sum(tot[shares[r][k][j]] for j in mb) / sp for mb in mbs] for r, mbs in enumerate(per)]  # per rank
        n = max(len(c) for c in cost)
        step += sum(max((c[p] if p < len(c) else 0) for c in cost) + gather_tokens for p in range(n))
        dummy += sum(n - len(c) for c in cost)
        passes_all += n * groups
        each = sum(tot[k * mini : (k + 1) * mini]) / world
        ideal += each + math.ceil(each / budget) * gather_tokens
    return dict(mean_response=sum(resp) / B, longest=max(tot), ratio=step / ideal, dummy_frac=dummy / passes_all)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--child", nargs=5, metavar=("MODE", "T", "V", "H", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(child_peak(a.child[0], *map(int, a.child[1:])))
        return
    a.batch, a.l_max, a.hidden, a.layers, a.repeats = (16, 512, 64, 2, 1) if a.quick else (64, 2048, 256, 4, 3)
    T, V, H = (512, 152064, 64) if a.quick else (4096, 152064, 64)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{a.threads} threads"
    )
    u = bench_update(a)
    speedup = u["packed"]["tokens_per_s"] / u["padded"]["tokens_per_s"]
    print(
        f"(a) update, {a.batch} responses (mean {u['mean_response']:.0f} tokens, L_max {a.l_max}), "
        f"{u['real_tokens']} real tokens, {u['padded_tokens']} in the padded layout:"
    )
    for k in ("packed", "padded"):
        r = u[k]
        print(
            f"    {k}: {r['passes']} micro-batches, {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} real tokens/s, loss {r['loss']:.6f}"
        )
    peaks = {}
    for mode in ("fused", "unfused"):
        res = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(T), str(V), str(H), str(a.threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[mode] = int(res.stdout.split()[-1]) / 2**20
    print(
        f"(b) log-prob forward + backward, T = {T}, V = {V}, H = {H}, bf16: peak above start "
        f"{peaks['fused']:.0f} MiB fused, {peaks['unfused']:.0f} MiB unfused ({peaks['unfused'] / peaks['fused']:.1f}x)"
    )
    from dapo_ref.cli import load_config

    recipe_sp = load_config(
        Path(__file__).resolve().parents[1] / "recipes/dapo-qwen2.5-32b.yaml"
    ).sequence_parallel_size
    sims = []
    for med in (400, 2400) if not a.quick else (400,):
        for n_sp in (1, 2, 4, 8):
            s = simulate_32b(med, seed=3, sp=n_sp)
            if n_sp == recipe_sp:
                sims.append(s)
            print(
                f"(c) 32B recipe, 128 ranks, mean response {s['mean_response']:.0f} tokens (longest sequence "
                f"{s['longest']}), {'no sequence parallelism' if n_sp == 1 else f'Ulysses SP {n_sp}'}: learner step "
                f"{s['ratio']:.2f}x the ideal balanced step, {s['dummy_frac']:.1%} dummy passes"
            )
    w = max(s["ratio"] for s in sims)  # the recipe as it is (its sequence_parallel_size), the worse length setting
    print(
        f"bench_learner: packed {speedup:.2f}x the padded tokens/s; log-prob peak {peaks['fused']:.0f} MiB fused vs "
        f"{peaks['unfused']:.0f} MiB unfused; 32B recipe learner step {w:.2f}x ideal"
    )


if __name__ == "__main__":
    main()
