"Tests of dapo_ref.data beyond the notebook: round trips, every kind of bad row, dedup counts, a property test."

import json, re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dapo_ref.data import (
    PROMPT_TEMPLATE,
    MathExample,
    dedup_examples,
    example_from_row,
    load_math_dataset,
    make_example,
    prompt_token_ids,
    save_math_dataset,
)

FORMATS = ["parquet", "jsonl"]


def find_shared(name):
    for d in [Path(__file__).resolve().parent, *Path(__file__).resolve().parents, Path.cwd(), *Path.cwd().parents]:
        if (d / "shared" / "data" / name).is_file():
            return d / "shared" / "data" / name


AIME = find_shared("aime-2024.parquet")


def good_row(i=0, gt="7"):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=f"p{i}")}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": i},
    }


def write_rows(rows, path):
    "Write raw rows (possibly malformed) without going through save_math_dataset."
    path = Path(path)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(tmp_path, fmt):
    exs = [
        make_example("What is $\\frac{1}{2}$ of {x}?", "1/2", index=0, tag="a"),
        make_example("Ünïcödé − minus\nnewline", 42, data_source="other", index=1, tag="b"),
        MathExample(
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"},
            ],
            "-3",
            data_source="s",
            ability="OTHER",
            extra_info={"index": 2, "tag": "c"},
            style="rule",
        ),
    ]
    p = save_math_dataset(exs, tmp_path / "sub" / f"d.{fmt}")
    assert p == tmp_path / "sub" / f"d.{fmt}" and p.is_file()
    back = load_math_dataset(p, dedup=False, verbose=False)
    assert back == exs
    assert back[2].question == "q2"
    assert save_math_dataset(back, tmp_path / f"e.{fmt}").read_bytes() == p.read_bytes()  # idempotent


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_empty(tmp_path, fmt):
    assert load_math_dataset(save_math_dataset([], tmp_path / f"e.{fmt}"), verbose=False) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_extra_info(tmp_path, fmt):
    exs = [make_example("a", 1), make_example("b", 2)]  # all extra_info == {}
    assert load_math_dataset(save_math_dataset(exs, tmp_path / f"d.{fmt}"), verbose=False) == exs


def test_parquet_heterogeneous_extra_info(tmp_path):
    "parquet has one struct column: a key missing in a row reads back as None; JSONL keeps rows as written."
    exs = [make_example("a", 1, index=0), make_example("b", 2, other="x"), make_example("c", 3)]
    back = load_math_dataset(save_math_dataset(exs, tmp_path / "d.parquet"), verbose=False)
    assert [e.extra_info for e in back] == [{"index": 0, "other": None}, {"index": None, "other": "x"}, {}]
    assert load_math_dataset(save_math_dataset(exs, tmp_path / "d.jsonl"), verbose=False) == exs


def test_parquet_mixed_extra_types_error(tmp_path):
    exs = [make_example("a", 1, index=0), make_example("b", 2, index="zero")]
    with pytest.raises(ValueError, match="use .jsonl for free-form extra_info"):
        save_math_dataset(exs, tmp_path / "d.parquet")
    assert load_math_dataset(save_math_dataset(exs, tmp_path / "d.jsonl"), verbose=False) == exs


def test_jsonl_not_serialisable(tmp_path):
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_math_dataset([make_example("a", 1, obj=object())], tmp_path / "d.jsonl")


def test_published_layout(tmp_path):
    "The writer uses the published column types, so files mix with DAPO-Math-17k / AIME-2024."
    p = save_math_dataset([make_example("a", 1, index=0)], tmp_path / "d.parquet")
    s = pq.read_schema(p)
    assert s.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert s.field("prompt").type == pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    assert s.field("reward_model").type == pa.struct([("ground_truth", pa.string()), ("style", pa.string())])


def test_int_ground_truth_in_file(tmp_path):
    "Hand-written files may store integer answers; they load as strings."
    for name in ("d.jsonl", "d.parquet"):
        back = load_math_dataset(write_rows([good_row(0, 540), good_row(1, -7)], tmp_path / name), verbose=False)
        assert [e.ground_truth for e in back] == ["540", "-7"]


