"""Tests of dapo_ref.reward and dapo_ref.reward_pool that do not belong in the lesson: the dapo-strict case table,
the lesson's longer tables, properties, fuzzing, adversarial inputs, math-verify in threads, daemonic workers and
torchrun ranks, and `score_batch` under load. The dapo-reference (default) case table is in
tests/test_reward_reference.py."""

import multiprocessing as mp, os, re, signal, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from dapo_ref import answers as R, reward_pool as P
from dapo_ref.answers import extract_answer, extract_answer_reference, normalize_answer
from dapo_ref.reward import score_response, score_batch, overlong_penalty

STRING_MODES = ("dapo-reference", "dapo-strict")

MINUS = "\u2212"  # Unicode minus sign: normalised to ASCII "-" (our addition; the reference keeps it apart)

# dapo-strict: (response, ground truth, expected score, why). Each expected score was worked out by hand from
# its rules: last `Answer:` on its line, last 300 characters, then the normaliser with our merges (nbs/02_reward.ipynb).
CASES = [
    ("Answer: 42", "42", 1, "plain integer"),
    ("Answer: 42", "43", -1, "wrong integer"),
    ("Answer: $42$", "42", 1, "dollars dropped"),
    ("Answer: \\boxed{42}", "42", 1, "boxed unwrapped"),
    ("Answer: $\\boxed{42}$", "\\boxed{42}", 1, "boxed on both sides"),
    ("Answer: \\text{42}", "42", 1, "\\text unwrapped"),
    ("Answer: \\textbf{12}", "12", 1, "\\textbf unwrapped"),
    ("Answer: 42 units", "42", 1, "unit word `units`"),
    ("Answer: 15 degrees", "15", 1, "unit word `degrees`"),
    ("Answer: 30^\\circ", "30", 1, "^\\circ"),
    ("Answer: 30^{\\circ}", "30", 1, "^{\\circ}"),
    ("Answer: \\$5", "5", 1, "escaped dollar sign"),
    ("Answer: 12 cm", "12", 1, "unit `cm`"),
    ("Answer: \\text{12 cm}", "12", 1, "unit inside \\text: 12cm -> 12"),
    ("Answer: 7 ways", "7", 1, "unit `ways`"),
    ("Answer: $\\frac{3}{4}$ cm", "\\frac34", 1, "first $..$ then shorthand frac on the truth"),
    ("Answer: 10%", "10", -1, "percent is not in the reference's list: 10% != 10"),
    ("Answer: 1,000", "1000", 1, "thousands comma"),
    ("Answer: 1,000,000", "1000000", 1, "two thousands commas"),
    ("Answer: 1{,}000", "1000", 1, "{,} separator"),
    ("Answer: 1,\\!000", "1000", 1, ",\\! separator"),
    ("Answer: 3\\,000", "3000", 1, "thin space (ours)"),
    ("Answer: (1,2)", "(1, 2)", 1, "tuple: spaces dropped, commas kept"),
    ("Answer: (1,2)", "(2,1)", -1, "ordered tuple differs"),
    ("Answer: 5 \\text{and} 6", "5, 6", 1, "`\\text{and}` -> `,`; both become 56 by the comma rule"),
    ("Answer: x = 5", "5", 1, "after the last ="),
    ("Answer: x=5", "x = 5", 1, "= on both sides"),
    ("Answer: y = 2x + 3", "2x+3", 1, "expression after ="),
    ("Answer: 3 = 3", "3", 1, "after the last ="),
    ("Answer: $7$ (since 7 > 6)", "7", 1, "only the first $..$ of the line is kept"),
    ("Answer: 5\nAnswer: 6", "6", 1, "several Answer: lines, last counts"),
    ("Answer: 5\nAnswer: 6", "5", -1, "several Answer: lines, earlier does not count"),
    ("First, Answer: 3 is wrong.\nAnswer: 9", "9", 1, "Answer: quoted in reasoning, then the real one"),
    ("Answer: Answer: 4", "4", 1, "last occurrence on one line"),
    ("The answer is 9.", "9", -1, "no Answer: at all"),
    ("", "0", -1, "empty response"),
    ("Answer:\n8", "8", -1, "empty Answer: line (the reference's \\s* would read the next line)"),
    ("Answer: 3\nso...\nAnswer:", "3", -1, "the last Answer: is empty: no fallback to an earlier one"),
    ("Answer: 9\n" + "z" * 300, "9", -1, "answer outside the 300-character window"),
    ("Answer: 7" + " " * 295, "7", -1, "window cuts through `Answer:`"),
    ("x" * 1000 + "\nAnswer: 9", "9", 1, "long response, answer inside the window"),
    ("Answer: -5", "-5", 1, "negative number"),
    (f"Answer: {MINUS}5", "-5", 1, "U+2212 minus == ASCII minus (ours)"),
    ("Answer: -5", f"{MINUS}5", 1, "U+2212 in the ground truth"),
    ("Answer: -5", "5", -1, "sign matters"),
    ("Answer: 5", "-5", -1, "sign matters"),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", 1, "same fraction"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1, "shorthand \\frac12"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", 1, "\\dfrac (ours)"),
    ("Answer: \\tfrac{1}{2}", "\\frac12", 1, "\\tfrac vs shorthand"),
    ("Answer: 1/2", "\\frac{1}{2}", -1, "string compare: 1/2 != \\frac{1}{2}"),
    ("Answer: 0.5", "\\frac{1}{2}", -1, "string compare: 0.5 != \\frac{1}{2}"),
    ("Answer: 2\\sqrt2", "2\\sqrt{2}", 1, "shorthand \\sqrt2"),
    ("Answer: \\sqrt{2}", "\\sqrt{3}", -1, "different radicand"),
    ("Answer: \\text{(C)}", "(C)", 1, "multiple-choice letter in \\text"),
    ("Answer: 8.", "8", -1, "trailing period outside $ is kept (reference rule `.$` needs a $)"),
    ("Answer: $8.$", "8", 1, "trailing period inside $ dropped"),
    ("Answer: 0.\\overline{3}", "0.3", 1, "\\overline unwrapped (a reference quirk)"),
    ("answer : 8", "8", 1, "lower case, space before colon"),
    ("ANSWER:8", "8", 1, "upper case, no space"),
    ("Final Answer:\t8", "8", 1, "tab after colon"),
    ("Answer: 8\r\n", "8", 1, "CRLF line end"),
    ("Answer: 42", 42, 1, "integer ground truth"),
]


