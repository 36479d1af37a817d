"""dapo_ref.zero on this CPU machine, in one process.

- the Karmarkar-Karp partition (hypothesis), hub / local resolution, the error messages, the plain path, export
  overwrite; the one-GPU check's refusal without vLLM (`benchmarks/gpu_check.py`; its CPU run: test_vllm.py).
- the ~57M-parameter Qwen2 (`qwen2_57m`) and the local hub cache (`fake_hub`) that tests/test_scale.py's `build` launch
  uses. That launch (two processes, ZeRO-3 on gloo) makes every two-process check of this module: after construction
  every parameter is a placeholder holding half its elements on each rank, the gathered weights equal the
  checkpoint's, each rank's construction peak stays below its partition + 2 modules + a fixed allowance; the
  streamed export's peak, its shards (model / 8 bytes each) and that it loads back equal to the learner. This module
  had its own two-process launch of the same model for these checks; it was merged into test_scale's to launch once.
"""

import os, random, subprocess, sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dapo_ref.sharded_learner import balance_by_tokens
from dapo_ref.zero import (
    checkpoint_folder,
    from_pretrained_zero3,
    load_checkpoint_streamed,
    read_safetensors_header,
    save_pretrained_streamed,
)

ROOT = Path(__file__).resolve().parents[1]
HUB_NAME = "dapo-ref/zero-test-57m"