def test_extra_columns_ignored(tmp_path):
    rows = [{**good_row(0), "__index_level_0__": 5, "junk": "x"}]
    for name in ("d.jsonl", "d.parquet"):
        assert load_math_dataset(write_rows(rows, tmp_path / name), verbose=False) == [example_from_row(good_row(0))]


def test_jsonl_blank_lines_and_row_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps(good_row(0)) + "\n\n   \n" + json.dumps(good_row(1)) + "\n" + json.dumps({"prompt": []}) + "\n"
    )
    with pytest.raises(ValueError, match=r"row 2 of d\.jsonl: prompt is an empty list"):
        load_math_dataset(p)


# ---------------------------------------------------------------- bad rows


def _mut(f):
    r = good_row(0)
    f(r)
    return r


BAD = [  # (row, message fragment)
    (_mut(lambda r: r.pop("prompt")), "prompt missing"),
    (_mut(lambda r: r.update(prompt=None)), "prompt missing"),
    (_mut(lambda r: r.pop("reward_model")), "reward_model missing"),
    (_mut(lambda r: r["reward_model"].pop("ground_truth")), "reward_model.ground_truth missing"),
    (_mut(lambda r: r["reward_model"].update(ground_truth=None)), "reward_model.ground_truth missing"),
    (_mut(lambda r: r.update(prompt="text")), "prompt is str, expected a list"),
    (_mut(lambda r: r.update(prompt={"role": "user", "content": "q"})), "prompt is dict, expected a list"),
    (_mut(lambda r: r.update(prompt=[])), "prompt is an empty list"),
    (
        _mut(lambda r: r.update(prompt=[{"role": "assistant", "content": "q"}])),
        "prompt has no message with role 'user'",
    ),
    (
        _mut(lambda r: r.update(prompt=[{"role": "user", "content": 5}])),
        "prompt[0].content is int (5), expected a string",
    ),
    (_mut(lambda r: r.update(prompt=[{"role": "user", "content": ["a"]}])), "prompt[0].content is list"),
    (_mut(lambda r: r.update(prompt=[{"role": "user"}])), "prompt[0].content missing"),
    (
        _mut(lambda r: r.update(prompt=[{"role": "user", "content": "q"}, {"role": 1, "content": "a"}])),
        "prompt[1].role is int",
    ),
    (_mut(lambda r: r.update(prompt=[["user", "q"]])), "prompt[0] is list, expected a {role, content} dict"),
    (_mut(lambda r: r["reward_model"].update(ground_truth=1.5)), "reward_model.ground_truth is float (1.5)"),
    (_mut(lambda r: r["reward_model"].update(ground_truth=False)), "reward_model.ground_truth is bool"),
    (_mut(lambda r: r["reward_model"].update(ground_truth=[1])), "reward_model.ground_truth is list"),
    (_mut(lambda r: r["reward_model"].update(ground_truth="")), "reward_model.ground_truth is an empty string"),
    (_mut(lambda r: r["reward_model"].update(style=3)), "reward_model.style is int"),
    (_mut(lambda r: r.update(reward_model="7")), "reward_model is str, expected a dict"),
    (_mut(lambda r: r.update(data_source=1)), "data_source is int (1), expected a string"),
    (_mut(lambda r: r.update(ability=["MATH"])), "ability is list"),
    (_mut(lambda r: r.update(extra_info="x")), "extra_info is str, expected a dict"),
]


@pytest.mark.parametrize("row,frag", BAD, ids=[f for _, f in BAD])
def test_bad_row_jsonl(tmp_path, row, frag):
    p = write_rows([good_row(0), good_row(1), row], tmp_path / "data.jsonl")
    with pytest.raises(ValueError) as e:
        load_math_dataset(p)
    msg = str(e.value)
    assert msg.startswith("row 2 of data.jsonl: "), msg
    assert frag in msg, msg
    assert "every row needs" in msg, msg


PARQUET_BAD = [  # the ones parquet can hold with a column type shared with good rows
    ("reward_model", {"style": "x"}, "reward_model.ground_truth missing"),
    ("prompt", [], "prompt is an empty list"),
    ("prompt", None, "prompt missing"),
    ("prompt", [{"role": "system", "content": "q"}], "prompt has no message with role 'user'"),
    ("reward_model", {"ground_truth": "", "style": "x"}, "reward_model.ground_truth is an empty string"),
]