@pytest.mark.parametrize("response,gt,expected,why", CASES, ids=[c[3] for c in CASES])
def test_case_table(response, gt, expected, why):
    d = score_response(response, gt, mode="dapo-strict")
    assert d["score"] == float(expected) and d["acc"] == (expected == 1), (why, d)
    assert isinstance(d["pred"], str)


def test_table_size():
    assert len(CASES) >= 40


def test_invalid_pred():
    for mode in STRING_MODES:
        assert score_response("no answer", "7", mode=mode) == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
        assert score_response("Answer: 7", "[INVALID]", mode=mode)["score"] == -1.0
    assert score_response("no answer", "[INVALID]", mode="dapo-strict")["score"] == -1.0  # the reference: +1


def test_strict_only_merges():
    "dapo-strict accepts every pair dapo-reference accepts whose marker lies on one line with its answer."
    for r, gt, *_ in CASES:
        if score_response(r, gt)["acc"] and extract_answer(r[-300:]) is not None:
            assert score_response(r, gt, mode="dapo-strict")["acc"], (r, gt)


def test_unknown_mode():
    with pytest.raises(AssertionError, match="reward mode = 'exact'"):
        score_response("Answer: 1", "1", mode="exact")
    with pytest.raises(AssertionError, match="reward mode = 'exact'"):
        score_batch(["Answer: 1"], ["1"], mode="exact")


