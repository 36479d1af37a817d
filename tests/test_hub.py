"""The hub at both ends of a run (nbs/08g_hub.ipynb): the base model pinned to a commit, recorded and read again on
`--resume`; the trained policy pushed (TRL's `push_to_hub`, `hub_model_id`, `hub_private_repo`, `hub_strategy`) to a
hub on 127.0.0.1 (`fake_hub.FakeHub`: the requests huggingface_hub's upload makes, answered as the hub answers them),
and refused before the model loads when it cannot happen. Each run is the tiny recipe for one or two steps: the
properties (what is uploaded, when it is refused, which commit loads) do not depend on the model's size."""

import json, shutil, socket
from pathlib import Path

import pytest
import yaml

from dapo_ref.runs import read_metrics
from dapo_ref.train import main
from dapo_ref.tiny_ship import ensure_tiny_model
from fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "--config=" + str(ROOT / "recipes" / "tiny-cpu.yaml")
# a step of 2 groups from rounds of 4 prompts (the default step is 16 of 32): what a hub test reads is files, not learning
SMALL = ["prompts_per_step=2", "gen_batch_size=4", "mini_batch_size=16"]
SHORT = ["eval_every=1", "save_every=1", "eval_k=1", "samples_per_step=0", *SMALL]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def online(monkeypatch, tmp_path):
    "huggingface_hub online (the suite runs with HF_HUB_OFFLINE=1), no saved token; the endpoint set by each test."
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token saved by `hf auth login` on this machine
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return constants


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_to_hub_uploads_each_export_then_final_with_its_model_card(online, monkeypatch, tmp_path, capsys):
    """hub_strategy every_save: step 1's export, then final/, each one commit to the repo (made private, as asked);
    the last commit holds final/ byte for byte, its README.md the model card: the hub's metadata, the held-out curve
    of metrics.jsonl (every evaluation, its number as logged) and the run's config.yaml, whole."""
    out = tmp_path / "run"
    with FakeHub(token="hf_test") as hub:
        monkeypatch.setattr(online, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        args = [RECIPE, *SHORT, "total_steps=2", f"output_dir={out}", "push_to_hub=true", "hub_model_id=lab/dapo-tiny"]
        rc = main([*args, "hub_private_repo=true", "export_every=1", "hub_strategy=every_save"])
        said = capsys.readouterr()
        assert rc == 0, said.err
    repo = hub.repos["lab/dapo-tiny"]
    assert repo["private"] is True
    assert [c["message"] for c in repo["commits"]] == ["dapo_ref: step 1", "dapo_ref: final/, step 2"]
    assert repo["commits"][0]["files"] == files_of(out / "exports" / "step-1")
    final = repo["commits"][-1]["files"]
    assert final == files_of(out / "final") and "model.safetensors" in final and "README.md" in final
    card = final["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # tiny: no hub base to link
    config = yaml.safe_load(card.split("```yaml")[1].split("```")[0])
    assert config == yaml.safe_load((out / "config.yaml").read_text())  # the run's config, whole
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_acc" in r]
    assert len(evals) == 3  # steps 0, 1, 2
    for r in evals:
        assert f"| {r['step']} | {r['grad_updates']} | {r['eval_acc']:.4f} |" in card
    assert f"-> {hub.url}/lab/dapo-tiny/commit/" in said.out  # the commit's URL, said


@pytest.mark.parametrize("case", ["offline", "unreachable", "no-token", "read-only"])
def test_push_that_cannot_happen_is_refused_before_the_model_loads(online, monkeypatch, tmp_path, capsys, case):
    "One line naming push_to_hub and the way out, exit 2, and no model, tokenizer or data read."
    import dapo_ref.trainer as trainer

    loaded = []
    monkeypatch.setattr(trainer, "load_splits", lambda cfg: loaded.append(cfg) or ([], []))
    out = tmp_path / "run"
    args = [RECIPE, *SHORT, f"output_dir={out}", "push_to_hub=true"]
    with FakeHub(token="hf_test", role="read" if case == "read-only" else "write") as hub:
        monkeypatch.setattr(online, "ENDPOINT", hub.url)
        if case == "offline":
            monkeypatch.setattr(online, "HF_HUB_OFFLINE", True)
        if case == "unreachable":
            with socket.socket() as s:  # a port nothing listens on
                s.bind(("127.0.0.1", 0))
                monkeypatch.setattr(online, "ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        if case != "no-token":
            monkeypatch.setenv("HF_TOKEN", "hf_test")
        rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and loaded == [], err
    assert err.count("\n") == 0 and "push_to_hub = true" in err and "push_to_hub: false" in err, err
    want = {"offline": "HF_HUB_OFFLINE=1", "unreachable": "cannot be used", "no-token": "log in", "read-only": "read"}
    assert want[case] in err, err
    assert not (out / "checkpoints").exists() and hub.repos == {}


def test_a_push_that_fails_after_training_keeps_final_and_exits_1_with_the_command(
    online, monkeypatch, tmp_path, capsys
):
    "The hub refuses the repo (403): the run's files stay, the summary is printed, the last line says how to upload."
    out = tmp_path / "run"
    with FakeHub(token="hf_test") as hub:
        monkeypatch.setattr(online, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        rc = main([RECIPE, *SHORT, "total_steps=1", f"output_dir={out}", "push_to_hub=true", "hub_model_id=x/y/z"])
    said = capsys.readouterr()
    assert rc == 2 and "hub_model_id" in said.err  # a malformed repo id: refused by the config check
    with FakeHub(token="hf_test") as hub:
        monkeypatch.setattr(online, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        hub.forbidden = True  # the token may not create repos under lab/: 403, and the repo does not exist (404)
        rc = main([RECIPE, *SHORT, "total_steps=1", f"output_dir={out}", "push_to_hub=true", "hub_model_id=lab/y"])
    said = capsys.readouterr()
    assert rc == 1, said.err
    last = said.err.strip().splitlines()[-1]
    assert last.startswith("dapo-train: error: push_to_hub: uploading") and f"hf upload lab/y {out / 'final'} ." in last
    assert "held-out accuracy" in said.out  # the summary line: the run itself succeeded
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "README.md").is_file()
    assert json.loads((out / "summary.json").read_text())["hub_error"] == last.removeprefix("dapo-train: error: ")


def hub_snapshot(cache: Path, name: str, commit: str, src: Path, ref: str = "main") -> Path:
    "The folder `src` as commit `commit` of hub model `name` in the HF cache `cache`, `ref` pointing at it."
    snap = cache / f"models--{name.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(src, snap)
    (snap.parents[1] / "refs").mkdir(exist_ok=True)
    (snap.parents[1] / "refs" / ref).write_text(commit)
    return snap


def test_model_revision_pinned_recorded_and_read_again_on_resume(monkeypatch, tmp_path, capsys):
    """A hub name is read at one commit and config.yaml records that commit; after main moves to another commit, the
    resume reads the recorded one (otherwise the experiment check refuses it: another base model); a new run reads the
    new main; a commit named on the resume that is not the run's is refused naming model_revision; a revision on a
    local folder is refused. Offline, from a cache made here: nothing is fetched."""
    from huggingface_hub import constants

    import dapo_ref.policy as policy

    cache, a, b = tmp_path / "hub", "a" * 40, "b" * 40
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(policy, "STAGED", {})
    monkeypatch.setattr("dapo_ref.trainer.STAGED", policy.STAGED)
    tiny = ensure_tiny_model()
    hub_snapshot(cache, "me/tiny", a, tiny)
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    base = [RECIPE, "model=me/tiny", "eval_every=0", "save_every=1", "eval_k=1", "samples_per_step=0", *SMALL]
    assert main([*base, "total_steps=1", f"output_dir={run}"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((run / "config.yaml").read_text())["model_revision"] == a
    hub_snapshot(
        cache, "me/tiny", b, tiny
    )  # the owner pushes a new commit: main is b now (which loads: the folder's name)
    capsys.readouterr()
    assert main([*base, "total_steps=2", f"output_dir={run}", "--resume"]) == 0, capsys.readouterr().err
    assert f"model me/tiny at commit {a}" in capsys.readouterr().out
    assert Path(policy.STAGED["me/tiny"]).name == a
    assert yaml.safe_load((run / "config.yaml").read_text())["model_revision"] == a
    assert main([*base, "total_steps=0", f"output_dir={fresh}"]) == 0
    assert yaml.safe_load((fresh / "config.yaml").read_text())["model_revision"] == b
    capsys.readouterr()
    assert main([*base, "total_steps=3", f"output_dir={run}", f"model_revision={b}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model_revision" in err and a in err and b in err, err
    assert main([RECIPE, f"model={tiny}", "model_revision=main", f"output_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "model_revision = main" in err and "local folder" in err, err
    # a run from before the commit was recorded (config.yaml and the checkpoint's experiment without it) resumes,
    # and records the commit it reads from now on
    import json

    cfg = yaml.safe_load((fresh / "config.yaml").read_text())
    del cfg["model_revision"]
    (fresh / "config.yaml").write_text(yaml.safe_dump(cfg))
    for st in (fresh / "checkpoints").glob("step-*/state.json"):
        s = json.loads(st.read_text())
        del s["experiment"]["model_revision"]
        st.write_text(json.dumps(s))
    assert main([*base, "total_steps=1", f"output_dir={fresh}", "--resume"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((fresh / "config.yaml").read_text())["model_revision"] == b