@pytest.mark.parametrize("key,val,frag", PARQUET_BAD)
def test_bad_row_parquet(tmp_path, key, val, frag):
    rows = [good_row(i) for i in range(20)]
    rows[17][key] = val
    with pytest.raises(ValueError, match=rf"^row 17 of data\.parquet: {frag}"):
        load_math_dataset(write_rows(rows, tmp_path / "data.parquet"))


def test_parquet_wrong_column_type(tmp_path):
    t = pa.table({"prompt": pa.array(["just text"]), "reward_model": pa.array([{"ground_truth": "1"}])})
    pq.write_table(t, tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="row 0 of d.parquet: prompt is str, expected a list"):
        load_math_dataset(tmp_path / "d.parquet")


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"prompt": pa.array([[{"role": "user", "content": "q"}]])}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="row 0 of d.parquet: reward_model missing"):
        load_math_dataset(tmp_path / "d.parquet")


def test_jsonl_non_object_row(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps(good_row(0)) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="row 1 of d.jsonl: expected an object"):
        load_math_dataset(tmp_path / "d.jsonl")


def test_jsonl_invalid_json(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps(good_row(0)) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=r"row 1 of d\.jsonl \(line 3\): not valid JSON"):
        load_math_dataset(tmp_path / "d.jsonl")


@pytest.mark.parametrize("name", ["d.csv", "d.json", "d.parquet.gz", "d"])
def test_unknown_extension(tmp_path, name):
    (tmp_path / name).write_text("x")
    with pytest.raises(ValueError, match="unknown file extension"):
        load_math_dataset(tmp_path / name)
    with pytest.raises(ValueError, match="unknown file extension"):
        save_math_dataset([make_example("a", 1)], tmp_path / ("out_" + name))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl is absent; give a .parquet or .jsonl file"):
        load_math_dataset(tmp_path / "nope.jsonl")


def test_save_validates_before_writing(tmp_path):
    p = tmp_path / "d.jsonl"
    with pytest.raises(ValueError, match="example 1 passed to save_math_dataset: reward_model.ground_truth is float"):
        save_math_dataset([make_example("a", 1), MathExample([{"role": "user", "content": "q"}], 1.5)], p)
    assert not p.exists()


# ---------------------------------------------------------------- dedup


@pytest.mark.parametrize("fmt", FORMATS)
def test_dedup_counts(tmp_path, fmt, capsys):
    # 4 distinct prompts; prompt i repeated i + 1 times -> 1 + 2 + 3 + 4 = 10 rows, 10 - 4 = 6 dropped
    exs = [make_example(f"p{i}", i, copy=c) for i in range(4) for c in range(i + 1)]
    p = save_math_dataset(exs, tmp_path / f"d.{fmt}")
    capsys.readouterr()
    kept = load_math_dataset(p)
    out = capsys.readouterr().out
    assert out == f"d.{fmt}: 10 rows, 4 unique prompts; dropped 6 duplicate rows (dedup=False keeps them)\n"
    assert [e.ground_truth for e in kept] == ["0", "1", "2", "3"]
    assert all(e.extra_info["copy"] == 0 for e in kept)  # first occurrence kept
    assert len(load_math_dataset(p, dedup=False)) == 10
    assert capsys.readouterr().out == f"d.{fmt}: 10 rows, 4 unique prompts; kept all 10 rows (dedup=False)\n"
    load_math_dataset(p, verbose=False)
    assert capsys.readouterr().out == ""


def test_dedup_key_is_all_messages():
    u = {"role": "user", "content": "q"}
    a = MathExample([u], "1")
    b = MathExample([{"role": "system", "content": "s"}, u], "1")  # same question, different prompt
    c = MathExample([u], "1", data_source="other")  # same prompt, other metadata: a duplicate
    kept, dropped = dedup_examples([a, b, c])
    assert kept == [a, b] and dropped == 1


def test_dedup_conflicting_answers_warns():
    with pytest.warns(UserWarning, match="1 duplicate rows have a different ground_truth"):
        kept, dropped = dedup_examples([make_example("q", 1), make_example("q", 2), make_example("q", 1)])
    assert [e.ground_truth for e in kept] == ["1"] and dropped == 2


# ---------------------------------------------------------------- the real AIME-2024 file


