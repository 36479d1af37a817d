"""`dapo-data` offline: a small fake hub cache made here (the layout huggingface_hub reads with HF_HUB_OFFLINE=1), holding
DAPO-Math-17k- and AIME-2024-shaped parquet files with repeated rows; the command fetches, deduplicates, writes the files
the recipes name and prints counts and checksums; an existing file is refused; a missing dataset is one line."""

import hashlib, os, subprocess, sys
from pathlib import Path

import pytest

from dapo_ref.data import MathExample, load_math_dataset, save_math_dataset
from dapo_ref.datasets import HUB_DATASETS

ROOT = Path(__file__).resolve().parents[1]
SHA = "89abcdef0123456789abcdef0123456789abcdef"


def fake_dataset(cache: Path, name: str, examples: list) -> Path:
    "Write `examples` as the `main` snapshot's file of hub dataset `name` (as HUB_DATASETS names it) in an HF cache."
    repo_id, fname = HUB_DATASETS[name]
    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    f = save_math_dataset(examples, repo / "snapshots" / SHA / fname)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SHA)
    return f


def problem(i: int) -> MathExample:
    return MathExample(
        [
            {
                "role": "user",
                "content": f'Solve: what is {i} + {i}? Remember to put your answer on its own line after "Answer:"',
            }
        ],
        str(2 * i),
        extra_info={"index": i},
    )


@pytest.fixture()
def hub(tmp_path):
    cache = tmp_path / "hub"
    math = [
        problem(i) for _ in range(5) for i in range(40)
    ]  # 40 problems, each 5 times (the published file: ~100 times)
    aime = [problem(1000 + i) for i in range(6) for _ in range(4)]  # 6 problems, each 4 times in a row
    srcs = {
        "dapo-math-17k": fake_dataset(cache, "dapo-math-17k", math),
        "aime-2024": fake_dataset(cache, "aime-2024", aime),
    }
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return env, srcs


