"""Tests of dapo_ref.eval that are not part of the lesson: brute-force and property checks of the metrics,
`evaluate` with a scripted engine, and the `dapo-eval` command end to end on a tiny random Qwen2 model."""

import itertools, json, math, os
from collections import Counter
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dapo_ref.rollout
from dapo_ref.data import make_example
from dapo_ref.eval import avg_at_k, eval_metrics, evaluate, maj_at_k, majority_vote, pass_at_k, pass_at_k_batch, pass_ks
from dapo_ref.eval_cli import main
from dapo_ref.interfaces import Completion, RolloutEngine

# ---------------------------------------------------------------- metrics
# Tolerances here are float64 bounds. pass_at_k = 1 - prod_{i} (1 - k / i) over n - c + 1 .. n: c factors, each with
# two roundings (the division, the subtraction) and one for the product, so the relative error of the product is
# <= 3 c u64 and |pass_at_k - exact| <= (3 c + 1) u64 = (3 * 250 + 1) * 2^-53 = 8.3e-14 for the largest c below
# (n, c, k = 300, 250, 100); 1e-12 covers every case. Means of booleans (avg@k, mean_length, truncated_frac) are sums
# of <= 10^4 exact integers divided once: one rounding, <= u64 relative = 1.1e-16 (or 1e-12 abs on values <= 11).


def brute_pass_at_k(outcomes, k):
    "Definition of pass@k: the fraction of k-subsets of the n outcomes holding at least one correct sample."
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return Fraction(sum(any(outcomes[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)  # k = 1: c/n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 1, 3) == 1.0  # k = n: any correct


def test_pass_at_k_brute_force_all_small_cases():
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [False] * (n - c) + [True] * c
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(outcomes, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_matches_exact_rational():
    for n, c, k in [(2000, 3, 1000), (500, 1, 32), (1000, 0, 1), (64, 32, 32), (300, 250, 100)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, -1, 1), (3, 4, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_pass_at_k_batch_matches_scalar_and_brute_force(P, n, data):
    rows = data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=P, max_size=P))
    k = data.draw(st.integers(1, n))
    got = pass_at_k_batch(torch.tensor(rows), k)
    assert got.shape == (P,) and got.dtype == torch.float64
    for p, row in enumerate(rows):
        assert got[p].item() == pytest.approx(pass_at_k(n, sum(row), k), abs=1e-12)
        assert got[p].item() == pytest.approx(float(brute_pass_at_k(row, k)), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.data())
def test_pass_at_k_monotone(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    v = pass_at_k(n, c, k)
    assert 0.0 <= v <= 1.0
    if c < n:
        assert pass_at_k(n, c + 1, k) >= v - 1e-12  # more correct samples never hurt
    if k < n:
        assert pass_at_k(n, c, k + 1) >= v - 1e-12  # a bigger budget never hurts


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=6))
def test_avg_at_k_is_mean_of_pass_at_1(rows):
    total = sum(sum(r) for r in rows)
    assert avg_at_k(rows) == pytest.approx(total / (3 * len(rows)), abs=1e-12)
    assert avg_at_k(rows) == pytest.approx(pass_at_k_batch(rows, 1).mean().item(), abs=1e-12)


def test_avg_at_k_rejects_bad_shapes():
    for bad in [
        torch.ones(3, dtype=torch.bool),
        torch.ones(0, 4, dtype=torch.bool),
        torch.ones(2, 0, dtype=torch.bool),
    ]:
        with pytest.raises(ValueError, match=r"\(P, k\) matrix"):
            avg_at_k(bad)


def vote_by_counter(preds):
    "Independent majority vote: Counter.most_common keeps first-insertion order among equal counts."
    valid = [a for a in preds if a not in (None, "", "[INVALID]")]
    return Counter(valid).most_common(1)[0][0] if valid else None


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["1", "2", "3", "[INVALID]", None]), min_size=1, max_size=7), min_size=1, max_size=5
    )
)
def test_maj_at_k_matches_counter_vote(preds):
    truths = ["2"] * len(preds)
    expected = sum(vote_by_counter(ps) == "2" for ps in preds) / len(preds)
    assert maj_at_k(preds, truths) == expected  # both: an integer count divided once, correctly rounded: equal
    for ps in preds:
        j = majority_vote(ps)
        assert (None if j is None else ps[j]) == vote_by_counter(ps)