@pytest.mark.skipif(AIME is None, reason="shared/data/aime-2024.parquet not present")
def test_aime_2024(capsys):
    full = load_math_dataset(AIME, dedup=False, verbose=False)
    assert len(full) == 960
    aime = load_math_dataset(AIME)
    assert capsys.readouterr().out.strip() == (
        "aime-2024.parquet: 960 rows, 30 unique prompts; dropped 930 duplicate rows (dedup=False keeps them)"
    )
    assert len(aime) == 30 and len({e.question for e in aime}) == 30
    assert all(str(int(e.ground_truth)) == e.ground_truth for e in aime)  # integers, no padding or spaces
    assert all(e.question == PROMPT_TEMPLATE.format(problem=e.extra_info["raw_problem"]) for e in aime)
    assert {e.data_source for e in aime} == {"math_dapo"}
    # every copy of a problem carries the same answer (dedup warns otherwise)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dedup_examples(full)


@pytest.mark.skipif(AIME is None, reason="shared/data/aime-2024.parquet not present")
@pytest.mark.parametrize("fmt", FORMATS)
def test_aime_round_trip(tmp_path, fmt):
    full = load_math_dataset(AIME, dedup=False, verbose=False)
    assert load_math_dataset(save_math_dataset(full, tmp_path / f"a.{fmt}"), dedup=False, verbose=False) == full


# ---------------------------------------------------------------- prompt_token_ids


@pytest.fixture(scope="module")
def byte_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    for s in ["<s>", "</s>"]:
        vocab[s] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


def test_prompt_token_ids_bytes(byte_tok):
    byte_tok.chat_template = None
    ex = make_example("1 + 1 = ?", 2)
    ids = prompt_token_ids(ex, byte_tok)
    assert len(ids) == len(ex.question.encode("utf-8"))  # byte-level, no merges: one token per byte, no BOS
    assert byte_tok.decode(ids) == ex.question
    byte_tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids = prompt_token_ids(ex, byte_tok)
    assert byte_tok.decode(ids) == "[user]" + ex.question + "[assistant]"
    byte_tok.chat_template = None


# ---------------------------------------------------------------- property: round trip

_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}
)


@st.composite
def _examples(draw):
    n = draw(st.integers(0, 6))
    keys = draw(st.lists(st.sampled_from(["index", "split", "raw"]), unique=True, max_size=3))  # one key set per file
    out = []
    for i in range(n):
        prompt = draw(st.lists(_msg, max_size=3)) + [{"role": "user", "content": draw(_text)}]
        gt = draw(st.one_of(_text.filter(str.strip), st.integers(-(10**6), 10**6).map(str)))
        extra = {k: (i if k == "index" else draw(st.one_of(st.none(), _text))) for k in keys}
        out.append(
            MathExample(
                prompt,
                gt,
                data_source=draw(st.text(max_size=10)),
                ability=draw(st.text(max_size=5)),
                extra_info=extra,
                style=draw(st.text(max_size=10)),
            )
        )
    return out


@pytest.mark.filterwarnings("ignore:.*different ground_truth")  # random duplicates may disagree
@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(exs=_examples())
def test_round_trip_property(tmp_path, fmt, exs):
    p = save_math_dataset(exs, tmp_path / f"h.{fmt}")
    assert load_math_dataset(p, dedup=False, verbose=False) == exs
    kept, dropped = dedup_examples(exs)
    assert len(load_math_dataset(p, verbose=False)) == len(kept) == len(exs) - dropped


# ---------------------------------------------------------------- files that are not what their name says

from dapo_ref.core import InputError
from dapo_ref.data import check_prompt_lengths


@pytest.mark.parametrize("content", [b"", b"PAR1", b"data_source,prompt\nx,y\n", b'{"prompt": []}\n'])
def test_not_a_parquet_file(tmp_path, content):
    p = tmp_path / "d.parquet"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=r"d\.parquet: not a readable parquet file \(.*\); write it with pyarrow") as e:
        load_math_dataset(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_truncated_parquet(tmp_path):
    p = write_rows([good_row(i) for i in range(50)], tmp_path / "d.parquet")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])  # the footer is gone
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_math_dataset(p)


