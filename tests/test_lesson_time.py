"""`.ci/lesson_time.py`, the lesson path's size guard: prose words / 200 + non-blank code lines / 20 (figures are not
counted, and the result is not a reading time: the index states what a reader measured). Counted on a hand-made
notebook, then the refusal `make lint` relies on."""

import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))
import lesson_time  # noqa: E402


def test_count_by_hand(tmp_path):
    nb = tmp_path / "x.ipynb"
    cells = [
        dict(cell_type="markdown", metadata={}, source=["one two three\n", "four five"]),  # 5 words
        dict(cell_type="code", metadata={}, outputs=[], source=["a = 1\n", "   \n", "b = 2"]),  # 2 lines
        dict(
            cell_type="code",
            metadata={},
            source=["plot()"],  # 1 line; its figure counts nothing
            outputs=[
                dict(output_type="display_data", data={"image/png": "iVBO", "text/plain": "<Figure>"}, metadata={})
            ],
        ),
    ]
    off = [  # hidden, or in an Engineering section: not on the path; 1 + 3 words, 2 + 1 lines
        dict(cell_type="code", metadata={}, outputs=[], source=["#| hide\n", "test(1)"]),
        dict(cell_type="markdown", metadata={}, source=["## Engineering: plumbing"]),
        dict(cell_type="code", metadata={}, outputs=[], source=["x = 2"]),
    ]
    back = [  # a heading of the same level ends the Engineering section: 2 words
        dict(cell_type="markdown", metadata={}, source=["## Mechanism"]),
        dict(cell_type="code", metadata={}, outputs=[], source=["#|  hide\n", "y = 3"]),  # hidden: 2 lines off
        dict(cell_type="code", metadata={}, outputs=[], source=["#| echo: false\n", "plot()"]),  # drawn: 2 lines off
    ]
    nb.write_text(json.dumps(dict(cells=cells + off + back, metadata={}, nbformat=4, nbformat_minor=5)))
    r = lesson_time.count(nb)
    assert (r["words"], r["code"]) == (5 + 2, 3) and "figures" not in r
    assert abs(r["size"] - (7 / 200 + 3 / 20)) < 1e-12
    assert abs(r["off"] - (3 / 200 + 7 / 20)) < 1e-12


def test_the_path_is_the_index_table():
    path = lesson_time.lesson_path()
    assert path[0] == "02_reward" and "14_ablation" in path and "09_trainer" not in path
    assert all((ROOT / "nbs" / f"{n}.ipynb").exists() for n in path)


def test_refusal():
    run = lambda *a: subprocess.run(
        [sys.executable, ".ci/lesson_time.py", *a], cwd=ROOT, capture_output=True, text=True
    )
    total = sum(lesson_time.count(ROOT / "nbs" / f"{n}.ipynb")["size"] for n in lesson_time.lesson_path())
    over = run("--max", f"{total - 1:.1f}")
    assert over.returncode == 1 and "over the" in over.stderr
    assert run("--max", f"{total + 1:.1f}").returncode == 0


def test_hidden_cells_collapse(tmp_path):
    nb = tmp_path / "x.ipynb"
    cells = [
        dict(cell_type="code", metadata={}, outputs=[], source=["#| hide\n", "test(1)"]),
        dict(cell_type="code", metadata={}, outputs=[], source=["shown(1)"]),
        dict(cell_type="code", metadata={}, outputs=[], source=["#| echo: false\n", "plot()"]),
    ]
    nb.write_text(json.dumps(dict(cells=cells, metadata={}, nbformat=4, nbformat_minor=5)))
    assert lesson_time.uncollapsed(nb) == 2
    assert lesson_time.uncollapsed(nb, fix=True) == 2 and lesson_time.uncollapsed(nb) == 0
    got = [c["metadata"] for c in json.loads(nb.read_text())["cells"]]
    assert got == [{"jupyter": {"source_hidden": True}}, {}, {"jupyter": {"source_hidden": True}}]
