"The per-test time budgets (tests/budgets.py): the README's table read, the right column chosen, the overruns listed."

import ast
from pathlib import Path

import budgets

TESTS = Path(__file__).resolve().parent

TABLE = """# x

## Time budgets

| test | AVX-512 + bf16 (s) | AVX2 only (s) | measured (s) |
|---|---|---|---|
| `test_a.py::test_slow` | 10 | 25 | 7.1 |
| `test_a.py::test_param[3]` | 4 | 40 | 2.0 |
| `test_b.py::test_family` | 2 | 5 | 1.0 |
| `*` | 1 | 2.5 | |

## Next section

| `test_c.py::test_not_a_budget` | 1 | 1 | |
"""


def test_table_read_and_rows_matched():
    b = budgets.load(TABLE)
    assert b == {
        "test_a.py::test_slow": (10.0, 25.0),
        "test_a.py::test_param[3]": (4.0, 40.0),
        "test_b.py::test_family": (2.0, 5.0),
        "*": (1.0, 2.5),
    }  # the section's rows only
    assert budgets.budget_of(b, "test_a.py::test_param[3]", 1) == 40.0  # the parametrisation's own row
    assert budgets.budget_of(b, "test_b.py::test_family[x-1]", 0) == 2.0  # every parametrisation of the function
    assert budgets.budget_of(b, "test_a.py::test_param[2]", 0) == 1.0  # not listed: the default
    for bad in ("# no table\n", TABLE.replace("| `*` | 1 | 2.5 | |\n", "")):
        try:
            budgets.load(bad)
        except ValueError as e:
            assert "Time budgets" in str(e) or "'*' row" in str(e)
        else:
            raise AssertionError("a table without its section or default row was read")


def test_column_follows_the_cpu_flags():
    assert budgets.column({"avx2", "avx512f", "avx512_bf16"}) == 0
    assert budgets.column({"avx2", "avx512f"}) == 1  # AVX-512 without bf16: torch emulates bf16 matmuls
    assert budgets.column({"avx2"}) == 1
    assert budgets.test_id("tests/test_scale.py::test_x[3]@test_scale") == "test_scale.py::test_x[3]"
    assert budgets.test_id("tests/test_a.py::test_y") == "test_a.py::test_y"


def test_overruns_listed_largest_excess_first_and_none_said():
    b = budgets.load(TABLE)
    spent = {"test_a.py::test_slow": 12.0, "test_b.py::test_family[1]": 9.0, "test_z.py::test_quick": 0.5}
    assert budgets.over_budget(spent, b, 0) == [
        (9.0, 2.0, "test_b.py::test_family[1]"),
        (12.0, 10.0, "test_a.py::test_slow"),
    ]
    assert budgets.over_budget(spent, b, 1) == [(9.0, 5.0, "test_b.py::test_family[1]")]
    lines = budgets.report(spent, b, 1)
    assert "AVX2 only" in lines[0] and "1 over their budget" in lines[0] and "test_b.py::test_family[1]" in lines[1]
    assert budgets.report({"test_z.py::test_quick": 0.5}, b, 0)[0].endswith("none over its budget")


def test_every_budget_row_names_a_test_that_exists():
    "A renamed or deleted test leaves no stale row behind: each row's file holds a test function of that name."
    for tid in budgets.load():
        if tid == "*":
            continue
        file, name = tid.split("::")
        tree = ast.parse((TESTS / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in names, tid