@pytest.mark.parametrize("bad,byte", [(b"caf\xe9", 0xE9), (b"\xff\xfe", 0xFF), (b"\xc3", 0xC3)])
def test_jsonl_invalid_utf8_names_file_row_and_line(tmp_path, bad, byte):
    p = tmp_path / "d.jsonl"
    p.write_bytes((json.dumps(good_row(0)) + "\n\n").encode() + b'{"prompt": "' + bad + b'"}\n')
    with pytest.raises(ValueError) as e:
        load_math_dataset(p)
    msg = str(e.value)
    col = len('{"prompt": "') + bad.index(bytes([byte])) + 1  # 1-based column of the first bad byte
    assert msg.startswith(f"row 1 of d.jsonl (line 3): not valid UTF-8 (byte 0x{byte:02x} at column {col})")
    assert msg.endswith(f"save {p} as UTF-8")


def test_jsonl_utf16_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes((json.dumps(good_row(0)) + "\n").encode("utf-16"))
    with pytest.raises(ValueError, match=r"row 0 of d\.jsonl \(line 1\): not valid UTF-8"):
        load_math_dataset(p)


def test_jsonl_byte_order_mark_accepted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps(good_row(0)) + "\n").encode())
    assert load_math_dataset(p, verbose=False) == [example_from_row(good_row(0))]


def test_dataset_folder(tmp_path):
    (tmp_path / "d.parquet").mkdir()
    with pytest.raises(ValueError, match="d.parquet is a folder; give a .parquet or .jsonl file"):
        load_math_dataset(tmp_path / "d.parquet")


@pytest.mark.parametrize("fmt", FORMATS)
def test_source_is_file_row_before_dedup(tmp_path, fmt):
    rows = [good_row(0), good_row(1), good_row(0), good_row(0), good_row(2)]  # rows 2 and 3 repeat row 0
    exs = load_math_dataset(write_rows(rows, tmp_path / f"d.{fmt}"), verbose=False)
    assert [e.source for e in exs] == [f"row {i} of d.{fmt}" for i in (0, 1, 4)]
    exs = load_math_dataset(tmp_path / f"d.{fmt}", dedup=False, verbose=False)
    assert [e.source for e in exs] == [f"row {i} of d.{fmt}" for i in range(5)]
    assert exs[0] == exs[2] and ", source=" not in repr(exs[0])  # where it was read is not part of the example


def test_check_prompt_lengths_names_file_row(tmp_path):
    rows = [good_row(0), good_row(0), good_row(1), good_row(2)]
    rows[3]["prompt"][0]["content"] += " x" * 50
    exs = load_math_dataset(write_rows(rows, tmp_path / "d.jsonl"), verbose=False)
    ids = [list(range(len(e.question.split()))) for e in exs]  # one "token" per word
    n0, n2 = len(ids[0]), len(ids[2])
    assert n2 == n0 + 50
    check_prompt_lengths(exs, ids, n2)
    with pytest.raises(InputError) as e:
        check_prompt_lengths(exs, ids, n2 - 1, "--max-prompt-length")
    assert str(e.value) == (
        f"--max-prompt-length = {n2 - 1}: 1 of 3 prompts are longer (first: row 3 of d.jsonl, "
        f"{n2} tokens; longest: {n2}); raise --max-prompt-length or drop those rows"
    )
    with pytest.raises(InputError, match=r"3 of 3 prompts are longer \(first: row 0 of d.jsonl"):
        check_prompt_lengths(exs, ids, n0 - 1)
    with pytest.raises(InputError, match=r"first: example 1,"):  # examples built in code have no file row
        check_prompt_lengths([make_example("a", 1), make_example("a b c", 1)], [[1], [1, 2, 3]], 2)


def test_load_eval_files_keeps_each_files_data_source(tmp_path):
    from dapo_ref.core import InputError
    from dapo_ref.datasets import eval_files, load_eval_files

    save_math_dataset([make_example("What is 1 + 1?", 2, data_source="")], tmp_path / "mine.jsonl")
    save_math_dataset([make_example("What is 2 + 3?", 5, data_source="math")] * 2, tmp_path / "m.parquet")
    held = load_eval_files(f"{tmp_path / 'mine.jsonl'},{tmp_path / 'm.parquet'}")
    assert [(e.ground_truth, e.data_source) for e in held] == [("2", "mine"), ("5", "math")]  # stem; deduplicated
    with pytest.raises(InputError, match=r"aime-2024.parquet is absent; fetch it with `dapo-data --only aime-2024`"):
        eval_files("aime-2024", data_dir=tmp_path)
    with pytest.raises(InputError, match="eval_data item 1 of 2: x.jsonl is absent"):
        eval_files(f"x.jsonl,{tmp_path / 'mine.jsonl'}")
    with pytest.raises(InputError, match="is a folder; give a .parquet or .jsonl file"):
        eval_files(str(tmp_path))