# ---- moved from the lesson (nbs/02_reward.ipynb), which keeps a shorter table of each ----
# The lesson's first extraction table: (response, reference match, dapo-strict), each worked out from the two rules.
LESSON_MARKERS = [
    ("Answer:\n42", "42", None),
    ("Answer:   \n\n  42", "42", None),
    ("Answer:\r\n42", "42", None),
    ("Answer\n: 42", "42", None),
    ("Answer\u00a0: 42", "42", None),  # \s* crosses line ends and matches U+00A0
    ("Answer: 42\nAnswer:", "42", None),  # an empty last `Answer:` does not match: the previous one counts
    ("Answer: 42\nAnswer: \n", " ", None),  # `Answer: ` + line end: the group takes the space
    ("Answer: Answer: 5", "Answer: 5", "5"),  # one match, not two
    ("The answer is 5.", None, None),  # no colon, no match
]


def test_extraction_lesson_cases():
    got = [(extract_answer_reference(r), extract_answer(r)) for r, _, _ in LESSON_MARKERS]
    assert got == [(ref, strict) for _, ref, strict in LESSON_MARKERS]
    assert extract_answer_reference("An\u017fwer: 7") == "7"  # case folding: the long s matches s
    assert extract_answer("So the total is 12.\nAnswer: 12") == "12"
    assert extract_answer("ANSWER:\t$\\frac{1}{2}$  \n") == "$\\frac{1}{2}$"
    assert extract_answer("Answer: 3\nwait, no.\nAnswer: 5") == "5"  # the last one counts


# Rows of the lesson's two-mode table it no longer shows (its other rows are pinned there):
# (response, ground truth, dapo-reference, dapo-strict, why), worked out from the rules.
LESSON_MODE_CASES = [
    ("Answer:   \n\n  42", "42", 1, -1, "blank lines after the marker"),
    ("Answer\n: 42", "42", 1, -1, "line end before the colon"),
    ("Answer\u00a0: 42", "42", 1, -1, "no-break space before the colon"),
]


@pytest.mark.parametrize("response,gt,ref,strict,why", LESSON_MODE_CASES, ids=[c[4] for c in LESSON_MODE_CASES])
def test_lesson_mode_cases(response, gt, ref, strict, why):
    got = (score_response(response, gt)["score"], score_response(response, gt, mode="dapo-strict")["score"])
    assert got == (ref, strict), why


# ---- the linear scans agree with the reference rules written as regular expressions ----
_tokens = st.lists(
    st.sampled_from(["$", "a", "1", "{", "}", "\n", " ", "\\text{", "\\boxed{", "\\textbf{"]), max_size=30
)


@settings(max_examples=300, deadline=None)
@given(_tokens)
def test_scans_match_regex_rules(toks):
    s = "".join(toks)
    assert R._per_line(s, R._first_math) == re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    assert R._per_line(s, R._unwrap_to_first, "\\text{") == re.sub(r"(\\text\{)(.*?)(\})", "\\2", s)
    assert R._per_line(s, R._unwrap_boxed) == re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_score_never_raises(text):
    for mode in STRING_MODES:
        d = score_response(text, "7", mode=mode)
        assert d["score"] in (1.0, -1.0) and isinstance(d["pred"], str)
    assert isinstance(normalize_answer(text), str)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=50))
def test_extract_roundtrip(t):
    if "answer" in t.lower() or not t.strip():
        return
    assert extract_answer("reasoning...\nAnswer: " + t) == t.strip()


# ---- Eq. 13 properties ----
@st.composite
def _eq13(draw):
    l_max = draw(st.integers(1, 5000))
    l_cache = draw(st.integers(0, l_max - 1))
    Ls = draw(st.lists(st.integers(0, 2 * l_max + 10), min_size=1, max_size=50))
    return l_max, l_cache, Ls