def test_maj_at_k_uses_verdicts_of_first_voting_sample():
    preds = [["1/2", "0.5", "0.5", "3"]]
    # the vote is "0.5" (2 votes); its first sample is j = 1
    assert maj_at_k(preds, ["1/2"], correct=[[True, True, True, False]]) == 1.0
    assert maj_at_k(preds, ["1/2"], correct=[[True, False, True, False]]) == 0.0  # j = 1 judged wrong
    assert maj_at_k(preds, ["1/2"]) == 0.0  # string "0.5" != "1/2"


# ---------------------------------------------------------------- evaluate with a scripted engine


def byte_tokenizer():
    "Byte-level BPE tokenizer without merges (256 byte tokens + <|endoftext|> = id 256), built in code."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


class ScriptedEngine(RolloutEngine):
    "Answers prompt p (counted over calls) with the texts script[p]; EOS appended on stop, cut at max_tokens."

    def __init__(self, tokenizer, script, *args, **kw):
        self.tok, self.script, self.seen, self.calls = tokenizer, script, 0, []

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((len(prompts), params.n, params.seed, params.temperature, params.top_p, params.max_tokens))
        outs = []
        for q in range(len(prompts)):
            texts = self.script[self.seen + q]
            assert len(texts) == params.n
            for t in texts:
                ids = self.tok.encode(t, add_special_tokens=False)
                outs.append(
                    Completion(q, ids + [self.tok.eos_token_id], "stop")
                    if len(ids) < params.max_tokens
                    else Completion(q, ids[: params.max_tokens], "length")
                )
        self.seen += len(prompts)
        return outs

    def load_weights(self, named_tensors):
        pass


PROBLEMS = [("What is 1 + 1?", 2), ("What is 2 * 3?", 6), ("What is 10 - 3?", 7), ("What is 9 / 3?", 3)]
SCRIPT = [  # k = 3 samples per problem
    ["Answer: 2", "Answer: 2", "Answer: 2"],  # 3 correct, vote 2: right
    ["Answer: 5", "So\nAnswer: 6", "Answer: 5"],  # 1 correct, vote 5: wrong
    ["Answer: 8", "Answer: 7", "nothing"],  # 1 correct, tie 8 vs 7, 8 first: wrong
    ["blah " * 20, "Answer: 4", "Answer: 3"],  # 1 correct (1 truncated), tie 4 vs 3, 4 first: wrong
]
# avg@3 = (3+1+1+1)/12 = 0.5; pass@3 = 4/4 = 1; maj@3 = 1/4
# lengths (bytes + EOS; the long one is cut at max_tokens = 16): 30; 10+13+10 = 33; 10+10+8 = 28; 16+10+10 = 36
# mean = (30+33+28+36)/12 = 127/12; truncated 1/12
EXPECTED = {
    "avg@k": 0.5,
    "pass@k": 1.0,
    "maj@k": 0.25,
    "mean_length": 127 / 12,
    "truncated_frac": 1 / 12,
    "n_prompts": 4,
    "k": 3,
}


@pytest.mark.parametrize("batch_prompts", [1, 3, 64])
def test_evaluate_scripted_engine_hand_computed(batch_prompts):
    tok = byte_tokenizer()
    examples = [make_example(q, a) for q, a in PROBLEMS]
    eng = ScriptedEngine(tok, SCRIPT)
    res = evaluate(
        eng, tok, examples, k=3, temperature=1.0, top_p=0.7, max_tokens=16, seed=10, batch_prompts=batch_prompts
    )
    assert set(res) == set(EXPECTED) | {"reward", "reward_timeouts", "reward_errors"}
    assert (res["reward"], res["reward_timeouts"], res["reward_errors"]) == ("dapo-reference", 0, 0)
    for key, v in EXPECTED.items():
        assert res[key] == pytest.approx(v, abs=1e-12), key
    n_calls = math.ceil(4 / batch_prompts)
    assert [c[2] for c in eng.calls] == [10 + b for b in range(n_calls)]  # seed + batch index
    assert all(c[1:2] + c[3:] == (3, 1.0, 0.7, 16) for c in eng.calls)


