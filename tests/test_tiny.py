"Tests of dapo_ref.tiny and dapo_ref.tiny_ship beyond the notebooks: task determinism and correctness, tokenizer round trip, model loading, warm-start data, cache, shipped model."

import json, random, re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_ref import tiny, tiny_ship
from dapo_ref.data import PROMPT_TEMPLATE
from dapo_ref.tiny import (
    MAX_OPS,
    MAX_VALUE,
    RESPONSE_PREFIX,
    TINY_SHIPPED,
    WARM_START,
    build_tiny_model,
    build_tiny_tokenizer,
    is_heldout,
    sample_chain,
    sft_batches,
    tiny_problem,
    tiny_splits,
    worked_lines,
)
from dapo_ref.tiny_ship import ensure_tiny_model, shipped_tiny_problem, tiny_model_dir, tiny_source_hash

QUICK = dict(steps=3, batch_size=4)  # a warm start of a few steps: the cache logic, not the accuracy


def _independent_answer(problem):
    "Parse the words back and fold them with Python; no code shared with dapo_ref.tiny."
    value = int(re.match(r"Start at (\d+)\. ", problem).group(1))
    for verb, d in re.findall(r"(add|subtract|multiply by) (\d+)", problem.lower()):
        value = {"add": value + int(d), "subtract": value - int(d), "multiply by": value * int(d)}[verb]
    return value


def _score(solution, answer):
    "+1 when every line of working is right arithmetic and the last line is `Answer: <answer>`, else -1."
    *steps, last = solution.split("\n")
    ok = all(eval(s.split("=")[0]) == int(s.split("=")[1]) for s in steps)
    chained = all(steps[i].split("=")[1] == re.match(r"\d+", steps[i + 1]).group(0) for i in range(len(steps) - 1))
    return 1.0 if ok and chained and last == f"Answer: {answer}" else -1.0


@pytest.mark.parametrize("seed", range(5))
def test_problems_are_deterministic_and_correct(seed):
    a = [tiny_problem(random.Random(seed), n) for n in range(1, MAX_OPS + 1)]
    b = [tiny_problem(random.Random(seed), n) for n in range(1, MAX_OPS + 1)]
    assert a == b
    rng = random.Random(1000 + seed)
    for _ in range(300):
        n = rng.randint(1, 8)
        problem, answer, solution = tiny_problem(rng, n)
        assert isinstance(answer, int) and 0 <= answer <= 99
        assert _independent_answer(problem) == answer
        assert _score(solution, answer) == 1.0
        assert len(solution.split("\n")) == n + 1
        assert all(0 <= int(line.split("=")[1]) <= MAX_VALUE for line in solution.split("\n")[:-1])
        assert _score(solution, answer + 1) == -1.0


def test_splits_deterministic_disjoint_and_all_lengths():
    tr1, ev1 = tiny_splits(300, 150, seed=3)
    tr2, ev2 = tiny_splits(300, 150, seed=3)
    assert [e.question for e in tr1 + ev1] == [e.question for e in tr2 + ev2]
    assert [e.question for e in tiny_splits(300, 150, seed=5)[0]] != [e.question for e in tr1]  # another seed
    assert len({e.question for e in tr1}) == 300 and len({e.question for e in ev1}) == 150  # no repeats
    assert not {e.question for e in tr1} & {e.question for e in ev1}
    # held-out problems are never in any seed's train split
    tr_other, _ = tiny_splits(1000, 1, seed=4)
    assert not {e.question for e in tr_other} & {e.question for e in ev1}
    for e in tr1 + ev1:
        problem = e.question.split("\n\n")[1]
        assert e.question == PROMPT_TEMPLATE.format(problem=problem)
        assert is_heldout(problem) == (e in ev1) and e.data_source == "tiny"
        assert int(e.ground_truth) == _independent_answer(problem)
        assert _score(e.extra_info["solution"], e.ground_truth) == 1.0
    assert {e.extra_info["n_ops"] for e in ev1} == set(range(1, MAX_OPS + 1))
    with pytest.raises(ValueError, match="distinct"):
        tiny_splits(10, 1000, max_ops=1)