@settings(max_examples=300, deadline=None)
@given(_eq13())
def test_overlong_properties(args):
    l_max, l_cache, Ls = args
    Ls = sorted(Ls)
    p = overlong_penalty(Ls, l_max, l_cache).double()
    assert p.dtype == torch.float64 and ((p >= -1) & (p <= 0)).all()
    for L, v in zip(Ls, p.tolist()):
        if L <= l_max - l_cache:
            assert v == 0.0
        if L > l_max:
            assert v == -1.0
        if l_cache > 0 and L == l_max:
            assert v == -1.0  # (l_max - l_cache - l_max) / l_cache = -1
        if l_cache > 0 and l_max - l_cache < L <= l_max:
            # overlong_penalty divides in float64 (integers: the same correctly rounded quotient as Python's) and casts
            # once to float32: exactly the float32 rounding of Python's quotient (within 2^-25 of the real value)
            want = (l_max - l_cache - L) / l_cache
            assert v == torch.tensor(want, dtype=torch.float64).float().item()
            assert abs(v - want) <= 2.0**-25
    assert (p[1:] <= p[:-1]).all()  # monotone non-increasing in L
    if l_cache > 0:  # continuous: Lipschitz with constant 1 / l_cache, up to the float32 cast of each value
        grid = torch.arange(0, 2 * l_max + 10, dtype=torch.float64)
        q = overlong_penalty(grid, l_max, l_cache).double()
        # each value is within 2^-25 (half a float32 ulp below 1) + 2^-53 (the float64 division) of the real one
        assert ((q[:-1] - q[1:]).abs() <= 1 / l_cache + 2 * (2.0**-25 + 2.0**-53)).all()


def _eq13_loop(L, l_max, l_cache):
    "Eq. 13's three branches, case by case, in float64 (moved from the lesson)."
    if L <= l_max - l_cache:
        return 0.0
    if L <= l_max:
        return ((l_max - l_cache) - L) / l_cache
    return -1.0


def test_overlong_matches_a_float64_loop():
    "The clamp agrees with the branches on every length around the two corners."
    Ls = list(range(0, 40)) + [16383, 16384, 16385, 20479, 20480, 20481, 30000]
    for l_max, l_cache in [(20480, 4096), (30, 7), (30, 1)]:
        # exact: both sides are the correctly rounded float64 quotient of the same integers, cast once to float32
        want = torch.tensor([_eq13_loop(L, l_max, l_cache) for L in Ls])
        assert torch.equal(overlong_penalty(Ls, l_max, l_cache), want), (l_max, l_cache)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 50, allow_nan=False), st.floats(0, 1e-3))
def test_overlong_continuous_reals(L, h):
    a, b = overlong_penalty([L, L + h], 30, 7).double().tolist()
    # L + h rounds in float64 (<= 2^-53 * 51 < 2^-47), which moves the penalty by /7; each penalty is within
    # 2^-25 + 2^-53 of its real value (float64 division, one float32 cast)
    assert b <= a and a - b <= h / 7 + 2.0**-47 / 7 + 2 * (2.0**-25 + 2.0**-53)


def test_overlong_validation():
    for kw, msg in [
        (dict(l_max=10, l_cache=10), "l_cache = 10"),
        (dict(l_max=10, l_cache=-1), "l_cache = -1"),
        (dict(l_max=0, l_cache=0), "l_max = 0"),
    ]:
        with pytest.raises(AssertionError, match=msg):  # the caller's contract: DAPOConfig validates a recipe's
            overlong_penalty([1], **kw)
    assert overlong_penalty(torch.tensor([3, 5]), 10, 2).shape == (2,)