def run(args, env):
    return subprocess.run(
        [sys.executable, "-c", "import sys; from dapo_ref.datasets import main; sys.exit(main())", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_dapo_data_writes_deduplicated_files_with_checksums(hub, tmp_path):
    env, srcs = hub
    p = run(["--out", str(tmp_path / "data")], env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    for name, rows, unique in (("dapo-math-17k", 200, 40), ("aime-2024", 24, 6)):
        out = tmp_path / "data" / f"{name}.parquet"
        line = next(l for l in lines if l.startswith(name + ":"))
        assert f"{rows} rows of {HUB_DATASETS[name][0]}/{HUB_DATASETS[name][1]} (sha256 {sha(srcs[name])[:16]})" in line
        assert f"{unique} unique prompts -> {out} (sha256 {sha(out)})" in line
        got = load_math_dataset(out, verbose=False)
        want = load_math_dataset(srcs[name], verbose=False)  # the first row of each prompt, in file order
        assert [(e.prompt, e.ground_truth, e.extra_info) for e in got] == [
            (e.prompt, e.ground_truth, e.extra_info) for e in want
        ]
        assert len(got) == unique
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["aime-2024.parquet", "dapo-math-17k.parquet"]


def test_existing_file_is_refused_and_kept(hub, tmp_path):
    env, _ = hub
    mine = tmp_path / "data" / "aime-2024.parquet"
    mine.parent.mkdir()
    mine.write_bytes(b"my own file")
    p = run(["--out", str(tmp_path / "data")], env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "aime-2024.parquet exists; pass --overwrite" in p.stderr
    assert mine.read_bytes() == b"my own file" and not (tmp_path / "data" / "dapo-math-17k.parquet").exists()
    assert run(["--out", str(tmp_path / "data"), "--only", "aime-2024", "--overwrite"], env).returncode == 0
    assert len(load_math_dataset(mine, verbose=False)) == 6


def test_dataset_not_in_the_cache_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    p = run(["--out", str(tmp_path / "data"), "--only", "aime-2024"], env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "dapo-data: error: cannot fetch data/aime-2024.parquet of BytedTsinghua-SIA/AIME-2024" in p.stderr
    assert not (tmp_path / "data" / "aime-2024.parquet").exists()


def test_aime_2025_and_math_500_are_converted_into_the_schema(tmp_path):
    """aime-2025 and math-500 in their upstream schemas (a problem, an answer and metadata columns; parquet and JSONL, as
    published), written here as small real files in a fake cache: `dapo-data --only` converts them into the
    DAPO-Math-17k schema with the format's prompt template and data_source = the name."""
    import json

    import pyarrow as pa, pyarrow.parquet as pq

    from dapo_ref.data import BOXED_TEMPLATE, PROMPT_TEMPLATE
    from dapo_ref.datasets import convert_upstream

    cache, upstream = tmp_path / "hub", {}
    aime_q = "Find the sum of all integer bases $b>9$ ..."
    aime = [
        dict(id="0", problem=aime_q, answer="70", url="u0", year="2025"),
        dict(id="1", problem="On $\\triangle ABC$ points ...", answer="588", url="u1", year="2025"),
        dict(id="0", problem=aime_q, answer="70", url="u0", year="2025"),  # a repeated row: dropped
    ]
    math = [
        dict(
            problem="Convert $(0,3)$ to polar coordinates.",
            solution="...",
            answer="\\left( 3, \\frac{\\pi}{2} \\right)",
            subject="Precalculus",
            level=2,
            unique_id="test/precalculus/807.json",
        ),
        dict(problem="What is $1+1$?", solution="...", answer="2", subject="Prealgebra", level=1, unique_id="t/1.json"),
    ]
    for name, rows in [("aime-2025", aime), ("math-500", math)]:
        repo_id, names = HUB_DATASETS[name]
        fname = names if isinstance(names, str) else names[-1]  # the last name it may have: the others tried first
        repo = cache / f"datasets--{repo_id.replace('/', '--')}"
        f = repo / "snapshots" / SHA / fname
        f.parent.mkdir(parents=True)
        if f.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), f)
        else:
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(SHA)
        upstream[name] = (f, rows)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for name, unique in (("aime-2025", 2), ("math-500", 2)):
        p = run(["--out", str(tmp_path / "data"), "--only", name, "--answer-format", "boxed"], env)
        assert p.returncode == 0, p.stderr
        f, rows = upstream[name]
        got = load_math_dataset(tmp_path / "data" / f"{name}.parquet", verbose=False)
        assert f"{name}: {len(rows)} rows of" in p.stdout and len(got) == unique
        assert f"{f.name} (sha256" in p.stdout  # the file it found (aime-2025: its second name, after the first)
        assert [e.ground_truth for e in got] == [r["answer"] for r in rows[:unique]]
        assert [e.prompt for e in got] == [
            [{"role": "user", "content": BOXED_TEMPLATE.format(problem=r["problem"])}] for r in rows[:unique]
        ]
        assert {e.data_source for e in got} == {name}
    got = load_math_dataset(tmp_path / "data" / "math-500.parquet", verbose=False)
    assert got[0].extra_info == dict(index=0, unique_id="test/precalculus/807.json", subject="Precalculus", level=2)
    # the default template: DAPO-Math-17k's `Answer:` instruction
    assert convert_upstream("aime-2025", upstream["aime-2025"][0])[1].question == PROMPT_TEMPLATE.format(
        problem=aime[1]["problem"]
    )


# ---------------------------------------------------------------- hub datasets named by a data spec (01_data)


def hub_repo(cache: Path, repo_id: str, files: dict, card: str | None = None, sha: str = SHA, ref: str | None = "main"):
    "A hub dataset as huggingface_hub's cache holds it: `files` ({path: rows}) and a card in snapshot `sha`, `ref` on it."
    import json

    import pyarrow as pa, pyarrow.parquet as pq

    repo = cache / f"datasets--{repo_id.replace('/', '--')}"
    for name, rows in files.items():
        f = repo / "snapshots" / sha / name
        f.parent.mkdir(parents=True, exist_ok=True)
        if f.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), f)
        else:
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if card is not None:
        (repo / "snapshots" / sha / "README.md").write_text(card)
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)


