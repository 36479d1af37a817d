"""Reward throughput per mode: responses per second on one generation round, and the worst single call.

    .venv/bin/python benchmarks/bench_reward.py                  # 8192 responses (512 prompts x G = 16)
    .venv/bin/python benchmarks/bench_reward.py --n 2048 --single 256 --timeout 5

Builds a deterministic round of real-length math solutions (a few hundred to a few thousand characters of
LaTeX working, then an `Answer:` line; ground truths of the DAPO-Math-17k kinds: integers, fractions, radicals,
tuples, expressions; answers right, wrong, or right in another form such as `0.5` for `\\frac{1}{2}`), and
scores it with `score_batch` in each mode, side by side in one run. Then:

- the worst single call: `score_response` timed on each response of the round (string modes) or of a
  `--single` subset (math-verify, where each call is a round trip to the pool);
- the same round with 16 of its responses replaced by distinct pathological answers (power towers, which
  sympy never finishes): math-verify's time should be about the ordinary time plus one `--timeout`.
"""

import argparse, os, platform, random, time


from dapo_ref.reward import score_batch, score_response, REWARD_MODES
from dapo_ref.reward_pool import default_workers, verify_pairs

_TRUTHS = [  # (ground truth, equivalent forms a model writes that are not the same string)
    ("42", ["42.0", "\\boxed{42}"]),
    ("\\frac{1}{2}", ["0.5", "1/2", "\\dfrac{1}{2}"]),
    ("2\\sqrt{3}", ["\\sqrt{12}"]),
    ("(1,2)", ["(1, 2)"]),
    ("x^2+1", ["1+x^2"]),
    ("\\frac{\\pi}{4}", ["\\pi/4"]),
    ("-7", ["\u22127"]),
    ("540", ["540^\\circ"]),
    ("\\frac{3\\sqrt{2}}{2}", ["\\frac{3}{\\sqrt{2}}"]),
    ("12", ["12.00"]),
    ("3+2\\sqrt{2}", ["2\\sqrt{2}+3"]),
    ("100", ["10^2"]),
]
_STEP = [
    "Let $x$ be the unknown; then $x^2 - 5x + 6 = 0$, so $(x-2)(x-3) = 0$.",
    "Substituting, we get $\\frac{a+b}{2} = \\sqrt{ab}$ only when $a = b$.",
    "By the triangle inequality, $|a - b| \\le |a| + |b|$, with equality iff $ab \\le 0$.",
    "Summing the geometric series, $\\sum_{k=0}^{n} r^k = \\frac{1 - r^{n+1}}{1 - r}$.",
    "Wait, let me double-check this step: the area is $\\frac{1}{2} \\cdot 6 \\cdot 4 = 12$.",
    "Hence the number of ways is $\\binom{8}{3} = 56$, and we continue with the remaining cases.",
]


def make_round(n: int, seed: int = 0, G: int = 16):
    "n responses, G per prompt: 40% right as a string, 10% right in another form, 45% wrong, 5% without an answer line."
    rng, resp, gts = random.Random(seed), [], []
    for p in range(0, n, G):
        gt, forms = _TRUTHS[rng.randrange(len(_TRUTHS))]
        for _ in range(G):
            body = "\n\n".join(rng.choice(_STEP) for _ in range(rng.randint(3, 30)))  # ~200-2500 characters
            u = rng.random()
            ans = gt if u < 0.4 else rng.choice(forms) if u < 0.5 else str(rng.randint(0, 999)) if u < 0.95 else None
            resp.append(body + ("\n\nThe answer is not clear." if ans is None else f"\n\nAnswer: {ans}"))
            gts.append(gt)
    return resp[:n], gts[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192, help="responses in the round (paper: 512 prompts x 16)")
    ap.add_argument("--single", type=int, default=1024, help="responses timed one call at a time in math-verify mode")
    ap.add_argument("--timeout", type=float, default=5.0, help="math-verify per-call limit, seconds")
    ap.add_argument("--workers", type=int, default=None, help="math-verify workers (default: default_workers())")
    args = ap.parse_args(argv)
    resp, gts = make_round(args.n)
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"math-verify workers {args.workers or default_workers()}, per-call limit {args.timeout} s"
    )
    print(f"{args.n} responses, mean {sum(map(len, resp)) / len(resp):.0f} characters")
    t = time.perf_counter()
    verify_pairs([("$1$", "$1$")])
    start = time.perf_counter() - t
    print(f"math-verify pool start (once per process): {start:.2f} s")
    print(f"{'mode':16s} {'batch s':>8s} {'resp/s':>9s} {'accuracy':>9s} {'mv calls':>9s} {'worst call s':>13s}")
    for mode in REWARD_MODES:
        t = time.perf_counter()
        scores, accs, m = score_batch(resp, gts, mode=mode, timeout=args.timeout, workers=args.workers)
        dt = time.perf_counter() - t
        idx = (
            range(len(resp))
            if mode != "math-verify"
            else random.Random(1).sample(range(len(resp)), min(args.single, len(resp)))
        )
        worst = 0.0
        for i in idx:
            t = time.perf_counter()
            score_response(resp[i], gts[i], mode=mode, timeout_s=args.timeout)
            worst = max(worst, time.perf_counter() - t)
        print(
            f"{mode:16s} {dt:8.2f} {len(resp) / dt:9.0f} {accs.float().mean().item():9.3f} "
            f"{m['reward_math_verify_calls']:9d} {worst:13.4f}"
            + (f"  (over {len(idx)} calls)" if mode == "math-verify" else "")
        )
    bad = list(resp)
    for k in range(16):
        bad[k * (len(bad) // 16)] = f"Answer: 9^{{9^{{9^{{9^{{{k + 2}}}}}}}}}"
    t = time.perf_counter()
    scores, accs, m = score_batch(bad, gts, mode="math-verify", timeout=args.timeout, workers=args.workers)
    dt = time.perf_counter() - t
    print(
        f"math-verify with 16 pathological responses: {dt:.2f} s, reward_timeouts {m['reward_timeouts']}, "
        f"their scores {sorted(set(scores[[k * (len(bad) // 16) for k in range(16)]].tolist()))}"
    )


if __name__ == "__main__":
    main()
