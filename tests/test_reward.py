"""Tests of dapo_ref.reward that do not belong in the lesson: the full case table, properties, fuzzing,
adversarial inputs, and math-verify in threads and in daemonic worker processes."""
import math, multiprocessing as mp, re, time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from dapo_ref import reward as R
from dapo_ref.reward import extract_answer, normalize_answer, score_response, overlong_penalty

MINUS = "\u2212"  # Unicode minus sign: normalised to ASCII "-" (our addition; the reference keeps it apart)

# (response, ground truth, expected score, why). Each expected score was worked out by hand from the rules:
# last `Answer:` on its line, last 300 characters, then the normaliser (see nbs/02_reward.ipynb).
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
    (f"Answer: -5", f"{MINUS}5", 1, "U+2212 in the ground truth"),
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
    d = score_response(response, gt)
    assert d["score"] == float(expected) and d["acc"] == (expected == 1), (why, d)
    assert isinstance(d["pred"], str)

def test_table_size(): assert len(CASES) >= 40

def test_invalid_pred():
    assert score_response("no answer", "7") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert score_response("Answer: 7", "[INVALID]")["score"] == -1.0

# ---- the linear scans agree with the reference rules written as regular expressions ----
_tokens = st.lists(st.sampled_from(["$", "a", "1", "{", "}", "\n", " ", "\\text{", "\\boxed{", "\\textbf{"]), max_size=30)

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
    d = score_response(text, "7")
    assert d["score"] in (1.0, -1.0) and isinstance(d["pred"], str)
    assert isinstance(normalize_answer(text), str)

@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)), max_size=50))
def test_extract_roundtrip(t):
    if "answer" in t.lower() or not t.strip(): return
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
        if L <= l_max - l_cache: assert v == 0.0
        if L > l_max: assert v == -1.0
        if l_cache > 0 and L == l_max: assert v == -1.0           # (l_max - l_cache - l_max) / l_cache = -1
        if l_cache > 0 and l_max - l_cache < L <= l_max:
            assert math.isclose(v, (l_max - l_cache - L) / l_cache, rel_tol=1e-6, abs_tol=1e-7)
    assert (p[1:] <= p[:-1]).all()                                    # monotone non-increasing in L
    if l_cache > 0:  # continuous: Lipschitz with constant 1 / l_cache (float32 rounding allowed)
        grid = torch.arange(0, 2 * l_max + 10, dtype=torch.float64)
        q = overlong_penalty(grid, l_max, l_cache).double()
        assert ((q[:-1] - q[1:]).abs() <= 1 / l_cache + 1e-6).all()

@settings(max_examples=100, deadline=None)
@given(st.floats(0, 50, allow_nan=False), st.floats(0, 1e-3))
def test_overlong_continuous_reals(L, h):
    a, b = overlong_penalty([L, L + h], 30, 7).double().tolist()
    assert b <= a and a - b <= h / 7 + 1e-6

def test_overlong_validation():
    for kw, msg in [(dict(l_max=10, l_cache=10), "l_cache = 10"), (dict(l_max=10, l_cache=-1), "l_cache = -1"),
                    (dict(l_max=0, l_cache=0), "l_max = 0")]:
        with pytest.raises(ValueError, match=msg): overlong_penalty([1], **kw)
    assert overlong_penalty(torch.tensor([3, 5]), 10, 2).shape == (2,)

# ---- adversarial inputs: bounded time, score -1, no exception ----
def _timed(f):
    t = time.monotonic(); out = f(); return out, time.monotonic() - t

def test_adversarial_100k_characters():
    big = "Answer: 1 " + "$" + "\\text{a" * 14000 + "x" * 1000  # a single $ and unclosed \text{: quadratic for regexes
    for resp in (big, "Answer: " + "9" * 100_000):
        d, dt = _timed(lambda: score_response(resp, "7"))
        assert d["score"] == -1.0 and dt < 10
    s, dt = _timed(lambda: normalize_answer(big))  # the ground-truth side is not windowed
    assert dt < 10
    d, dt = _timed(lambda: score_response("Answer: 7", big))
    assert d["score"] == -1.0 and dt < 10

def test_adversarial_nested_braces():
    nested = "{" * 10_000 + "1" + "}" * 10_000
    for resp, gt in [("Answer: " + nested, "1"), ("Answer: \\boxed" + nested, "1"), ("Answer: 1", nested)]:
        d, dt = _timed(lambda: score_response(resp, gt))
        assert d["score"] == -1.0 and dt < 10

def test_math_verify_pathological_bounded():
    R.math_verify_equal("1", "1")  # start a worker outside the timing
    for resp, gt in [("Answer: 9^{9^{9^{9}}}", "1"),                        # a power tower sympy tries to evaluate
                     ("Answer: " + "{" * 10_000 + "1" + "}" * 10_000, "2"),
                     ("Answer: 1", "{" * 10_000 + "1" + "}" * 10_000 + "+1")]:
        d, dt = _timed(lambda: score_response(resp, gt, use_math_verify=True, timeout_s=2))
        assert d["score"] == -1.0 and dt < 10, (resp[:30], dt)
    d = score_response("Answer: 0.5", "\\frac{1}{2}", use_math_verify=True)  # a fresh worker replaced the killed one
    assert d["score"] == 1.0

MV_CASES = [("Answer: 0.5", "\\frac{1}{2}", 1), ("Answer: 1/2", "\\frac12", 1), ("Answer: 2\\sqrt{2}", "\\sqrt{8}", 1),
            ("Answer: 0.6", "\\frac{1}{2}", -1), ("Answer: x+1", "1+x", 1), ("Answer: 9^{9^{9^{9}}}", "1", -1)]

def test_math_verify_in_threads():
    with ThreadPoolExecutor(3) as ex:
        res = list(ex.map(lambda c: score_response(c[0], c[1], use_math_verify=True, timeout_s=3)["score"], MV_CASES))
    assert res == [float(c[2]) for c in MV_CASES]

def _score_mv(c): return score_response(c[0], c[1], use_math_verify=True, timeout_s=3)["score"]

def test_math_verify_in_daemonic_pool_workers():
    with mp.get_context("spawn").Pool(1) as pool:  # Pool workers are daemonic: no multiprocessing children allowed
        res = pool.map(_score_mv, MV_CASES[:2] + MV_CASES[-1:])
    assert res == [1.0, 1.0, -1.0]

def test_math_verify_in_forked_workers_do_not_share_parent_pipes():
    R.math_verify_equal("1", "1")  # the parent now holds an idle worker; a forked child must start its own
    with mp.get_context("fork").Pool(2) as pool:
        res = pool.map(_score_mv, MV_CASES[:2] * 2)
    assert res == [1.0] * 4
    assert R.math_verify_equal("2", "4/2")  # the parent's worker still answers correctly

def test_worker_start_failures(monkeypatch):
    with pytest.raises(TimeoutError, match="did not start within"):
        R._MathVerifyWorker(start_timeout=0.001)
    monkeypatch.setattr(R, "_WORKER_SRC", "import math_verify_missing_module")
    with pytest.raises(RuntimeError, match="pip install math-verify"):
        R._MathVerifyWorker()
