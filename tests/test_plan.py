"""dapo_ref.plan: parameter counts against transformers (meta device), model states against DeepSpeed's
own ZeRO-2/ZeRO-3 estimators, activations by hand, the advice, and the `dapo-plan` command end to end."""
import contextlib, dataclasses, io, json, re, subprocess, sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_ref.core import load_config, parse_overrides
from dapo_ref.plan import (QWEN25, ModelArch, n_params, largest_layer_params, resolve_arch, model_state_bytes,
                           activation_bytes, engine_bytes, plan_memory, advise, format_plan, main)

ROOT = Path(__file__).resolve().parents[1]
R32, R7, R1 = (ROOT / "recipes" / f for f in ("dapo-qwen2.5-32b.yaml", "dapo-qwen2.5-7b-8gpu.yaml", "dapo-qwen2.5-1.5b-1gpu.yaml"))
GiB = 2**30

def meta_model(a: ModelArch):
    cfg = Qwen2Config(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                      num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
                      intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
                      tie_word_embeddings=a.tie_word_embeddings)
    with torch.device("meta"): return Qwen2ForCausalLM(cfg)

def meta_counts(a: ModelArch):
    "Independent count: transformers builds the model on the meta device; sum numel (parameters() dedups tied)."
    m = meta_model(a)
    total = sum(p.numel() for p in m.parameters())
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())  # DeepSpeed's model_to_params
    return total, largest

# --- parameter counts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", list(QWEN25))
def test_param_count_matches_transformers(size):
    total, largest = meta_counts(QWEN25[size])
    assert n_params(QWEN25[size]) == total
    assert largest_layer_params(QWEN25[size]) == largest

def test_param_counts_against_published_sizes():
    # Qwen2.5 model cards (rounded): 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 72.7B; 32B from its safetensors index
    # total_size 65,527,752,704 bytes of bf16 = 32,763,876,352 parameters.
    card = {"0.5B": 0.49e9, "1.5B": 1.54e9, "3B": 3.09e9, "7B": 7.61e9, "14B": 14.7e9, "72B": 72.7e9}
    for k, v in card.items(): assert abs(n_params(QWEN25[k]) - v) / v < 0.01, k
    assert n_params(QWEN25["32B"]) == 65_527_752_704 // 2