def qa(*pairs):
    return [{"problem": f"What is {a} + {b}?", "answer": a + b} for a, b in pairs]


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    "huggingface_hub pointed at an empty cache here, offline (HF_HUB_OFFLINE=1): nothing is fetched."
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_hub_dataset_by_config_split_and_revision(offline_hub, tmp_path):
    """`hub:owner/name[@revision]:config=...:split=...` reads the files of that config and split from the cache: without
    a card, the split the file names say (train, test); with a card's `configs`, the config's patterns; a revision (a
    tag or a commit) its own snapshot. Rows map as a local file's do (the same examples, each sourced to its file in
    the repository), and the DAPO-Math-17k schema is the default."""
    import pyarrow as pa, pyarrow.parquet as pq

    from dapo_ref.core import InputError
    from dapo_ref.data import example_from_row, example_to_row

    hub_repo(
        offline_hub,
        "me/plain",
        {"data/train-00000-of-00001.parquet": qa((1, 1), (2, 2), (1, 1)), "data/test-00000-of-00001.jsonl": qa((5, 5))},
    )
    mapping = ":prompt=problem:answer=answer"
    local = tmp_path / "train.parquet"  # the same rows in a local file
    pq.write_table(pa.Table.from_pylist(qa((1, 1), (2, 2), (1, 1))), local)
    got = load_math_dataset(f"hub:me/plain:split=train{mapping}", verbose=False)
    twin = load_math_dataset(f"{local}{mapping}", verbose=False)
    assert [(e.prompt, e.ground_truth, e.extra_info) for e in got] == [
        (e.prompt, e.ground_truth, e.extra_info) for e in twin
    ]  # the same rows, deduplicated alike
    assert {e.data_source for e in got} == {"plain"}  # no data_source column: the dataset's name
    assert [e.source for e in got] == [
        "row 0 of me/plain/data/train-00000-of-00001.parquet",
        "row 1 of me/plain/data/train-00000-of-00001.parquet",
    ]
    assert [e.ground_truth for e in load_math_dataset(f"hub:me/plain:split=test{mapping}", verbose=False)] == ["10"]
    with pytest.raises(InputError, match=r"^hub:me/plain has several splits \(test, train\); name one with :split="):
        load_math_dataset(f"hub:me/plain{mapping}")
    with pytest.raises(InputError, match=r"hub:me/plain has no split validation \(its splits: test, train\)"):
        load_math_dataset(f"hub:me/plain:split=validation{mapping}")
    # a card with configs: the default one unless another is named, its files of the split
    card = (
        "---\nconfigs:\n- config_name: main\n  default: true\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n- config_name: hard\n  data_files: hard/*.parquet\n---\n# Sums\n"
    )
    files = {"main/train-0.parquet": qa((3, 3)), "main/test-0.parquet": qa((4, 4)), "hard/all.parquet": qa((50, 50))}
    hub_repo(offline_hub, "me/card", files, card)
    answers = lambda spec: [e.ground_truth for e in load_math_dataset(spec + mapping, verbose=False)]
    assert answers("hub:me/card:split=test") == ["8"]
    assert answers("hub:me/card:config=hard") == ["100"]  # its only split
    with pytest.raises(InputError, match=r"hub:me/card has no config easy \(its configs: main, hard\)"):
        answers("hub:me/card:config=easy")
    # revisions: a tag, and a commit that no ref names
    v1, c2 = "1" * 40, "2" * 40
    hub_repo(offline_hub, "me/plain", {"data/train.parquet": qa((7, 7))}, sha=v1, ref="v1")
    hub_repo(offline_hub, "me/plain", {"data/train.parquet": qa((8, 8))}, sha=c2, ref=None)
    assert answers("hub:me/plain@v1") == ["14"]
    assert answers(f"hub:me/plain@{c2}") == ["16"]
    # the DAPO-Math-17k schema, no mapping: as the published repository holds it
    dapo = [problem(i) for i in (0, 1, 0)]
    fake_dataset(offline_hub, "dapo-math-17k", dapo)
    got = load_math_dataset("hub:BytedTsinghua-SIA/DAPO-Math-17k", verbose=False)
    assert got == [example_from_row(example_to_row(e)) for e in dapo[:2]]


def test_hub_dataset_not_in_the_cache_fails_in_one_line_before_the_model_loads(offline_hub, tmp_path, monkeypatch):
    """Offline, `train_data: hub:...` that the cache does not hold stops the run in one line naming the dataset and both
    fixes (unset HF_HUB_OFFLINE, or a local file), before a tokenizer or weights are loaded (`dapo-train` prints the
    line as `dapo-train: error: ...`, exit status 2, as for every InputError)."""
    from dapo_ref import trainer
    from dapo_ref.core import DAPOConfig, InputError

    def load_tokenizer(name):
        raise AssertionError("the model was loaded before the data was read")

    monkeypatch.setattr(trainer, "load_tokenizer", load_tokenizer)
    cfg = DAPOConfig(
        output_dir=str(tmp_path / "run"), train_data="hub:BytedTsinghua-SIA/DAPO-Math-17k@main:split=train"
    )
    with pytest.raises(InputError) as e:
        trainer.Trainer(cfg, log=None)
    assert str(e.value) == (
        "cannot read hub:BytedTsinghua-SIA/DAPO-Math-17k@main (HF_HUB_OFFLINE is set and it is not in the local "
        "cache); unset HF_HUB_OFFLINE to download it, or give a local .parquet or .jsonl file"
    )
