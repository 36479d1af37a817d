"""LoRA (nbs/07c_lora.ipynb): with `lora_r: 0` the learner is the full fine-tuning one, unchanged; with adapters only
they train and sit in the optimizer; the engine is sent the adapters alone and applies them as the learner does (the
merged bf16 weights would lose most of an early update); a run resumes exactly from its adapters; `final/` holds the
merged transformers model and PEFT's adapter folder."""

import copy, json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_ref.algorithm import train_on
from dapo_ref.checkpoints import checkpoint_problem, export_checkpoint
from dapo_ref.cli import load_config
from dapo_ref.core import DAPOConfig
from dapo_ref.interfaces import RolloutBatch
from dapo_ref.learner import TorchLearner
from dapo_ref.policy import load_model, load_policy
from dapo_ref.lora import ADAPTER_DIR, base_named_weights, base_of, is_lora
from dapo_ref.rollout import HFRolloutEngine
from dapo_ref.runs import read_metrics
from dapo_ref.trainer import Trainer, strip_timing

ROOT = Path(__file__).resolve().parents[1]
EPS64 = 2.0**-52


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (conftest.py)


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny")


def batch(tok) -> RolloutBatch:
    "Four fixed responses of two groups: advantages +-1 per group, none truncated."
    p = tok("Q: 3+4=? Answer:")["input_ids"]
    resp = [tok(s)["input_ids"] for s in (" 7", " 8 then 9", " 7 so 7", " 1")]
    return RolloutBatch(
        [p] * 4, resp, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.zeros(4, dtype=torch.bool), torch.zeros(4), None
    )