def test_local_folder_with_config_json(tmp_path):
    cfg = Qwen2Config(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=704, vocab_size=1000, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    arch = resolve_arch(tmp_path)
    assert (arch.hidden_size, arch.kv_dim, arch.tie_word_embeddings) == (256, 64, False)
    assert n_params(arch) == meta_counts(arch)[0]
    # and a recipe pointing at that folder plans without the table
    rc = load_config(R1, {"model": str(tmp_path)})
    assert plan_memory(rc)["n_params"] == n_params(arch)

def test_unknown_model_names_the_fix():
    with pytest.raises(ValueError, match="config.json"): resolve_arch("meta-llama/Llama-3-8B")
    with pytest.raises(ValueError, match="lacks intermediate_size"): resolve_arch({"hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 10})

# --- model states against DeepSpeed's estimators ------------------------------------------------------------------

def _ds3():
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    return estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold

def _gpu_states(plan):
    g = plan["per_gpu"]
    return (g["params"] + g["grads"] + g["optimizer"] + g["zero3_gathered"]) * GiB

@pytest.mark.parametrize("recipe", [R32, R7], ids=["32b", "7b"])
@pytest.mark.parametrize("offload", [(False, False), (False, True), (True, True)], ids=["none", "optim", "optim+params"])
def test_zero3_states_match_deepspeed(recipe, offload):
    est, _ = _ds3()
    params_off, optim_off = offload
    cfg = load_config(recipe, dict(zero_stage=3, offload_params=params_off, offload_optimizer=optim_off))
    arch = resolve_arch(cfg.model)
    total, largest = meta_counts(arch)          # DeepSpeed's inputs from the transformers model, not from our formula
    plan = plan_memory(cfg)
    cpu, gpu, _ = est(total, largest, num_gpus_per_node=cfg.gpus_per_node, num_nodes=cfg.nnodes,
                      cpu_offload=optim_off, cpu_offload_params=params_off, zero_init=True,
                      additional_buffer_factor=1.0)  # DeepSpeed's 1.5x CPU headroom factor left out: we report raw states
    assert _gpu_states(plan) == pytest.approx(gpu, rel=0.10)
    if optim_off: assert plan["cpu_zero_gb"] * GiB == pytest.approx(cpu, rel=0.10)

def test_zero3_against_the_printed_all_cold_table():
    "The user-facing estimator prints a table; our 32B figures match its rows (its CPU column carries 1.5x)."
    _, cold = _ds3()
    cfg = load_config(R32)
    arch = resolve_arch(cfg.model)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cold(total_params=n_params(arch), largest_layer_params=largest_layer_params(arch),
             num_gpus_per_node=cfg.gpus_per_node, num_nodes=cfg.nnodes)
    rows = {}
    for line in buf.getvalue().splitlines():
        m = re.match(r"\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.*)", line)
        if m: rows[m.group(3).replace(" ", "").replace("OffloadDeviceEnum.", "")] = (float(m.group(1)), float(m.group(2)))
    for (po, oo) in [(True, True), (False, True), (False, False)]:
        key = f"offload_param={'cpu' if po else 'none'},offload_optimizer={'cpu' if oo else 'none'},zero_init=1"
        ds_cpu, ds_gpu = rows[key]
        plan = plan_memory(dataclasses.replace(cfg, offload_params=po, offload_optimizer=oo))
        assert _gpu_states(plan) / GiB == pytest.approx(ds_gpu, rel=0.10, abs=0.01)
        if oo: assert plan["cpu_zero_gb"] * 1.5 == pytest.approx(ds_cpu, rel=0.10)

@pytest.mark.parametrize("recipe,offload", [(R7, False), (R7, True), (R1, False), (R1, True)],
                         ids=["7b", "7b-offload", "1.5b", "1.5b-offload"])
def test_zero2_states_match_deepspeed(recipe, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    cfg = load_config(recipe, dict(zero_stage=2, offload_params=False, offload_optimizer=offload))
    total, _ = meta_counts(resolve_arch(cfg.model))
    cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=cfg.gpus_per_node, num_nodes=cfg.nnodes,
                                                     cpu_offload=offload, additional_buffer_factor=1.0)
    plan = plan_memory(cfg)
    assert _gpu_states(plan) == pytest.approx(gpu, rel=0.10)
    # DeepSpeed's ZeRO-2 CPU figure is max(4 x total GPUs, 16) bytes/param: at one GPU it is the 16 B/param of states
    if offload and cfg.nnodes * cfg.gpus_per_node == 1: assert plan["cpu_zero_gb"] * GiB == pytest.approx(cpu, rel=0.10)

def test_offload_moves_bytes_to_cpu():
    n, ll, dp, g = 10**9, 10**8, 16, 8
    for stage in (2, 3):
        on = model_state_bytes(n, ll, dp=dp, gpus_per_node=g, zero_stage=stage)
        off = model_state_bytes(n, ll, dp=dp, gpus_per_node=g, zero_stage=stage, offload_optimizer=True,
                                offload_params=stage == 3)
        moved = sum(on[k] - off[k] for k in ("params", "grads", "optimizer"))   # bytes that left one GPU
        # ZeRO-3 moves 2 + 4 + 12 B/param of its shard; ZeRO-2 moves fp32 grads + optimizer (16 B) and its bf16
        # gradient partition (2 B) is no longer kept at all. Each node holds the shares of its g ranks.
        assert moved == (18 * n / dp)
        assert off["cpu_per_node"] == g * (18 if stage == 3 else 16) * n / dp
        assert off["gathered"] == on["gathered"] == (4 * ll if stage == 3 else 0)

# --- activations and engine ----------------------------------------------------------------------------------------

def test_activations_by_hand_7b():
    a = QWEN25["7B"]   # h 3584, kv 4 x 128 = 512, I 18944, L 28, V 152064
    act = activation_bytes(a, 1000, checkpointing=True)
    assert act["hidden"] == 1000 * 28 * 2 * 3584
    assert act["layers"] == 1000 * (12 * 3584 + 4 * 512 + 8 * 18944)
    assert act["logits"] == 1000 * 152064 * 6
    full = activation_bytes(a, 1000, checkpointing=False)
    assert full["hidden"] == 0 and full["layers"] == 28 * act["layers"]

def test_activations_linear_in_tokens():
    a = QWEN25["1.5B"]
    for ck in (True, False):
        one, three = activation_bytes(a, 777, ck), activation_bytes(a, 3 * 777, ck)
        assert all(three[k] == 3 * one[k] for k in one)

def test_kv_cache_splits_over_tp_only_up_to_kv_heads():
    a = QWEN25["0.5B"]   # 2 K/V heads: TP 4 replicates them, so per-GPU KV bytes per token stop halving at TP 2
    per = lambda tp: engine_bytes(a, n_params(a), 80 * GiB, 0.5, tp)["kv_per_token"]
    assert per(1) == 2 * 24 * 128 * 2 and per(2) == per(1) / 2 and per(4) == per(2)

def test_long_sequence_sets_the_activation_tokens():
    cfg = load_config(R32, dict(micro_token_budget=4096))
    plan = plan_memory(cfg)
    assert plan["tokens"] == 2048 + 20480
    assert any("goes alone" in n for n in plan["notes"])

def test_no_sleep_adds_the_engine_to_the_update():
    cfg = load_config(R32)
    a, b = plan_memory(cfg), plan_memory(cfg, sleep=False)
    assert b["update_gb"] - a["update_gb"] == pytest.approx(0.9 * 0.8 * 80, abs=0.02)
    assert not b["fits"]

# --- the recipes' plans and the advice -------------------------------------------------------------------------------

def test_reference_recipes_fit_on_80gb():
    for r in (R32, R7, R1):
        p = plan_memory(load_config(r))
        assert p["fits"] and p["advice"] == [], r.name
        assert p["peak_gb"] + p["reserve_gb"] <= 80

@pytest.mark.parametrize("recipe,ov,gpu", [
    (R7, dict(offload_optimizer=False), 80),
    (R32, dict(nnodes=1, offload_params=False, offload_optimizer=False), 80),
    (R32, dict(gradient_checkpointing=False), 80),
    (R1, {}, 24),
    (R7, dict(vllm_gpu_memory_utilization=0.97), 80),
], ids=["7b-no-offload", "32b-one-node", "32b-no-ckpt", "1.5b-24gb", "7b-util-0.97"])
def test_every_piece_of_advice_makes_it_fit(recipe, ov, gpu):
    cfg = load_config(recipe, ov)
    plan = plan_memory(cfg, gpu_memory_gb=gpu)
    assert not plan["fits"] and plan["advice"]
    for adv in plan["advice"]:
        fixed = load_config(recipe, {**ov, **parse_overrides(adv.split())})
        assert plan_memory(fixed, gpu_memory_gb=gpu)["fits"], adv

def test_checkpointing_advice_for_32b():
    plan = plan_memory(load_config(R32, dict(gradient_checkpointing=False)))
    assert "gradient_checkpointing=true" in plan["advice"]

def test_impossible_plan_says_why():
    plan = plan_memory(load_config(R32), gpu_memory_gb=40)
    assert not plan["fits"] and plan["advice"] == []
    assert "no setting of these knobs is enough" in format_plan(plan)

# --- the command ----------------------------------------------------------------------------------------------------

def test_main_exit_codes_and_output(capsys):
    assert main([str(R32)]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "Qwen/Qwen2.5-32B" in out and "peak per GPU" in out
    assert main([str(R7), "offload_optimizer=false"]) == 1
    assert "to fit, set: offload_optimizer=true" in capsys.readouterr().out
    assert main([str(R32), "model=tiny"]) == 2
    assert "not a Qwen2.5 name" in capsys.readouterr().err
    assert main([str(R32), "nnodes=0"]) == 2
    assert "nnodes" in capsys.readouterr().err

def test_main_json(capsys):
    assert main([str(R1), "--json", "--gpu-memory-gb", "141"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu_memory_gb"] == 141 and plan["world_size"] == 1 and plan["fits"]

def test_python_dash_m_end_to_end():
    r = subprocess.run([sys.executable, "-m", "dapo_ref.plan", str(R32)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "peak per GPU" in r.stdout and "fits" in r.stdout

def test_cpu_memory_is_checked_when_given():
    ov = dict(nnodes=1, offload_params=False, offload_optimizer=False)
    cfg = load_config(R32, ov)
    free = plan_memory(cfg)                        # CPU not checked: offloading the optimizer is enough
    assert "offload_optimizer=true" in free["advice"]
    off = plan_memory(load_config(R32, {**ov, "offload_optimizer": True}))
    assert off["cpu_per_node_gb"] == pytest.approx(16 * n_params(QWEN25["32B"]) / GiB + 8 * 2 * n_params(QWEN25["32B"]) / 4 / GiB, abs=0.02)
    tight = plan_memory(cfg, cpu_memory_gb=512)    # 16 B/param x 32.8B = 488 GiB of ZeRO states + 122 GiB of vLLM weights > 512
    assert "offload_optimizer=true" not in tight["advice"] and tight["advice"]
    for adv in tight["advice"]:
        assert plan_memory(load_config(R32, {**ov, **parse_overrides(adv.split())}), cpu_memory_gb=512)["fits"], adv