def test_heldout_fraction_about_one_in_five():
    rng = random.Random(0)
    texts = {tiny_problem(rng, rng.randint(2, 6))[0] for _ in range(3000)}
    frac = sum(map(is_heldout, texts)) / len(texts)
    # a sha256 hash mod 5 is a fair 1-in-5 coin per distinct text: n = 2816 texts, sd = sqrt(0.2 * 0.8 / 2816) = 0.0075,
    # so +-0.04 is 5.3 sd. The draw is deterministic on every platform (random.Random(0), sha256): 565 / 2816 = 0.2006.
    assert 0.16 < frac < 0.24, frac


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    tok = build_tiny_tokenizer()
    return tok, build_tiny_model(tok, tmp_path_factory.mktemp("tiny") / "m")


def test_tokenizer_round_trips_through_autotokenizer(tiny_folder):
    tok, path = tiny_folder
    loaded = AutoTokenizer.from_pretrained(path)
    tr, ev = tiny_splits(100, 50, seed=7)
    strings = [e.question for e in tr + ev] + [RESPONSE_PREFIX + e.extra_info["solution"] for e in tr + ev]
    strings += ["Answer: 1234567890", "x = 5\n\nAnswer: $\\frac{1}{2}$", "héllo wörld ✓", "  two  spaces\t\n"]
    for s in strings:
        a = loaded(s, add_special_tokens=False)["input_ids"]
        assert a == tok(s, add_special_tokens=False)["input_ids"], s
        assert loaded.decode(a) == s
    assert loaded.eos_token == loaded.pad_token == "<|endoftext|>"
    assert loaded.eos_token_id == tok.eos_token_id
    # the template compresses to a reasonable number of tokens; the longest responses stay short
    n_prompt = [len(tok(e.question)["input_ids"]) for e in ev]
    n_resp = [len(tok(RESPONSE_PREFIX + e.extra_info["solution"])["input_ids"]) + 1 for e in ev]
    assert 55 <= min(n_prompt) and max(n_prompt) <= 100, (min(n_prompt), max(n_prompt))
    assert max(n_resp) <= 70, max(n_resp)


def test_model_loads_with_auto_classes(tiny_folder):
    tok, path = tiny_folder
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
    assert cfg["vocab_size"] == len(tok)
    assert (path / "model.safetensors").exists()
    ids = torch.tensor([tok("Start at 7. Add 3.")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tok, path.parent / "bad", hidden_size=64, num_attention_heads=4)


def test_sft_batches_are_deterministic_and_never_held_out(tiny_folder):
    tok, _ = tiny_folder
    ids, labels = next(sft_batches(tok, 1, batch_size=4, seed=3))
    assert ids.shape == labels.shape
    for i in range(4):
        text = tok.decode(ids[i][: (labels[i] >= 0).nonzero()[0, 0]])
        assert text.startswith("Solve the following") and not is_heldout(text.split("\n\n")[1])
    a, b = (
        [x[0].tolist() for x in sft_batches(tok, 2, 3, seed=5)],
        [x[0].tolist() for x in sft_batches(tok, 2, 3, seed=5)],
    )
    assert a == b


def test_worked_lines_errors_follow_p_err():
    "With p_err = 0 every step is right arithmetic; with p_err = 1 the first step of this chain is wrong."
    ok = lambda line: eval(line.split("=")[0]) == int(line.split("=")[1])
    x0, ops = sample_chain(random.Random(1), 5)
    assert [ok(l) for l in worked_lines(x0, ops)[0][:-1]] == [True] * 5
    assert not ok(worked_lines(x0, ops, random.Random(2), p_err=1.0)[0][0])


def test_ensure_tiny_model_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_REF_CACHE", str(tmp_path))
    path = ensure_tiny_model(verbose=False, **QUICK)
    assert path.parent == tmp_path and path.name.startswith(tiny_ship.TINY_VERSION + "-")
    assert path == tiny_model_dir(**QUICK)
    assert tiny_model_dir().parent == tmp_path and tiny_model_dir() != path  # other settings, other folder
    assert json.loads((path / "tiny_build.json").read_text())["warm_start"]["steps"] == 3
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left behind
    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tiny_ship, "warm_start", boom)
    assert ensure_tiny_model(verbose=False, **QUICK) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_ensure_tiny_model_is_deterministic_and_cleans_up(tmp_path, monkeypatch):
    a = ensure_tiny_model(tmp_path / "a", verbose=False, **QUICK)
    b = ensure_tiny_model(tmp_path / "b", verbose=False, **QUICK)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()

    def fail(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny_ship, "warm_start", fail)
    with pytest.raises(RuntimeError):
        ensure_tiny_model(tmp_path / "c", verbose=False, **QUICK)
    assert list((tmp_path / "c").iterdir()) == []  # nothing half-built is left to be mistaken for a model


