"""Per-test time budgets, reported at the end of every pytest run (`conftest.py`); never a failure.

The budgets live in one table of tests/README.md ("Time budgets"): a row per test, its budget on a machine with
AVX-512 and bf16 instructions and on one with AVX2 only (where torch emulates bf16), in seconds. A test's time is the
sum of its setup, call and teardown (a module's shared launch counts in the test that runs first). Tests not in the
table share one default budget, stated in the table's last row (`*`). Machines are noisy: a run ends with the list of
tests over their budget, time and budget, and passes or fails on the tests alone."""

import re
from pathlib import Path

README = Path(__file__).with_name("README.md")
HEADING = "## Time budgets"
ROW = re.compile(r"^\|\s*`?([^|`]+?)`?\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|")


def load(text: str | None = None) -> dict:
    """{test id (file.py::name[param], or `*` for every other test): (budget AVX-512 + bf16, budget AVX2 only)}, read
    from the README's budget table. Raises ValueError when the table or its `*` row is missing."""
    text = README.read_text() if text is None else text
    if HEADING not in text:
        raise ValueError(f"{README}: no '{HEADING}' section")
    budgets = {}
    for line in text.split(HEADING, 1)[1].splitlines()[1:]:
        if line.startswith("## "):
            break
        m = ROW.match(line)
        if m:
            budgets[m[1].strip()] = (float(m[2]), float(m[3]))
    if "*" not in budgets:
        raise ValueError(f"{README}: the '{HEADING}' table has no '*' row (the budget of every test not listed)")
    return budgets


def cpu_flags(path: str = "/proc/cpuinfo") -> set:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def column(flags: set) -> int:
    "0: the AVX-512 + bf16 budget (native bf16 matmuls); 1: the AVX2-only budget (bf16 emulated, no AVX-512)."
    return 0 if {"avx512f", "avx512_bf16"} <= flags else 1


COLUMN_NAMES = ("AVX-512 + bf16", "AVX2 only")


def test_id(nodeid: str) -> str:
    "`tests/test_x.py::name[p]@group` (pytest-xdist's loadgroup suffix) -> `test_x.py::name[p]`."
    nodeid = re.sub(r"@[\w.]+$", "", nodeid)
    return nodeid.split("/", 1)[1] if nodeid.startswith("tests/") else nodeid


def budget_of(budgets: dict, tid: str, col: int) -> float:
    "The row of the test itself, else of its function (every parametrisation), else the default."
    for key in (tid, tid.split("[", 1)[0], "*"):
        if key in budgets:
            return budgets[key][col]
    raise KeyError(tid)


def over_budget(spent: dict, budgets: dict, col: int) -> list:
    "[(seconds, budget, test id)] of the tests over their budget, the largest excess first."
    over = [(t, budget_of(budgets, tid, col), tid) for tid, t in spent.items()]
    return sorted((o for o in over if o[0] > o[1]), key=lambda o: o[1] - o[0])


def report(spent: dict, budgets: dict, col: int) -> list[str]:
    "The lines a run ends with."
    over = over_budget(spent, budgets, col)
    total = sum(spent.values())
    head = (
        f"time budgets ({COLUMN_NAMES[col]} column of tests/README.md): {len(spent)} tests, "
        f"{total:.0f} test-seconds in all; "
    )
    if not over:
        return [head + "none over its budget"]
    return [head + f"{len(over)} over their budget (time > budget):"] + [
        f"  {t:7.1f} s > {b:5.1f} s  {tid}" for t, b, tid in over
    ]