# ---------------------------------------------------------------- data specs: names, other schemas, the hub

# DAPO-Math-17k's user message, written out here rather than read from PROMPT_TEMPLATE: a mapped problem must come out
# as the published rows hold it
DAPO_USER = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_row(problem, answer, source, index):
    "The row of `problem` in the DAPO-Math-17k schema, as the published files hold one."
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": DAPO_USER.format(problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(answer), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index, "raw_problem": problem},
    }


def test_train_data_takes_the_names_dapo_data_writes(tmp_path, monkeypatch):
    """`train_data: dapo-math-17k` reads data/dapo-math-17k.parquet, where `dapo-data` writes it, as `eval_data` names
    do (before: the name was read as a path and not found); an unfetched name says which command fetches it."""
    from dapo_ref.core import DAPOConfig, validate
    from dapo_ref.datasets import load_eval_files

    monkeypatch.chdir(tmp_path)
    save_math_dataset([example_from_row(good_row(i)) for i in (0, 1, 0)], tmp_path / "data" / "dapo-math-17k.parquet")
    save_math_dataset([example_from_row(good_row(7, "9"))], tmp_path / "data" / "aime-2024.parquet")
    cfg = validate(DAPOConfig(train_data="dapo-math-17k", eval_data="aime-2024"))
    train = load_math_dataset(cfg.train_data)  # as the trainer's load_splits reads train_data (tests/test_readme.py)
    assert train == [example_from_row(good_row(0)), example_from_row(good_row(1))]  # deduplicated, as the file loads
    assert [e.source for e in train] == ["row 0 of dapo-math-17k.parquet", "row 1 of dapo-math-17k.parquet"]
    assert load_eval_files(cfg.eval_data) == [example_from_row(good_row(7, "9"))]
    with pytest.raises(ValueError, match=r"^aime-2025 is a name dapo-data fetches, but data/aime-2025.parquet is "):
        load_math_dataset(validate(DAPOConfig(train_data="aime-2025")).train_data)
    with pytest.raises(ValueError, match="fetch it with `dapo-data --only aime-2025` \\(or give a path\\)$"):
        load_math_dataset("aime-2025")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_problem_answer_file_loads_as_the_dapo_schema_does(tmp_path, fmt):
    """A file with `problem` / `answer` columns, read through the mapping, gives the examples its problems have in the
    DAPO-Math-17k schema: the user message is the DAPO template around the problem (written out above), the integer
    answer its decimal string, extra_info the row's index and raw problem, data_source the file's name; repeated
    problems are dropped as in a DAPO file. Before, `load_math_dataset` read only the DAPO schema."""
    rows = [
        {"problem": "What is $2 + 3$?", "answer": 5, "level": 1},
        {"problem": "Find $x$ if $2x = 8$.", "answer": 4, "level": 2},
        {"problem": "What is $2 + 3$?", "answer": 5, "level": 1},
    ]
    mine = write_rows(rows, tmp_path / f"mine.{fmt}")
    got = load_math_dataset(f"{mine}:prompt=problem:answer=answer", verbose=False)
    want = [dapo_row("What is $2 + 3$?", 5, "mine", 0), dapo_row("Find $x$ if $2x = 8$.", 4, "mine", 1)]
    assert got == [example_from_row(r) for r in want]
    assert [e.source for e in got] == [f"row 0 of mine.{fmt}", f"row 1 of mine.{fmt}"]
    # its data_source from a column, and the boxed instruction
    rows = [{"q": "What is $1 + 1$?", "a": "2", "src": "easy"}]
    mine = write_rows(rows, tmp_path / f"src.{fmt}")
    (ex,) = load_math_dataset(f"{mine}:prompt=q:answer=a:data_source=src:answer_format=boxed", verbose=False)
    assert ex.data_source == "easy"
    assert ex.question == "What is $1 + 1$?\nPlease reason step by step, and put your final answer within \\boxed{}."
    with pytest.raises(
        ValueError, match=r"(has no column problem; its columns are q, a, src|column problem \(prompt=)"
    ):
        load_math_dataset(f"{mine}:prompt=problem:answer=a")


