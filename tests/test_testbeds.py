"""The testbed policies ship with the package (dapo_ref/testbeds/), as the tiny model does: a study or a test starts at
once instead of building them (about 2.5 minutes on one core for both). Each folder is named by `_testbed_hash`
(settings, builder source, the tiny model it starts from), so a changed builder can never load a stale copy."""

import json

from dapo_ref import testbeds  # (not `from ... import testbed_model`: pytest would collect that name as a test)
from dapo_ref.testbeds import TESTBED_SHIP_COMMAND, TESTBED_VERSION, TESTBEDS, _shipped_testbeds, _testbed_hash


def test_every_testbed_ships_built_from_this_source():
    "Fails after a change to how a testbed is built until `make testbeds` ships the new build (and the old one goes)."
    names = {f"{TESTBED_VERSION}-{_testbed_hash(**kw)}" for kw in TESTBEDS.values()}
    shipped = {p.name for p in _shipped_testbeds().iterdir() if p.is_dir()}
    assert shipped == names, f"shipped {sorted(shipped)} != this source's {sorted(names)}: run `{TESTBED_SHIP_COMMAND}`"
    for n in names:
        info = json.loads((_shipped_testbeds() / n / "testbed_build.json").read_text())
        assert f"{info['version']}-{info['hash']}" == n  # the build recorded the identity its folder is named by


def test_testbed_model_takes_the_shipped_copy_and_builds_nothing(tmp_path, monkeypatch):
    "No cache folder is touched: `DAPO_REF_CACHE` points at an empty folder and stays empty."
    monkeypatch.setenv("DAPO_REF_CACHE", str(tmp_path / "cache"))
    logs = []
    for kw in TESTBEDS.values():
        assert testbeds.testbed_model(log=logs.append, **kw).parent == _shipped_testbeds()
    assert logs == [] and not (tmp_path / "cache").exists()


def test_another_setting_is_built_not_taken_from_the_package(tmp_path):
    "A setting nobody shipped (a 1-step build) is built into the cache folder it is given."
    p = testbeds.testbed_model(cache_dir=tmp_path, log=None, steps=1)
    assert p.parent == tmp_path and (p / "model.safetensors").exists()
    assert p.name == f"{TESTBED_VERSION}-{_testbed_hash(steps=1)}"