# --- the shipped warm start (dapo_ref/tiny_model/) ---


def test_shipped_tiny_model_matches_the_source():
    "Fails when the build's code changed without `make tiny-model` rebuilding (and committing) the shipped copy."
    assert shipped_tiny_problem() is None, shipped_tiny_problem()
    info = json.loads((TINY_SHIPPED / "tiny_build.json").read_text())
    assert info["warm_start"] == WARM_START and info["seed"] == WARM_START["seed"] and info["command"]
    assert {"python", "torch", "transformers", "tokenizers"} <= set(info["versions"])
    assert set(info["files"]) == {p.name for p in TINY_SHIPPED.iterdir()} - {"tiny_build.json"}
    model = AutoModelForCausalLM.from_pretrained(TINY_SHIPPED)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == len(
        AutoTokenizer.from_pretrained(TINY_SHIPPED)
    )


def test_default_model_is_the_shipped_one_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_REF_CACHE", str(tmp_path / "cache"))

    def boom(*a, **k):
        raise AssertionError("built although shipped")

    monkeypatch.setattr(tiny_ship, "build_tiny", boom)
    monkeypatch.setattr(tiny_ship, "warm_start", boom)  # patching does not change the source hash (it reads the file)
    assert ensure_tiny_model(verbose=False) == TINY_SHIPPED
    assert not (tmp_path / "cache").exists()


def test_changed_source_builds_instead_of_the_shipped_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAPO_REF_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny_ship, "tiny_source_hash", lambda: "f" * 64)
    calls = []

    def fake_build(out, verbose=True, command="", **warm):
        calls.append(out)
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"x")
        return out

    monkeypatch.setattr(tiny_ship, "build_tiny", fake_build)
    path = ensure_tiny_model()
    assert calls == [path] and path.parent == tmp_path and path != TINY_SHIPPED
    out = capsys.readouterr().out
    assert "not using the shipped tiny model" in out and "make tiny-model" in out


def test_source_hash_sees_code_not_comments_or_layout():
    "The build's identity is its syntax: comments, docstrings, quotes and a formatter's line breaks leave it; code changes it."
    src = (Path(tiny.__file__)).read_text()  # the builder is in tiny.py; tiny_source_hash reads that file
    ident = tiny_ship.code_identity
    assert ident("def f(x):\n    # why\n\n    return x + 1  # note\n") == ident("def f(x):\n  return x + 1\n")
    assert ident("def f(x):\n    'doc'\n    return g(x, 'a'); h()\n") == ident(
        'def f(x):\n    """other doc"""\n    return g(\n        x,\n        "a",\n    )\n    h()\n'
    )
    assert ident("def f(x):\n    return x + 1\n") != ident("def f(x):\n    return x + 2\n")
    assert ident("X = 'ab'\n") != ident("X = 'a'\n") and ident("X = ('a' 'b')\n") == ident("X = 'ab'\n")
    assert tiny_source_hash() == tiny_source_hash() and len(tiny_source_hash()) == 64
    assert all(f"{n} =" in src or f"def {n}(" in src for n in tiny_ship._BUILD_NAMES)


def test_dapo_tiny_cli_checks_and_refuses_bad_targets(tmp_path, capsys):
    assert tiny_ship.main(["--check"]) == 0
    assert tiny_ship.main(["--out", str(tmp_path / "missing" / "x")]) == 2
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("keep")
    assert tiny_ship.main(["--out", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine" / "a.txt").read_text() == "keep"
    err = capsys.readouterr().err
    assert "parent folder does not exist" in err and "is not a tiny model folder" in err