def qwen2_57m():
    """A Qwen2 of 57.4M parameters. Its largest module (the 4096 x 512 embedding, 3.7% of the model) is a share
    close to Qwen2.5-32B's (152064 x 5120, 2.4%): a rank's peak is its partition plus about two such modules."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=14,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def fake_hub(cache: Path, name: str, model, **save_kwargs) -> Path:
    "Save `model` as the `main` snapshot of hub repo `name` in an HF cache folder (the layout huggingface_hub reads offline)."
    repo = cache / f"models--{name.replace('/', '--')}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / sha
    model.save_pretrained(snap, **save_kwargs)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    return snap


# --- one process ---


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 20000), max_size=80), k=st.integers(1, 9), equal=st.booleans())
def test_balance_by_tokens(lengths, k, equal):
    if equal:
        lengths = lengths[: len(lengths) - len(lengths) % k]
    parts = balance_by_tokens(lengths, k, equal_size=equal)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # every response exactly once
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths, default=0)
    if equal:
        assert {len(p) for p in parts} == {len(lengths) // k}
    assert balance_by_tokens(list(lengths), k, equal_size=equal) == parts  # deterministic: every rank agrees


def test_balance_beats_generator_placement():
    "All of a mini-batch's groups generated on rank 0 (the acceptance case): balanced, loads differ by < one response."
    rng = random.Random(1)
    lengths = [rng.randint(1, 3000) for _ in range(32 * 4)]
    parts = balance_by_tokens(lengths, 8)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths) and min(loads) > 0


def test_balance_errors():
    with pytest.raises(ValueError, match="divide by k"):
        balance_by_tokens([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="at least one rank"):
        balance_by_tokens([1], 0)
    assert balance_by_tokens([], 3) == [[], [], []]


def _small(tie=True, layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        )
    ).eval()


def test_checkpoint_folder_local_and_hub(tmp_path):
    m = _small()
    snap = fake_hub(tmp_path / "hub", "org/small", m)
    folder, wm = checkpoint_folder("org/small", cache_dir=tmp_path / "hub", local_files_only=True)
    assert folder == snap and set(wm) == set(read_safetensors_header(snap / "model.safetensors")[0])
    assert "lm_head.weight" not in wm  # tied: saved once
    assert checkpoint_folder(snap)[0] == snap
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        checkpoint_folder(tmp_path / "empty")


def test_load_checks_names_and_shapes(tmp_path):
    _small().save_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match="not in the checkpoint"):  # 3 layers into a 2-layer checkpoint
        load_checkpoint_streamed(_small(layers=3), *checkpoint_folder(tmp_path / "a"))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    wide = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    with pytest.raises(ValueError, match="has shape"):
        load_checkpoint_streamed(wide, *checkpoint_folder(tmp_path / "a"))


def test_plain_path_and_dtype_check(tmp_path):
    m = _small(tie=False)
    m.save_pretrained(tmp_path / "m")
    plain = from_pretrained_zero3(tmp_path / "m", {"zero_optimization": {"stage": 2}})  # not ZeRO-3: from_pretrained
    assert not hasattr(plain, "hf_ds_config")
    for k, v in m.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v)
    with pytest.raises(ValueError, match="dtype torch.float32 but"):  # checked before any process group is needed
        from_pretrained_zero3(tmp_path / "m", {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})


def test_export_overwrite(tmp_path):
    m = _small(tie=False)
    save_pretrained_streamed(m, tmp_path / "x", shard_bytes=20_000)
    assert len(list((tmp_path / "x").glob("*.safetensors"))) > 1
    with pytest.raises(FileExistsError, match="not empty"):
        save_pretrained_streamed(m, tmp_path / "x")
    save_pretrained_streamed(m, tmp_path / "x", overwrite=True)  # one shard now: no stale shards or index left
    assert sorted(p.name for p in (tmp_path / "x").glob("model*")) == ["model.safetensors"]
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "x", dtype=torch.float32)
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


# --- the one-GPU check (benchmarks/gpu_check.py): where vLLM is missing it refuses in one line, before any work ---


def test_gpu_check_refuses_without_vllm(tmp_path):
    "The main venv has DeepSpeed and no vLLM: exit status 2, one line naming vllm and the fix; the CPU run is in test_vllm.py."
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here (tests/test_vllm.py runs the check)")
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu", "--out", str(tmp_path / "gc")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "vllm is not installed" in p.stderr, p.stderr
    assert not (tmp_path / "gc").exists()  # nothing was built


def without_modules(folder, *modules: str) -> dict:
    "An environment whose Python finds none of `modules` (find_spec None, import fails), as on a machine without them."
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({list(modules)!r}))\n")
    return {**os.environ, "PYTHONPATH": str(folder)}


def test_gpu_check_without_vllm_cpu(tmp_path):
    """`--without-vllm` (asked for by name) on a machine with PyTorch and transformers alone (pytest and DeepSpeed not
    importable: a clean `pip install -e .` has neither): every phase that needs neither runs, with the plain PyTorch
    learner and the HF engine: the build, one DAPO step, the learner's packed log-probs against a plain forward of the
    engine's copy of the weights, the fused check, the LoRA phase (PEFT is installed); the ZeRO-3 learner and the vLLM
    phases are listed as skipped, and the exit status is 0. Float32 on both sides: the gap is kernel rounding (< 1e-3, SYNC_TOL's bound)."""
    import json

    out = tmp_path / "gc"
    env = without_modules(tmp_path / "site", "pytest", "deepspeed")
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu", "--without-vllm", "--out", str(out)],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )  # hang guard
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((out / "gpu_check.json").read_text())
    assert [x["phase"] for x in s["phases"]] == ["build", "step", "sync", "fused", "lora"]  # lora: PEFT is installed
    assert len(s["checks"]) == 5 and all(s["checks"].values()), s["checks"]
    lora = s["phases"][4]  # the HF engine's PEFT copy serving the learner's adapters: float32 rounding against the move
    # 3 updates at the 7B recipe's lr 1e-5 (--cpu) move the batch's log-probs by ~5e-3: 10x the fp32 bound at least
    assert lora["trained"] > 0 and lora["gap_mean"] < 1e-4 and lora["moved_mean"] > 1e-3, lora
    assert s["backend"] == "hf" and s["phases"][0]["engine"] == "HFRolloutEngine"
    assert s["phases"][0]["learner"] == "TorchLearner" and not {"vllm", "deepspeed"} & set(s["versions"])
    assert any(x.startswith("the ZeRO-3 learner (DeepSpeed is not installed") for x in s["skipped"]), s["skipped"]
    assert "plain PyTorch learner + HF engine" in p.stdout, p.stdout
    sync = s["phases"][2]
    assert sync["gap_tokens"] > 0 and sync["gap_mean"] < 1e-3
    assert any("restart" in x for x in s["skipped"]) and "[skipped] free and restart" in p.stdout