def test_lora_r_0_is_the_full_fine_tuning_learner(policy):
    model = copy.deepcopy(policy[0])
    learner = TorchLearner(model, DAPOConfig(), pad_token_id=policy[1].pad_token_id)
    assert learner.model is model and not is_lora(learner.model)
    # the optimizer holds every parameter, in the model's order (what a checkpoint's AdamW state is indexed by)
    assert [id(p) for p in learner.opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    w = list(learner.named_weights())  # the model's own tensors, not copies: nothing merged
    assert [(k, v.data_ptr()) for k, v in w] == [(k, v.data_ptr()) for k, v in model.state_dict().items()]


def test_an_update_moves_only_the_adapters_and_the_engine_gets_the_adapted_policy(policy):
    from transformers import AutoModelForCausalLM

    cfg = DAPOConfig(lora_r=4, lora_alpha=8, lr=1e-2, warmup_steps=0)
    model = copy.deepcopy(policy[0]).double()  # float64: the merged model's logits against the adapted model's
    base0 = {k: v.clone() for k, v in model.state_dict().items()}
    learner = TorchLearner(model, cfg, pad_token_id=policy[1].pad_token_id)
    trained = [p for p in learner.model.parameters() if p.requires_grad]
    assert [id(p) for p in learner.opt.param_groups[0]["params"]] == [id(p) for p in trained]
    assert trained and all("lora_" in n for n, p in learner.model.named_parameters() if p.requires_grad)
    b = batch(policy[1])
    for _ in range(2):  # the second update: B != 0, so the adapters change the policy
        train_on(learner, b, 4)
    merged = dict(learner.named_weights())
    assert set(merged) == set(base0)  # the base model's names: what the engine's load_weights takes
    moved = [k for k in base0 if not torch.equal(merged[k], base0[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)  # only adapted linear weights differ
    for n, p in base_of(learner.model).named_parameters():  # the frozen base itself never moves
        if ".lora_" not in n:
            assert torch.equal(p, base0[n.replace(".base_layer.", ".")]), n
    plain = AutoModelForCausalLM.from_config(base_of(learner.model).config, dtype=torch.float64)
    plain.load_state_dict(merged)
    ids = torch.tensor([b.prompt_ids[0] + b.response_ids[1]])
    with torch.no_grad():
        a, m = learner.model(input_ids=ids).logits, plain(input_ids=ids).logits
        with learner.model.disable_adapter():
            off = learner.model(input_ids=ids).logits
    # (W0 + BA) x against W0 x + B (A x): the same sums in another order. Each logit sums ~1e3 float64 products of
    # magnitude <= its scale; their rounding is bounded by 1e3 x 2 x eps64 x scale, well below this 1e-10 x scale
    scale = float(a.abs().max())
    assert float((a - m).abs().max()) <= 1e-10 * scale
    assert float((a - off).abs().max()) > 1e-6 * scale  # and the adapters did change the policy
    engine_model = learner.policy_copy()  # the transformers engine's own copy: a PEFT model, the learner's tensors
    own = learner.model.state_dict()
    assert is_lora(engine_model) and engine_model.state_dict().keys() == own.keys()
    assert all(torch.equal(v, own[k]) for k, v in engine_model.state_dict().items())


def test_sync_weights_are_the_adapters_under_lora_and_the_weights_otherwise(policy):
    pad = policy[1].pad_token_id
    full = TorchLearner(copy.deepcopy(policy[0]), DAPOConfig(), pad_token_id=pad)
    sent = [(k, v.data_ptr()) for k, v in full.sync_weights()]
    assert sent == [(k, v.data_ptr()) for k, v in full.named_weights()] and len(sent) == len(full.model.state_dict())
    lora = TorchLearner(copy.deepcopy(policy[0]), DAPOConfig(lora_r=4), pad_token_id=pad)
    sent = dict(lora.sync_weights())
    trained = {n: p for n, p in lora.model.named_parameters() if p.requires_grad}
    # the adapters themselves (no copies), each lora_A and lora_B, under the PEFT model's state_dict names; nothing else
    assert set(sent) == set(trained) and set(sent) <= set(lora.model.state_dict())
    assert all(sent[n].data_ptr() == trained[n].data_ptr() for n in trained)
    assert all(".lora_A." in n or ".lora_B." in n for n in sent) and len(sent) % 2 == 0


def test_the_transformers_engine_applies_the_adapters_where_the_merge_loses_the_update(policy):
    """The 7B recipe's adapters (r 64, alpha 128) after 10 AdamW updates at its lr 1e-5, on the tiny policy loaded in
    bf16 as a run loads it. The transformers engine (`policy_copy`, then `load_weights(sync_weights())` after the
    updates) is a PEFT model holding the learner's tensors: its log-probs are the learner's bit for bit (the same
    modules, dtypes, tensors and inputs: the same arithmetic in the same order; a tolerance of 0). The merged weights
    (`named_weights`: W0 + (alpha / r) B A rounded to bf16, what the engine loaded before) lose most of the update:
    most of its entries round away (below half of bf16's step at W0), and, evaluated in float64 so that no compute
    rounding hides it, their policy misses more than a quarter of how far the updates moved the log-probs (in norm),
    where the engine's copy misses nothing."""
    from transformers import AutoModelForCausalLM

    tok, pad = policy[1], policy[1].pad_token_id
    cfg = DAPOConfig(lora_r=64, lora_alpha=128, lr=1e-5, warmup_steps=0, dtype="bfloat16")
    learner = TorchLearner(load_model("tiny", "bfloat16"), cfg, pad_token_id=pad)
    engine = HFRolloutEngine(learner.policy_copy(), eos_token_id=tok.eos_token_id, pad_token_id=pad)  # B = 0 here
    b = batch(tok)
    for _ in range(10):
        train_on(learner, b, len(b))
    engine.load_weights(learner.sync_weights())
    seqs = [torch.tensor([p + r]) for p, r in zip(b.prompt_ids, b.response_ids)]

    @torch.no_grad()
    def logps(model):
        "Log-probs of every next token of the four sequences, float32 log-softmax of the model's logits."
        lp = [torch.log_softmax(model(input_ids=s).logits[0, :-1].float(), -1) for s in seqs]
        return torch.cat([x.gather(-1, s[0, 1:, None])[:, 0] for x, s in zip(lp, seqs)])

    assert torch.equal(logps(engine.model), logps(learner.model))  # bf16, as both run: the same numbers
    # the merged path: a plain model with `named_weights`, as the engine's copy was built before
    plain = AutoModelForCausalLM.from_config(base_of(learner.model).config, dtype=torch.bfloat16)
    plain.load_state_dict(dict(learner.named_weights()))
    w0, merged = dict(base_named_weights(learner.model)), dict(learner.named_weights())
    adapted = [k for k in merged if k.endswith("proj.weight")]
    vanished = sum(int((merged[k] == w0[k]).sum()) for k in adapted) / sum(merged[k].numel() for k in adapted)
    assert vanished > 0.5, vanished
    exact = copy.deepcopy(learner.model).double()  # the learner's policy in float64: its W0, its adapters
    target = logps(exact)
    with exact.disable_adapter():
        moved = float((target - logps(exact)).norm())  # how far the 10 updates moved these log-probs
    assert moved > 0  # the adapters did move the policy
    assert torch.equal(logps(copy.deepcopy(engine.model).double()), target)  # the engine's copy: the same policy
    assert float((logps(plain.double()) - target).norm()) > 0.25 * moved  # the merge's: a quarter of the move lost


@pytest.mark.slow
def test_lora_run_resumes_exactly_from_its_adapters_and_exports_both_forms(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = dict(
        lora_r=8, total_steps=4, save_every=2, eval_every=0, eval_k=1, prompts_per_step=4, group_size=4,
        gen_batch_size=8, mini_batch_size=8, lr=1e-3,
    )  # fmt: skip
    recipe = ROOT / "recipes" / "tiny-cpu.yaml"
    runs = {}
    for name, steps in (("ref", 4), ("resumed", 2)):
        t = Trainer(load_config(recipe, {**common, "total_steps": steps, "output_dir": str(tmp_path / name)}))
        t.fit(), t.close()
    assert checkpoint_problem(tmp_path / "resumed" / "checkpoints" / "step-2") is None
    t = Trainer(load_config(recipe, {**common, "output_dir": str(tmp_path / "resumed")}))
    t.fit(resume=True), t.close()
    for name in ("ref", "resumed"):
        runs[name] = [strip_timing(r) for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    # bit-identical rows; the first run of "resumed" also evaluated at its end, step 2 (ref did not: eval_every 0)
    no_eval = [{k: v for k, v in r.items() if not k.startswith("eval")} for r in runs["resumed"]]
    assert len(runs["ref"]) == 5 and runs["ref"][:2] + runs["ref"][3:] == runs["resumed"][:2] + runs["resumed"][3:]
    assert runs["ref"][2] == no_eval[2] and runs["ref"][-1]["eval/avg@1"] == runs["resumed"][-1]["eval/avg@1"]
    fa, fb = (load_file(tmp_path / n / "final" / ADAPTER_DIR / "adapter_model.safetensors") for n in ("ref", "resumed"))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    final = tmp_path / "ref" / "final"
    assert json.loads((final / ADAPTER_DIR / "adapter_config.json").read_text())["r"] == 8
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)  # a plain transformers folder
    adapted = PeftModel.from_pretrained(load_policy("tiny")[0], final / ADAPTER_DIR)  # PEFT's own loader
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    # float32, the same sums in another order: ~1e3 products per logit, rounding <= 1e3 x 2 x 2**-24 x scale = 1.2e-4 x
    # scale in the worst case; the adapters' own effect (checked above in float64) is not what this bounds
    assert float((a - m).abs().max()) <= 1.2e-4 * float(a.abs().max())
    # dapo-export of a LoRA checkpoint: the merged model it holds
    out = export_checkpoint(tmp_path / "ref" / "checkpoints" / "step-4", tmp_path / "exported")
    e, f = load_file(out / "model.safetensors"), load_file(final / "model.safetensors")
    assert e.keys() == f.keys() and all(torch.equal(e[k], f[k]) for k in e)
    ea = load_file(out / ADAPTER_DIR / "adapter_model.safetensors")  # and the adapters, in PEFT's format
    assert ea.keys() == fa.keys() and all(torch.equal(ea[k], fa[k]) for k in ea)
    # a LoRA checkpoint without its adapters cannot resume: named, before anything loads
    (tmp_path / "resumed" / "checkpoints" / "step-4" / ADAPTER_DIR / "adapter_model.safetensors").unlink()
    assert checkpoint_problem(tmp_path / "resumed" / "checkpoints" / "step-4") == (
        "adapter/adapter_model.safetensors is missing"
    )


@pytest.mark.slow
def test_zero2_lora_trains_the_adapters_alone_and_resumes_from_its_checkpoint(tmp_path, policy):
    """DeepSpeed ZeRO-2 on one rank with adapters: ZeRO's fp32 partition holds the adapters and nothing of the base;
    an update moves only adapted weights; the checkpoint (the adapters' partitions and adapter/, no base) loads into a
    fresh learner with the same weights, and dapo-export merges the base with the adapters' fp32 master."""
    pytest.importorskip("deepspeed")
    from dapo_ref.scale import DeepSpeedLearner

    recipe = ROOT / "recipes" / "tiny-cpu.yaml"
    cfg = load_config(recipe, dict(zero_stage=2, lora_r=4, lora_alpha=8, lr=1e-2, warmup_steps=0))
    learner = DeepSpeedLearner(copy.deepcopy(policy[0]), cfg, policy[1].pad_token_id)
    trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    assert is_lora(learner.model) and trained == sum(p.numel() for p in learner.guard_weights())  # ZeRO: adapters only
    base0 = dict(copy.deepcopy(policy[0]).state_dict())
    b = batch(policy[1])
    for _ in range(2):
        train_on(learner, b, 4)
    merged = dict(learner.named_weights())
    assert set(merged) == set(base0)
    moved = [k for k in base0 if not torch.equal(merged[k], base0[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)
    sent = dict(learner.sync_weights())  # what the engine gets: the ZeRO-2 module's own adapters, trained, alone
    assert set(sent) == {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert any(float(v.abs().max()) > 0 for n, v in sent.items() if ".lora_B." in n)  # B moved from its 0
    learner.save(tmp_path / "ck")
    assert (tmp_path / "ck" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    saved = sum(f.stat().st_size for f in (tmp_path / "ck" / "deepspeed").rglob("*model_states.pt"))
    assert saved < 4 * sum(v.numel() for v in base0.values())  # the frozen base is not in DeepSpeed's files
    again = DeepSpeedLearner(copy.deepcopy(policy[0]), cfg, policy[1].pad_token_id)
    again.load(tmp_path / "ck")
    back = dict(again.named_weights())
    assert all(torch.equal(back[k], merged[k]) for k in merged)
    assert all(torch.equal(a, b) for a, b in zip(again.guard_weights(), learner.guard_weights()))  # the fp32 master
    # what write_checkpoint adds around learner.save, so that dapo-export takes the folder for a checkpoint
    exp = dict(
        model="tiny", lora_r=4, lora_alpha=8.0, lora_target_modules="all-linear", lora_dropout=0.0
    )  # the FROZEN part
    state = dict(step=1, data_pos=0, grad_updates=2, metrics=[], experiment=exp)
    (tmp_path / "ck" / "state.json").write_text(json.dumps(state))
    torch.save({}, tmp_path / "ck" / "rng-rank0.pt")
    policy[1].save_pretrained(tmp_path / "ck")
    out = export_checkpoint(tmp_path / "ck", tmp_path / "exported")
    e = load_file(out / "model.safetensors")
    assert all(torch.equal(e[k], merged[k].to(e[k].dtype)) for k in e)
