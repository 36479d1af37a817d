"""The default reward mode, `dapo-reference`, against the reference recipe's published rules (verl
`verl/utils/reward_score/math_dapo.py`, `compute_score`): take the last 300 characters, the last match of
`(?i)Answer\\s*:\\s*([^\\n]+)` (no match: the string "[INVALID]"), normalise it and the ground truth with
`normalize_final_answer`, compare the strings. Each expected verdict below was worked out by hand from those
rules; the rule that decides it is written beside it."""

import re

import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from dapo_ref.answers import extract_answer_reference, normalize_reference
from dapo_ref.reward import score_response, score_batch

MINUS, NBSP = "\u2212", "\u00a0"
NESTED = "{" * 10_000 + "1" + "}" * 10_000

# (response, ground truth, expected score, rule)
CASES = [
    # --- the marker: (?i)Answer\s*:\s*([^\n]+), last match ---
    ("Answer: 42", "42", 1, "plain: group '42'"),
    ("Answer: 42", "43", -1, "plain, wrong"),
    ("Answer:\n42", "42", 1, "\\s* after the colon crosses the line end"),
    ("Answer:   \n\n  42", "42", 1, "\\s* takes spaces and blank lines"),
    ("Answer:\r\n42", "42", 1, "\\r and \\n are both \\s"),
    ("Answer\n: 42", "42", 1, "\\s* before the colon crosses the line end"),
    (f"Answer{NBSP}: 42", "42", 1, "U+00A0 is \\s in a str pattern"),
    ("Answer:\u20037", "7", 1, "U+2003 (em space) is \\s"),
    ("Answer: 42\nAnswer:", "42", 1, "the last marker has no [^\\n]+ after it: no match, the previous one counts"),
    ("Answer: 42\nAnswer: \n", "42", -1, "backtracking gives the last match the group ' ', normalised ''"),
    ("Answer: 42\nAnswer: \n", "", 1, "... and '' equals the normalised empty ground truth"),
    ("Answer: Answer: 5", "5", -1, "one match, group 'Answer: 5', spaces dropped: 'Answer:5'"),
    ("Answer: Answer: 5", "Answer: 5", 1, "both sides normalise to 'Answer:5'"),
    ("The Answer: is Answer: 42", "42", -1, "one match 'is Answer: 42' -> 'isAnswer:42'"),
    ("answer: 7", "7", 1, "(?i): lower case"),
    ("ANSWER : 7", "7", 1, "(?i) and \\s* before the colon"),
    ("An\u017fwer: 7", "7", 1, "(?i) case folding: U+017F long s matches s"),
    ("Answer 7", "7", -1, "no colon: no match, pred '[INVALID]'"),
    ("Answer:", "7", -1, "nothing after the colon: no match"),
    ("", "7", -1, "empty response: no match"),
    ("", "[INVALID]", 1, "no match reads '[INVALID]', equal to this ground truth"),
    ("The answer is 7.", "7", -1, "no marker"),
    ("Answer: 3\nwait\nAnswer: 5", "5", 1, "last match counts"),
    ("Answer: 3\nwait\nAnswer: 5", "3", -1, "an earlier match does not count"),
    ("First, Answer: 3 is wrong.\nAnswer: 9", "9", 1, "the quoted one is not the last"),
    ("Final Answer:\t8", "8", 1, "tab is \\s"),
    ("Answer: 8\r\n", "8", 1, "group '8\\r', strip() removes \\r"),
    # --- the 300-character window ---
    ("Answer: 9\n" + "z" * 300, "9", -1, "the marker lies before the last 300 characters"),
    ("x" * 1000 + "\nAnswer: 9", "9", 1, "the marker lies inside the last 300 characters"),
    ("Answer: 7" + " " * 292, "7", -1, "301 characters: the window starts at 'nswer:'"),
    ("Answer: 7" + " " * 291, "7", 1, "300 characters: all of it; trailing spaces dropped by the normaliser"),
    ("Answer: 7\n" + "y" * 290, "7", 1, "300 characters, marker first"),
    ("Answer: 1\n" + "Answer:" + " " * 291 + "\n2", "2", 1, "long blank run after the marker: still \\s*"),
    # --- boxed answers ---
    ("Answer: \\boxed{42}", "42", 1, "\\boxed{..} unwrapped to the last }"),
    ("Answer: $\\boxed{42}$", "42", 1, "first $..$, then \\boxed unwrapped"),
    ("The result is \\boxed{42}.", "42", -1, "math_dapo ignores boxes: no marker, '[INVALID]'"),
    ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1, "greedy boxed keeps the inner braces"),
    ("Answer: \\boxed{2} and \\boxed{3}", "2", -1, "greedy boxed: '2}and\\boxed{3'"),
    ("Answer: 42", "\\boxed{42}", 1, "the ground truth is normalised too: boxed unwrapped"),
    # --- normalisation the reference does not do (dapo-strict does) ---
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", -1, "\\dfrac is not \\frac"),
    ("Answer: \\tfrac{1}{2}", "\\frac12", -1, "\\tfrac is not \\frac; \\frac12 -> \\frac{1}{2}"),
    (f"Answer: {MINUS}5", "-5", -1, "U+2212 is not '-'"),
    ("Answer: -5", f"{MINUS}5", -1, "U+2212 in the ground truth"),
    ("Answer: 3\\,000", "3000", -1, "\\, is not removed"),
    ("Answer: 1\\,000\\,000", "1000000", -1, "\\, is not removed (twice)"),
    ("Answer: 3\\!000", "3000", -1, "only ',\\!' is removed, not '\\!'"),
    ("Answer: \\dfrac{1}{2}", "\\dfrac{1}{2}", 1, "the same string on both sides"),
    # --- normalisation the reference does ---
    ("Answer: 1,\\!000", "1000", 1, "',\\!' removed"),
    ("Answer: 1,000", "1000", 1, "digits and commas: commas dropped"),
    ("Answer: 1,2,3", "123", 1, "the comma rule also turns a list into a number"),
    ("Answer: (1,2)", "(1, 2)", 1, "spaces dropped, commas kept in a tuple"),
    ("Answer: (1,2)", "(2,1)", -1, "order matters"),
    ("Answer: x = 5", "5", 1, "after the last ="),
    ("Answer: 2+2=5", "5", 1, "after the last =, right or wrong"),
    ("Answer: 12 cm", "12", 1, "unit word 'cm'"),
    ("Answer: \\text{12 cm}", "12", 1, "spaces, 'cm', then \\text{12} unwrapped"),
    ("Answer: 90^\\circ", "90", 1, "'^\\circ' removed"),
    ("Answer: \\$5", "5", 1, "escaped dollar removed"),
    ("Answer: 10%", "10", -1, "'%' is not removed"),
    ("Answer: $7$ (since 7 > 6)", "7", 1, "first $..$ of the line"),
    ("Answer: 8.", "8", -1, "'.$' needs a $: the period stays"),
    ("Answer: $8.$", "8", 1, "'.$' -> '$'"),
    ("Answer: a banana ", "banan", 1, "'a ' removed as a substring, twice"),
    ("Answer: issue", "is", 1, "'sue' removed as a substring"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1, "shorthand \\frac12"),
    ("Answer: 2\\sqrt2", "2\\sqrt{2}", 1, "shorthand \\sqrt2"),
    ("Answer: 0.5", "\\frac{1}{2}", -1, "strings differ"),
    ("Answer: \\text{(C)}", "(C)", 1, "\\text unwrapped"),
    ("Answer: 5 \\text{and} 6", "5, 6", 1, "'\\text{and}' -> ',', then the comma rule: both '56'"),
    ("Answer: 42", 42, 1, "an integer ground truth is read as its string"),
    # --- adversarial, 10k characters and more ---
    ("Answer: " + NESTED, "1", -1, "the window holds only closing braces: no marker"),
    ("Answer: 1", NESTED, -1, "the ground truth keeps its braces"),
    ("Answer: " + "\\text{" * 2000, "7", -1, "the window holds no marker"),
    ("Answer: 1 $" + "\\text{a" * 1500, "1", -1, "a single $ and unclosed \\text{: no marker in the window"),
    ("Answer: 7", "\\text{" * 2000 + "7", -1, "unclosed \\text{ is not unwrapped"),
    ("Answer: 7", "\\boxed{7}" + "}" * 10_000, -1, "greedy boxed runs to the last }"),
    ("x" * 10_000 + "\nAnswer: \\boxed{" + "{" * 100 + "7", "7", -1, "unbalanced boxed: not unwrapped"),
]


