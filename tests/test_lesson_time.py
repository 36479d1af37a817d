"""`.ci/lesson_time.py`, the lesson path's reading time (issue #37's count): prose words / 200 + non-blank code lines /
20 + one minute per figure. Counted on a hand-made notebook, then the two refusals `make lint` relies on."""

import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))
import lesson_time  # noqa: E402


def test_count_by_hand(tmp_path):
    nb = tmp_path / "x.ipynb"
    cells = [
        dict(cell_type="markdown", metadata={}, source=["one two three\n", "four five"]),  # 5 words
        dict(cell_type="code", metadata={}, outputs=[], source=["#| hide\n", "\n", "a = 1\n", "   \n", "b = 2"]),  # 3
        dict(
            cell_type="code",
            metadata={},
            source=["plot()"],  # 1 line, 1 figure (a text output is not one)
            outputs=[
                dict(output_type="display_data", data={"image/png": "iVBO", "text/plain": "<Figure>"}, metadata={}),
                dict(output_type="stream", name="stdout", text="42\n"),
            ],
        ),
    ]
    nb.write_text(json.dumps(dict(cells=cells, metadata={}, nbformat=4, nbformat_minor=5)))
    r = lesson_time.count(nb)
    assert (r["words"], r["code"], r["figures"]) == (5, 4, 1)
    assert abs(r["minutes"] - (5 / 200 + 4 / 20 + 1)) < 1e-12


def test_the_path_is_the_index_table():
    path = lesson_time.lesson_path()
    assert path[0] == "02_reward" and "14_ablation" in path and "09_trainer" not in path
    assert all((ROOT / "nbs" / f"{n}.ipynb").exists() for n in path)


def test_refusals():
    run = lambda *a: subprocess.run(
        [sys.executable, ".ci/lesson_time.py", *a], cwd=ROOT, capture_output=True, text=True
    )
    total = sum(lesson_time.count(ROOT / "nbs" / f"{n}.ipynb")["minutes"] for n in lesson_time.lesson_path())
    over = run("--max", f"{total - 1:.1f}")
    assert over.returncode == 1 and "over the" in over.stderr
    assert run("--max", f"{total + 1:.1f}", "--check-index").returncode == 0  # the index states today's count