# ---- adversarial inputs: they finish (score -1, no exception) ----
# HANG_S is a hang guard, not a speed claim: linear-time scoring of these inputs takes well under 1 s and catastrophic
# regex backtracking would take hours, so a limit two orders of magnitude above the expected time catches only a hang
# (or an exponential blow-up) and no machine is too slow for it.
HANG_S = 120


def _timed(f):
    t = time.monotonic()
    out = f()
    return out, time.monotonic() - t


def test_adversarial_100k_characters():
    big = "Answer: 1 " + "$" + "\\text{a" * 14000 + "x" * 1000  # a single $ and unclosed \text{: quadratic for regexes
    for resp in (big, "Answer: " + "9" * 100_000):
        for mode in STRING_MODES:
            d, dt = _timed(lambda: score_response(resp, "7", mode=mode))
            assert d["score"] == -1.0 and dt < HANG_S
    s, dt = _timed(lambda: normalize_answer(big))  # the ground-truth side is not windowed
    assert dt < HANG_S
    for mode in STRING_MODES:
        d, dt = _timed(lambda: score_response("Answer: 7", big, mode=mode))
        assert d["score"] == -1.0 and dt < HANG_S


def test_adversarial_nested_braces():
    nested = "{" * 10_000 + "1" + "}" * 10_000
    for resp, gt in [("Answer: " + nested, "1"), ("Answer: \\boxed" + nested, "1"), ("Answer: 1", nested)]:
        for mode in STRING_MODES:
            d, dt = _timed(lambda: score_response(resp, gt, mode=mode))
            assert d["score"] == -1.0 and dt < HANG_S


def test_math_verify_pathological_bounded():
    P.math_verify_equal("1", "1")  # start a worker outside the timing
    # the property: the power tower never finishes in sympy, so the 2 s per-call limit is what ends it
    assert P.verify_pairs([("$1$", "$9^{9^{9^{9}}}$")], 2, workers=1) == ["timeout"]
    for resp, gt in [
        ("Answer: 9^{9^{9^{9}}}", "1"),  # a power tower sympy tries to evaluate
        ("Answer: " + "{" * 10_000 + "1" + "}" * 10_000, "2"),
        ("Answer: 1", "{" * 10_000 + "1" + "}" * 10_000 + "+1"),
    ]:
        d, dt = _timed(lambda: score_response(resp, gt, use_math_verify=True, timeout_s=2))
        assert d["score"] == -1.0 and dt < HANG_S, (resp[:30], dt)  # hang guard: the 2 s limit, kill and respawn
    d = score_response("Answer: 0.5", "\\frac{1}{2}", use_math_verify=True)  # a fresh worker replaced the killed one
    assert d["score"] == 1.0


# The 2-3 s per-call limits used with these cases bound calls that take milliseconds (0.5 = 1/2, x+1 = 1+x; measured
# 1-20 ms here, so the limit is > 100x the work, not a speed claim); only the power tower reaches its limit, by design.
MV_CASES = [
    ("Answer: 0.5", "\\frac{1}{2}", 1),
    ("Answer: 1/2", "\\frac12", 1),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}", 1),
    ("Answer: 0.6", "\\frac{1}{2}", -1),
    ("Answer: x+1", "1+x", 1),
    ("Answer: 9^{9^{9^{9}}}", "1", -1),
]


def test_math_verify_in_threads():
    with ThreadPoolExecutor(3) as ex:
        res = list(ex.map(lambda c: score_response(c[0], c[1], use_math_verify=True, timeout_s=3)["score"], MV_CASES))
    assert res == [float(c[2]) for c in MV_CASES]


def _score_mv(c):
    return score_response(c[0], c[1], use_math_verify=True, timeout_s=3)["score"]


def test_math_verify_in_daemonic_pool_workers():
    with mp.get_context("spawn").Pool(1) as pool:  # Pool workers are daemonic: no multiprocessing children allowed
        res = pool.map(_score_mv, MV_CASES[:2] + MV_CASES[-1:])
    assert res == [1.0, 1.0, -1.0]


