"""The notebook output check (`.ci/nbcheck.py`, run by `make nbtest` on every notebook): a copy of nbs/03_advantage.ipynb
passes as saved, and fails when a saved output is deleted or a printed number is changed by hand."""

import json, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / ".ci"))
from nbcheck import same  # noqa: E402

NB = ROOT / "nbs" / "03_advantage.ipynb"
CELL = 8  # `adv`: tensor([ 1.5000, -0.5000, ...]) of the worked example


def check(nb: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "nbcheck.py"), str(nb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture()
def copy(tmp_path):
    d = json.loads(NB.read_text())
    assert "tensor([ 1.5000, -0.5000" in "".join(d["cells"][CELL]["outputs"][0]["data"]["text/plain"])
    return tmp_path / NB.name, d


def test_saved_outputs_pass(copy):
    path, d = copy
    path.write_text(json.dumps(d))
    p = check(path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]


def test_a_deleted_output_fails(copy):
    path, d = copy
    d["cells"][CELL]["outputs"] = []
    path.write_text(json.dumps(d))
    p = check(path)
    assert p.returncode == 1 and f"cell {CELL} shows output and none is saved" in p.stdout, p.stdout


def test_a_number_changed_by_hand_fails(copy):
    path, d = copy
    out = d["cells"][CELL]["outputs"][0]["data"]
    out["text/plain"] = ["".join(out["text/plain"]).replace("1.5000", "1.5001", 1)]
    path.write_text(json.dumps(d))
    p = check(path)
    assert p.returncode == 1 and f"cell {CELL} shows other output than is saved" in p.stdout and "1.5001" in p.stdout, (
        p.stdout
    )


def test_number_rule():
    "Up to 6 significant digits: equal; more (a float's full repr): within 1e-6 relative; words and layout: equal."
    assert same("loss -0.2659020507708192", "loss -0.2659020507708199")
    assert not same("loss -0.2659020507708192", "loss -0.2659030507708192")
    assert not same("acc 0.484", "acc 0.485") and not same("12 steps", "13 steps") and not same("a 1", "b 1")