@pytest.mark.skipif(AIME is None, reason="shared/data/aime-2024.parquet not present")
def test_the_published_aime_rows_from_their_problems_and_answers(tmp_path):
    """The published AIME-2024 file, rebuilt from its raw problems and answers alone as a problem/answer file and read
    through the mapping, holds the published prompts and answers, row for row."""
    published = load_math_dataset(AIME, verbose=False)
    plain = [
        {"problem": e.extra_info["raw_problem"], "answer": e.ground_truth, "src": e.data_source} for e in published
    ]
    got = load_math_dataset(
        f"{write_rows(plain, tmp_path / 'aime.parquet')}:prompt=problem:answer=answer:data_source=src"
    )
    assert [(e.prompt, e.ground_truth, e.data_source) for e in got] == [
        (e.prompt, e.ground_truth, e.data_source) for e in published
    ]


def test_data_spec_is_checked_before_a_row_is_read(tmp_path):
    """Every part of a spec is parsed and checked up front, and written back by str(); a mistake is one line naming
    the setting, the spec and the fix."""
    from dapo_ref.data import DataSpec, data_spec

    f = write_rows([good_row(0)], tmp_path / "m.parquet")
    assert data_spec("hub:BytedTsinghua-SIA/DAPO-Math-17k@v1.0:config=default:split=train") == DataSpec(
        "BytedTsinghua-SIA/DAPO-Math-17k", hub=True, revision="v1.0", config="default", split="train"
    )
    s = f"{f}:prompt=problem:answer=answer:data_source=subject:answer_format=boxed"
    assert str(data_spec(s)) == s
    assert data_spec(f"{f}:answer=a:prompt=p").columns == {"prompt": "p", "answer": "a"}
    for spec, msg in [
        (f"{f}:prompt=p", "prompt= and answer= map the problem and answer columns together"),
        (f"{f}:split=train:prompt=p:answer=a", "split= chooses among a hub dataset's files; a local file is one table"),
        (
            f"{f}:prompt=p:answer=a:answer_format=latex",
            "answer_format=latex is unknown; give one of answer_line, boxed",
        ),
        (f"{f}:prompt", "'prompt' is no option; after the file or hub:owner/name come :key=value options"),
        ("hub:a/b/c", "'a/b/c' is no hub dataset; write hub:owner/name"),
        ("hub:a/b:split=x:split=x", "split is given twice"),
        (f"{tmp_path / 'nope.parquet'}:prompt=p:answer=a", "nope.parquet is absent; give a .parquet or .jsonl file"),
    ]:
        with pytest.raises(ValueError, match=r"^train_data: .*" + re.escape(msg)):
            data_spec(spec, "train_data")


def test_eval_data_takes_specs(tmp_path):
    "`eval_data` takes the specs `train_data` takes: a mapped file and a hub dataset beside a plain file."
    from dapo_ref.datasets import eval_files, load_eval_files

    plain = save_math_dataset([make_example("What is 1 + 1?", 2, data_source="")], tmp_path / "plain.jsonl")
    mapped = write_rows([{"problem": "What is 3 + 3?", "answer": 6}], tmp_path / "mine.parquet")
    held = load_eval_files(f"{plain},{mapped}:prompt=problem:answer=answer")
    assert [(e.data_source, e.ground_truth, e.question) for e in held] == [
        ("plain", "2", PROMPT_TEMPLATE.format(problem="What is 1 + 1?")),
        ("mine", "6", DAPO_USER.format("What is 3 + 3?")),
    ]
    specs = eval_files(f"{plain},{mapped}:prompt=problem:answer=answer,hub:o/n:split=test")
    assert [str(s) for s in specs] == [str(plain), f"{mapped}:prompt=problem:answer=answer", "hub:o/n:split=test"]
    assert [s.name for s in specs] == ["plain", "mine", "n"]