def test_case_count():
    assert len(CASES) >= 60


@pytest.mark.parametrize("response,gt,expected,rule", CASES, ids=[f"{i}:{c[3][:40]}" for i, c in enumerate(CASES)])
def test_reference_verdicts(response, gt, expected, rule):
    d = score_response(response, gt)  # the default mode
    assert (d["score"], d["acc"]) == (float(expected), expected == 1), (rule, d)
    assert d == score_response(response, gt, mode="dapo-reference")


def test_reference_verdicts_in_a_batch():
    scores, accs, metrics = score_batch([c[0] for c in CASES], [c[1] for c in CASES])
    assert scores.tolist() == [float(c[2]) for c in CASES] and accs.tolist() == [c[2] == 1 for c in CASES]
    assert metrics["reward_timeouts"] == 0 and metrics["reward_math_verify_calls"] == 0


# ---- an oracle written with the reference's regular expressions, against the linear implementation ----
def _oracle_normalize(s):
    "normalize_final_answer from the published rules, with its backtracking regexes (fine on short strings)."
    from dapo_ref.answers import _SUBSTITUTIONS, _REMOVED  # the two tables are data, copied from the reference

    s = s.split("=")[-1]
    for a, b in _SUBSTITUTIONS:
        s = s.replace(a, b)
    for e in _REMOVED:
        s = s.replace(e, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for cmd in (r"\\text\{", r"\\textbf\{", r"\\overline\{"):
        s = re.sub(f"({cmd})(.*?)(\\}})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)).replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _oracle_score(response, gt):
    m = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    return 1.0 if _oracle_normalize(m[-1] if m else "[INVALID]") == _oracle_normalize(gt) else -1.0


_ATOMS = [
    "Answer",
    "answer",
    "ANSWER",
    ":",
    " ",
    "\n",
    "\r",
    "\t",
    NBSP,
    "$",
    "{",
    "}",
    "=",
    ",",
    ".",
    "1",
    "2",
    "42",
    "\\boxed{",
    "\\text{",
    "\\frac",
    "\\dfrac",
    "12",
    "sqrt",
    "\\,",
    "\\!",
    MINUS,
    "a ",
    "cm",
    "[INVALID]",
]


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_ATOMS), max_size=40), st.lists(st.sampled_from(_ATOMS), max_size=8))
def test_matches_the_regex_oracle(resp, gt):
    resp, gt = "".join(resp), "".join(gt)
    assert score_response(resp, gt)["score"] == _oracle_score(resp, gt), (resp, gt)
    assert normalize_reference(gt) == _oracle_normalize(gt)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120), st.text(max_size=20))
def test_matches_the_regex_oracle_on_any_text(resp, gt):
    assert score_response(resp, gt)["score"] == _oracle_score(resp, gt)


def test_extract_reference_is_the_last_findall():
    assert extract_answer_reference("Answer: 1\nAnswer:\n\n2\nAnswer:") == "2"
    assert extract_answer_reference("no marker") is None