def test_math_verify_in_forked_workers_do_not_share_parent_pipes():
    P.math_verify_equal("1", "1")  # the parent now holds an idle worker; a forked child must start its own
    with mp.get_context("fork").Pool(2) as pool:
        res = pool.map(_score_mv, MV_CASES[:2] * 2)
    assert res == [1.0] * 4
    assert P.math_verify_equal("2", "4/2")  # the parent's worker still answers correctly


def test_server_start_failures(monkeypatch, tmp_path):
    with pytest.raises(TimeoutError, match="did not start within"):
        P._VerifyPool(start_timeout=0.001)  # no interpreter starts and imports math-verify in 1 ms, on any machine
    (
        tmp_path / "math_verify"
    ).mkdir()  # a math_verify ahead of the installed one that fails to import, as a missing one
    (tmp_path / "math_verify" / "__init__.py").write_text("raise ImportError('No module named math_verify')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip install math-verify"):
        P._VerifyPool()


# ---- score_batch ----
_MIX = [
    "Answer: 42",
    "Answer:\n42",
    "Answer: \\dfrac{84}{2}",
    "Answer: 0.5",
    "Answer: 41",
    "no answer",
    "Answer: 2\\sqrt{3}",
    f"Answer: {MINUS}7",
    "The Answer: is Answer: 42",
    "Answer: \\frac{1}{2}",
    "Answer: x=42",
    "Answer: (A)",
]
_TRUTHS = ["42", "\\frac{1}{2}", "\\sqrt{12}", "-7", "A"]


@pytest.mark.parametrize("mode", ["dapo-reference", "dapo-strict", "math-verify"])
def test_batch_equals_one_by_one(mode):
    pairs = [(r, g) for r in _MIX for g in _TRUTHS]
    # a limit no call comes near even on a crowded machine: this test is about verdicts, not time
    scores, accs, metrics, preds = score_batch(
        [p[0] for p in pairs], [p[1] for p in pairs], mode=mode, timeout=120, return_preds=True
    )
    one = [score_response(r, g, mode=mode, timeout_s=120) for r, g in pairs]
    assert scores.tolist() == [d["score"] for d in one] and accs.tolist() == [d["acc"] for d in one]
    assert preds == [d["pred"] for d in one] and scores.dtype == torch.float32 and accs.dtype == torch.bool
    assert metrics["reward_timeouts"] == metrics["reward_errors"] == 0, metrics
    if mode == "math-verify":  # math-verify found more equal pairs than strings do: 0.5 = 1/2, 2sqrt3 = sqrt12, (A) = A
        assert accs.sum() > score_batch([p[0] for p in pairs], [p[1] for p in pairs], mode="dapo-strict")[1].sum()
    else:
        assert metrics["reward_math_verify_calls"] == 0