def test_evaluate_rejects_misordered_completions():
    tok = byte_tokenizer()

    class Reversed(ScriptedEngine):
        def generate(self, prompts, params, use_tqdm=False):
            return super().generate(prompts, params)[::-1]

    with pytest.raises(RuntimeError, match="contiguously, in prompt order"):
        evaluate(
            Reversed(tok, SCRIPT),
            tok,
            [make_example(q, a) for q, a in PROBLEMS[:2]],
            k=3,
            temperature=1.0,
            top_p=0.7,
            max_tokens=16,
        )


# ---------------------------------------------------------------- the pass@k curve, per data_source


def test_pass_ks_are_the_powers_of_two_then_n():
    assert [pass_ks(n) for n in (1, 2, 3, 4, 5, 8, 32, 33)] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 4, 5],
        [1, 2, 4, 8],
        [1, 2, 4, 8, 16, 32],
        [1, 2, 4, 8, 16, 32, 33],
    ]
    with pytest.raises(ValueError, match="pass_ks needs n >= 1"):
        pass_ks(0)


def test_pass_at_k_curve_equals_hand_computation():
    # n = 6 samples, two problems with c = 2 and c = 5 correct; pass@k = 1 - C(n-c, k) / C(n, k):
    #   c = 2: k=1: 2/6 = 1/3;  k=2: 1 - C(4,2)/C(6,2) = 1 - 6/15 = 3/5;  k=4: 1 - C(4,4)/C(6,4) = 1 - 1/15 = 14/15;  k=6: 1
    #   c = 5: k=1: 5/6;        k=2: C(1,2) = 0, so 1;                    k=4: 1;                                 k=6: 1
    # means: pass@1 = (1/3 + 5/6)/2 = 7/12, pass@2 = (3/5 + 1)/2 = 4/5, pass@4 = (14/15 + 1)/2 = 29/30, pass@6 = 1
    correct = torch.tensor([[1, 0, 1, 0, 0, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    hand = {1: 7 / 12, 2: 4 / 5, 4: 29 / 30, 6: 1.0}
    assert pass_ks(6) == list(hand)
    for k, v in hand.items():
        assert pass_at_k_batch(correct, k).mean().item() == pytest.approx(v, abs=1e-12), k


# SCRIPT's problems as two sources, a = problems 0 and 2 (c = 3, 1 of k = 3), b = problems 1 and 3 (c = 1, 1).
# pass@2 of c = 3 is 1, of c = 1 is 1 - C(2,2)/C(3,2) = 2/3; pass@3 is 1 for every problem (each has c >= 1).
# all: avg@3 = 6/12 = 1/2, pass@1 = 1/2, pass@2 = (1 + 3 * 2/3)/4 = 3/4, pass@3 = 1, maj@3 = 1/4 (above)
# a:   avg@3 = 4/6 = 2/3,  pass@1 = 2/3, pass@2 = (1 + 2/3)/2 = 5/6,   pass@3 = 1, maj@3 = 1/2 (problem 0 only)
# b:   avg@3 = 2/6 = 1/3,  pass@1 = 1/3, pass@2 = 2/3,                 pass@3 = 1, maj@3 = 0
SOURCES = ["a", "b", "a", "b"]
HAND_FLAT = {
    "eval/avg@3": 1 / 2,
    "eval/pass@1": 1 / 2,
    "eval/pass@2": 3 / 4,
    "eval/pass@3": 1.0,
    "eval/maj@3": 1 / 4,
    "eval/a/avg@3": 2 / 3,
    "eval/a/pass@1": 2 / 3,
    "eval/a/pass@2": 5 / 6,
    "eval/a/pass@3": 1.0,
    "eval/a/maj@3": 1 / 2,
    "eval/b/avg@3": 1 / 3,
    "eval/b/pass@1": 1 / 3,
    "eval/b/pass@2": 2 / 3,
    "eval/b/pass@3": 1.0,
    "eval/b/maj@3": 0.0,
}


def sourced_examples(sources=SOURCES):
    return [make_example(q, a, data_source=s) for (q, a), s in zip(PROBLEMS, sources)]


def run_breakdown(examples, script, **kw):
    tok = byte_tokenizer()
    return evaluate(
        ScriptedEngine(tok, script), tok, examples, k=3, temperature=1.0, top_p=0.7, max_tokens=16, breakdown=True, **kw
    )


@pytest.mark.parametrize("batch_prompts", [1, 3, 64])
def test_breakdown_per_source_equals_hand_computation(batch_prompts):
    res = run_breakdown(sourced_examples(), SCRIPT, batch_prompts=batch_prompts)
    for key, v in EXPECTED.items():  # the default keys keep their values
        assert res[key] == pytest.approx(v, abs=1e-12), key
    assert list(res["by_source"]) == ["a", "b"]
    assert [res["by_source"][s]["n_prompts"] for s in "ab"] == [2, 2]
    flat = eval_metrics([res])
    assert set(flat) == set(HAND_FLAT)
    for key, v in HAND_FLAT.items():
        assert flat[key] == pytest.approx(v, abs=1e-12), key


def test_eval_metrics_of_shards_weights_by_problems():
    # shards of 1 and 3 problems (as ranks get them): the merged means are those of the whole set
    parts = [run_breakdown(sourced_examples()[:1], SCRIPT[:1]), run_breakdown(sourced_examples()[1:], SCRIPT[1:])]
    assert "b" not in parts[0]["by_source"]
    flat = eval_metrics(parts)
    assert set(flat) == set(HAND_FLAT)
    for key, v in HAND_FLAT.items():
        assert flat[key] == pytest.approx(v, abs=1e-12), key


def test_breakdown_names_an_empty_data_source_unknown():
    res = run_breakdown(sourced_examples(["", "", "a", "a"]), SCRIPT)
    assert list(res["by_source"]) == ["unknown", "a"]
    assert res["by_source"]["unknown"]["avg@k"] == pytest.approx(4 / 6, abs=1e-12)  # 3 + 1 of 6 samples


# ---------------------------------------------------------------- dapo-eval end to end


def write_jsonl(path, problems, duplicate_first=True):
    "Rows in the DAPO-Math-17k schema, written by hand (not by dapo_ref.data) to check interoperability."
    from dapo_ref.data import PROMPT_TEMPLATE

    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=q)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(a), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i, (q, a) in enumerate(problems)
    ]
    if duplicate_first:
        rows.append({**rows[0], "extra_info": {"index": len(rows)}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    "A random 2-layer Qwen2 (head_dim 32) and the byte-level tokenizer, saved with save_pretrained."
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("tiny_qwen2")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_saved_tokenizer_round_trips(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Solve: 12 + 30 = ?\nAnswer: 42 ü"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token_id == 256


def run_cli(args, capsys):
    main([str(a) for a in args])
    return capsys.readouterr().out


def test_cli_end_to_end_random_model(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "eval.jsonl", PROBLEMS[:3])  # 3 problems + 1 duplicate row
    out = tmp_path / "res" / "results.json"
    args = ["--model", tiny_model_dir, "--data", data, "--k", 2, "--max-tokens", 6, "--seed", 3, "--out", out]
    stdout = run_cli(args, capsys)
    res = json.loads(out.read_text())
    summary = [l for l in stdout.splitlines() if l.startswith("dapo-eval ")]
    assert len(summary) == 1 and "avg@2" in summary[0] and "pass@2" in summary[0] and str(out) in summary[0]
    assert (res["n_prompts"], res["k"], res["max_tokens"], res["seed"]) == (3, 2, 6, 3)  # dedup drops the copy
    for key in ["avg@k", "pass@k", "maj@k", "truncated_frac"]:
        assert 0.0 <= res[key] <= 1.0
    assert res["avg@k"] <= res["pass@k"]
    assert 1.0 <= res["mean_length"] <= 6.0
    assert [p["ground_truth"] for p in res["per_prompt"]] == ["2", "6", "7"]
    assert all(len(p["preds"]) == 2 for p in res["per_prompt"])
    # same seed, same numbers
    out2 = tmp_path / "again.json"
    run_cli(args[:-1] + [out2], capsys)
    res2 = json.loads(out2.read_text())
    assert {k: res2[k] for k in ["avg@k", "mean_length", "truncated_frac", "per_prompt"]} == {
        k: res[k] for k in ["avg@k", "mean_length", "truncated_frac", "per_prompt"]
    }


def test_cli_dedup_and_limit(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "eval.jsonl", PROBLEMS[:3])
    out = tmp_path / "r.json"
    base = ["--model", tiny_model_dir, "--data", data, "--k", 1, "--max-tokens", 2, "--out", out]
    run_cli(base + ["--no-dedup"], capsys)
    assert json.loads(out.read_text())["n_prompts"] == 4
    run_cli(base + ["--limit", 2, "--overwrite"], capsys)
    assert json.loads(out.read_text())["n_prompts"] == 2


def test_cli_with_scripted_engine_gives_hand_computed_metrics(tiny_model_dir, tmp_path, capsys, monkeypatch):
    "The command's plumbing (data, tokenizer, sampling settings, JSON) with known answers: swap the engine."
    made = []

    def fake_engine(model, eos_token_id, pad_token_id, max_batch_size=64):
        from transformers import AutoTokenizer

        made.append((eos_token_id, pad_token_id, max_batch_size))
        return ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), SCRIPT)

    monkeypatch.setattr(dapo_ref.rollout, "HFRolloutEngine", fake_engine)
    data = write_jsonl(tmp_path / "eval.jsonl", PROBLEMS, duplicate_first=False)
    out = tmp_path / "r.json"
    run_cli(
        [
            "--model",
            tiny_model_dir,
            "--data",
            data,
            "--k",
            3,
            "--max-tokens",
            16,
            "--temperature",
            1.0,
            "--top-p",
            0.7,
            "--batch-prompts",
            3,
            "--max-batch-size",
            8,
            "--out",
            out,
        ],
        capsys,
    )
    res = json.loads(out.read_text())
    for key, v in EXPECTED.items():
        assert res[key] == pytest.approx(v, abs=1e-12), key
    assert made == [(256, 256, 8)]
    assert [p["maj_pred"] for p in res["per_prompt"]] == ["2", "5", "8", "4"]
    assert [p["n_correct"] for p in res["per_prompt"]] == [3, 1, 1, 1]


def test_cli_errors(tiny_model_dir, tmp_path, capsys):
    cases = [
        (["--model", tiny_model_dir, "--data", tmp_path / "missing.jsonl"], "missing.jsonl: no such file"),
        (["--model", tmp_path / "no_model", "--data", write_jsonl(tmp_path / "e.jsonl", PROBLEMS)], "no such folder"),
        (["--model", tiny_model_dir, "--data", tmp_path / "e.jsonl", "--k", 0], "--k = 0 is out of range"),
    ]
    (tmp_path / "e.csv").write_text("x\n")
    cases.append((["--model", tiny_model_dir, "--data", tmp_path / "e.csv"], "expected a .parquet or .jsonl file"))
    (tmp_path / "broken.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}]}) + "\n")
    cases.append((["--model", tiny_model_dir, "--data", tmp_path / "broken.jsonl"], "reward_model"))
    for args, msg in cases:
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err, msg


# ---------------------------------------------------------------- reward mode, output file, guards

HALF_SCRIPT = [
    ["Answer: 1/2", "Answer: \\frac{1}{2}", "Answer: 0.5", "Answer: 2"]
]  # truth 0.5: 1 string match, 2 equivalent


@pytest.mark.parametrize("mode,correct", [("dapo-reference", 1), ("dapo-strict", 1), ("math-verify", 3)])
def test_cli_reward_mode(tiny_model_dir, tmp_path, capsys, monkeypatch, mode, correct):
    "--reward picks score_batch's mode: math-verify also accepts 1/2 and \\frac{1}{2} for 0.5; the string modes do not."
    monkeypatch.setattr(
        dapo_ref.rollout, "HFRolloutEngine", lambda *a, **kw: ScriptedEngine(byte_tokenizer(), HALF_SCRIPT)
    )
    data = write_jsonl(tmp_path / "half.jsonl", [("What is 1 / 2?", "0.5")], duplicate_first=False)
    out = tmp_path / "r.json"
    run_cli(
        ["--model", tiny_model_dir, "--data", data, "--k", 4, "--max-tokens", 32, "--reward", mode, "--out", out],
        capsys,
    )
    res = json.loads(out.read_text())
    assert res["per_prompt"][0]["n_correct"] == correct and res["avg@k"] == correct / 4
    assert res["reward"] == mode and res["math_verify"] == (mode == "math-verify")


def test_cli_out_is_never_lost(tiny_model_dir, tmp_path, capsys):
    "An existing results file is kept unless --overwrite; the new one is written whole (no temporary file left)."
    data = write_jsonl(tmp_path / "eval.jsonl", PROBLEMS[:2], duplicate_first=False)
    out = tmp_path / "r.json"
    out.write_text("the user's notes")
    base = ["--model", tiny_model_dir, "--data", data, "--k", 1, "--max-tokens", 2, "--out", out]
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in base])
    assert e.value.code == 2 and "pass --overwrite" in capsys.readouterr().err and out.read_text() == "the user's notes"
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in base + ["--overwrite"]])  # not a dapo-eval result: kept
    assert (
        e.value.code == 2
        and "is not a dapo-eval results file" in capsys.readouterr().err
        and out.read_text() == "the user's notes"
    )
    out.write_text(json.dumps({"written_by": "dapo-eval", "n_prompts": 9}, indent=2))  # an earlier result
    run_cli(base + ["--overwrite"], capsys)
    assert json.loads(out.read_text())["n_prompts"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl", "r.json"]


def test_generation_memory_matches_a_real_cache(tiny_model_dir):
    "The KV-cache term equals the bytes of the cache the engine builds; the parameter count equals the model's."
    from transformers import AutoModelForCausalLM, DynamicCache
    from dapo_ref.eval_cli import generation_memory

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cache = DynamicCache(config=model.config)
    rows, prompt, new = 5, 9, 4
    with torch.no_grad():
        model(input_ids=torch.ones(rows, prompt, dtype=torch.long), past_key_values=cache, use_cache=True)
        for _ in range(new - 1):
            model(input_ids=torch.ones(rows, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    cached = sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values))
    need = generation_memory(model.config, rows, prompt, new - 1, 4)  # the last sampled token is never cached
    assert need["kv_cache"] == cached
    assert need["n_params"] == sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert need["weights"] == 4 * need["n_params"]


def tiny_sets(folder, sizes=(3, 5)):
    "Two parquet files of tiny-task problems, data_source set-a and set-b, written by `save_math_dataset`."
    from dapo_ref.data import save_math_dataset
    from dapo_ref.tiny import tiny_splits

    _, held = tiny_splits(1, sum(sizes), seed=0)
    a, b = held[: sizes[0]], held[sizes[0] :]
    for ex in a:
        ex.data_source = "set-a"
    for ex in b:
        ex.data_source = "set-b"
    return save_math_dataset(a, folder / "a.parquet"), save_math_dataset(b, folder / "b.parquet"), a + b


def test_cli_several_files_per_source(tmp_path, capsys):
    fa, fb, examples = tiny_sets(tmp_path)
    out = tmp_path / "r.json"
    k = 4
    args = ["--model", "tiny", "--data", fa, fb, "--k", k, "--max-tokens", 48, "--device", "cpu", "--out", out]
    stdout = run_cli(args, capsys)
    res = json.loads(out.read_text())
    summary = [l for l in stdout.splitlines() if l.startswith("dapo-eval ")]
    assert len(summary) == 1 and f"on {fa},{fb}: avg@4" in summary[0]
    assert res["data_files"] == [str(fa), str(fb)] and res["n_prompts"] == 8
    assert [p["data_source"] for p in res["per_prompt"]] == ["set-a"] * 3 + ["set-b"] * 5
    assert [p["ground_truth"] for p in res["per_prompt"]] == [ex.ground_truth for ex in examples]
    by = res["by_source"]
    assert list(by) == ["set-a", "set-b"] and [by[s]["n_prompts"] for s in by] == [3, 5]
    curve = ["pass@1", "pass@2", "pass@4"]
    for r in [res, *by.values()]:
        assert {"avg@k", "maj@k", *curve} <= set(r)
    # every number from the per-problem counts, by hand: avg@k = correct / samples, pass@j = mean 1 - C(k-c,j)/C(k,j)
    for s, rows in [(None, res["per_prompt"])] + [
        (s, [p for p in res["per_prompt"] if p["data_source"] == s]) for s in by
    ]:
        r = res if s is None else by[s]
        c = [p["n_correct"] for p in rows]
        assert r["avg@k"] == pytest.approx(sum(c) / (k * len(c)), abs=1e-12)
        for j in (1, 2, 4):
            want = sum(1 - math.comb(k - x, j) / math.comb(k, j) for x in c) / len(c)
            assert r[f"pass@{j}"] == pytest.approx(want, abs=1e-12)
    # the overall avg@k is the problem-weighted mean of the per-source ones
    for m in ["avg@k", "maj@k"]:
        assert res[m] == pytest.approx(sum(by[s][m] * by[s]["n_prompts"] for s in by) / 8, abs=1e-12)
    assert 0 < res["avg@k"] < 1  # the tiny model solves some, not all: the mean is not trivially equal
    lines = stdout.splitlines()
    at = lines.index(summary[0])
    assert lines[at + 1] == "  all (8 problems): " + "  ".join(f"{m} {res[m]:.4f}" for m in curve)
    assert lines[at + 2].startswith(f"  set-a (3 problems): avg@4 {by['set-a']['avg@k']:.4f}  pass@1")
    assert lines[at + 3].endswith(f"maj@4 {by['set-b']['maj@k']:.4f}")
    # the trainer's comma-separated spelling is the same evaluation
    out2 = tmp_path / "comma.json"
    run_cli(args[:3] + [f"{fa},{fb}"] + args[5:-1] + [out2], capsys)
    res2 = json.loads(out2.read_text())
    assert (res2["by_source"], res2["per_prompt"]) == (by, res["per_prompt"])


def test_cli_registry_name(tmp_path, capsys, monkeypatch):
    "`--data aime-2024` is data/aime-2024.parquet under the working directory, as the trainer's eval_data."
    monkeypatch.chdir(tmp_path)
    fa, _, examples = tiny_sets(tmp_path)
    (tmp_path / "data").mkdir()
    fa.rename(tmp_path / "data" / "aime-2024.parquet")
    run_cli(["--model", "tiny", "--data", "aime-2024", "--k", 1, "--max-tokens", 4, "--device", "cpu"], capsys)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["data"] == "aime-2024" and res["data_files"] == ["data/aime-2024.parquet"]
    assert [p["ground_truth"] for p in res["per_prompt"]] == [ex.ground_truth for ex in examples[:3]]
    assert list(res["by_source"]) == ["set-a"]


# ---------------------------------------------------------------- the boxed answer format, by every reward form

BOX_PLUGINS = """
from dapo_ref.data import extract_boxed
def pair(response, ground_truth):
    return 1.0 if extract_boxed(response) == ground_truth else -1.0
def verl(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": pair(solution_str, ground_truth), "acc": extract_boxed(solution_str) == ground_truth}
def trl(prompts, completions, **columns):
    return [pair(c[0]["content"], g) for c, g in zip(completions, columns["ground_truth"])]
"""
BOX_SCRIPT = [["\\boxed{2}", "so \\boxed{3}", "\\boxed{2} then \\boxed{5}", "Answer: 2"]]  # truth 2


@pytest.mark.parametrize("reward", ["dapo-reference", "box_mod:pair", "box_mod:verl", "box_mod:trl"])
def test_cli_boxed_format_by_every_form(tiny_model_dir, tmp_path, capsys, monkeypatch, reward):
    "--answer-format boxed: +1 for the right last \\boxed{}, -1 for a wrong one or none, by the built-in reward and each plug-in form."
    (tmp_path / "box_mod.py").write_text(BOX_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(
        dapo_ref.rollout, "HFRolloutEngine", lambda *a, **kw: ScriptedEngine(byte_tokenizer(), BOX_SCRIPT)
    )
    data = write_jsonl(tmp_path / "box.jsonl", [("What is 1 + 1?", 2)], duplicate_first=False)
    out = tmp_path / "r.json"
    args = ["--model", tiny_model_dir, "--data", data, "--k", 4, "--max-tokens", 32, "--reward", reward, "--out", out]
    run_cli(args + ["--answer-format", "boxed", "--no-apply-chat-template"], capsys)
    res = json.loads(out.read_text())
    assert res["per_prompt"][0]["n_correct"] == 1 and res["avg@k"] == 0.25  # only the first: the last box counts
    assert res["per_prompt"][0]["preds"] == ["2", "3", "5", "[INVALID]"] and res["maj@k"] == 1.0  # 2, 3, 5 tie: first
    assert (res["answer_format"], res["apply_chat_template"]) == ("boxed", False)