def _round(n=1024, n_adv=16, seed=0):
    "A generation round of `n` short solutions, 40% right; every n // n_adv-th answer is a distinct pathological one."
    import random

    rng, resp, gts = random.Random(seed), [], []
    for i in range(n):
        gt = str(rng.randint(0, 999))
        resp.append(
            f"Add the two numbers.\nThen subtract.\nAnswer: {gt if rng.random() < 0.4 else rng.randint(0, 999)}"
        )
        gts.append(gt)
    adv = [i * (n // n_adv) for i in range(n_adv)] if n_adv else []
    for k, i in enumerate(adv):
        resp[i] = f"Answer: 9^{{9^{{9^{{9^{{{k + 2}}}}}}}}}"  # a power tower: sympy never finishes
    return resp, gts, adv


def test_batch_1024_with_16_pathological():
    """1024 responses, 16 pathological: each of the 16 is cut by its own per-call limit (counted as a timeout), none
    takes a worker down (no errors), and every other verdict agrees with the strings."""
    timeout = 4.0
    resp, gts, adv = _round()
    t = time.monotonic()
    scores, accs, m = score_batch(resp, gts, mode="math-verify", timeout=timeout)
    dt = time.monotonic() - t
    assert m["reward_timeouts"] == 16 and m["reward_errors"] == 0
    assert scores[adv].tolist() == [-1.0] * 16
    ref = score_batch(resp, gts, mode="dapo-strict")[0]
    assert scores.tolist() == ref.tolist()  # integers: math-verify agrees with the strings on every other response
    # a hang guard, not a speed claim: even all 16 limits run one after another on one worker (16 * 4 = 64 s) plus
    # the ordinary calls (a few s) stay far below it; only a call that never ends reaches it
    assert dt < 16 * timeout + HANG_S, dt


def _descendants(pid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    kids = {}
    for p, pp in zip(out[::2], out[1::2]):
        kids.setdefault(int(pp), []).append(int(p))
    todo, seen = [pid], []
    while todo:
        seen += kids.get(todo.pop(), [])
        todo += kids.get(seen[-1], []) if seen else []
    return set(seen)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_shutdown_leaves_no_process():
    score_batch(["Answer: 0.5"], ["\\frac12"], mode="math-verify")
    server = P._POOL["pools"]["math-verify"].proc.pid
    procs = _descendants(server) | {server}
    assert len(procs) >= 2  # the server and at least one worker
    P._shutdown_pool()
    assert P._POOL["pools"] == {} and not any(_alive(p) for p in procs)
    assert score_batch(["Answer: 0.5"], ["\\frac12"], mode="math-verify")[0].tolist() == [1.0]  # starts again


_CLIENT = """
import os, sys, time
from dapo_ref.reward import score_batch
from dapo_ref.reward_pool import _POOL
score_batch(["Answer: 0.5"], ["\\\\frac12"], mode="math-verify")
print(_POOL["pools"]["math-verify"].proc.pid, flush=True)
score_batch(["Answer: 9^{9^{9^{9}}}"], ["1"], mode="math-verify", timeout=600)  # killed in the middle of this
"""


def test_killed_client_leaves_no_process():
    p = subprocess.Popen([sys.executable, "-c", _CLIENT], stdout=subprocess.PIPE, text=True)
    server = int(p.stdout.readline())
    time.sleep(1.0)
    procs = _descendants(server) | {server}
    assert len(procs) >= 2
    p.send_signal(signal.SIGKILL)
    p.wait()
    t = time.monotonic()
    # a hang guard, not a speed claim: the server notices its closed stdin at once; 60 s only bounds the wait
    while any(_alive(q) for q in procs) and time.monotonic() - t < 60:
        time.sleep(0.2)
    assert not any(_alive(q) for q in procs)


_RANK = """
import os, torch.distributed as dist
from dapo_ref.reward import score_batch
from dapo_ref.reward_pool import default_workers
dist.init_process_group("gloo")
r = dist.get_rank()
# the bound: 6 s, not 2: each rank's server is fresh, and on a loaded 2-core machine (a CI run with both pytest workers
# busy) a plain comparison once took over 2 s there and was counted as a timeout; the tower never ends, so any bound
# counts it exactly once
s, a, m = score_batch(["Answer: 0.5", "Answer: 0.6", "Answer: 9^{9^{9^{9}}}"], ["\\\\frac12"] * 3, mode="math-verify", timeout=6)
print("RANK", r, s.tolist(), m["reward_timeouts"], default_workers(), flush=True)
dist.destroy_process_group()
"""


def test_in_torchrun_workers(tmp_path):
    (tmp_path / "rank.py").write_text(_RANK)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(tmp_path / "rank.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("RANK"))
    cpus = max(1, len(os.sched_getaffinity(0)) // 2)
    assert lines == [f"RANK {r} [1.0, -1.0, -1.0] 1 {cpus}" for r in (0, 1)], out.stdout + out.stderr[-2000:]
