"""Names from TRL, verl and PEFT (nbs/00_core.ipynb, `FOREIGN`; read by `cli.config_from_dict`): each one a recipe
may carry is read as the field of the same meaning (converted where its unit differs, after every override), or
refused in one line naming the field and the unit, or saying why there is none; an unknown key is hinted only at a
field of the same meaning; `dapo-train --fields` lists every field."""

import contextlib, io
from dataclasses import asdict, fields

import pytest
import yaml

from dapo_ref.cli import config_from_dict, load_config, save_config
from dapo_ref.core import DAPOConfig, InputError
from dapo_ref.names import FOREIGN, foreign

DEFAULTS = asdict(DAPOConfig())
NAMES = {f.name for f in fields(DAPOConfig)}

# The names the issue lists, as TRL's GRPOConfig (and its TrainingArguments), verl's DAPO recipe and PEFT's
# LoraConfig spell them: every one must be a field, or a FOREIGN entry.
TRL_NAMES = """learning_rate beta epsilon epsilon_high num_generations max_completion_length max_prompt_length
per_device_train_batch_size gradient_accumulation_steps generation_batch_size steps_per_generation num_iterations
temperature top_p top_k loss_type mask_truncated_completions scale_rewards warmup_steps warmup_ratio max_steps seed
bf16 use_vllm vllm_gpu_memory_utilization vllm_tensor_parallel_size save_steps logging_steps report_to output_dir
model_init_kwargs reward_funcs reward_weights gradient_checkpointing max_grad_norm weight_decay adam_beta1 adam_beta2
push_to_hub hub_model_id hub_private_repo hub_strategy""".split()
VERL_NAMES = """data.train_batch_size data.gen_batch_size data.max_prompt_length data.max_response_length
actor_rollout_ref.rollout.n actor_rollout_ref.actor.ppo_mini_batch_size actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
actor_rollout_ref.actor.ppo_max_token_len_per_gpu actor_rollout_ref.actor.clip_ratio_low clip_ratio_high clip_ratio_c
actor_rollout_ref.actor.loss_agg_mode actor_rollout_ref.actor.optim.lr optim.lr_warmup_steps optim.weight_decay
actor_rollout_ref.actor.grad_clip actor_rollout_ref.actor.use_kl_loss kl_loss_coef algorithm.use_kl_in_reward
algorithm.kl_ctrl.kl_coef algorithm.filter_groups.enable algorithm.filter_groups.max_num_gen_batches
algorithm.filter_groups.metric reward_model.overlong_buffer.enable reward_model.overlong_buffer.len
reward_model.overlong_buffer.penalty_factor actor_rollout_ref.rollout.temperature top_p top_k
actor_rollout_ref.rollout.tensor_model_parallel_size gpu_memory_utilization trainer.total_training_steps
trainer.total_epochs trainer.save_freq trainer.test_freq trainer.nnodes trainer.n_gpus_per_node trainer.val_before_train
actor_rollout_ref.model.path actor_rollout_ref.model.enable_gradient_checkpointing actor_rollout_ref.actor.entropy_coeff
algorithm.adv_estimator""".split()
PEFT_NAMES = "r lora_alpha target_modules lora_dropout bias use_rslora".split()


@pytest.mark.parametrize("name", TRL_NAMES + VERL_NAMES + PEFT_NAMES)
def test_every_listed_name_is_read_or_refused_with_why(name):
    """A field, or an entry: read as its field, or refused with the entry's own line (never 'unknown config key');
    each entry names where it is declared."""
    e = None if name in NAMES else foreign(name)
    assert name in NAMES or e is not None, name
    if e is not None and e.kind in ("refuse", "none"):
        with pytest.raises(InputError) as err:
            config_from_dict({name: 7})  # a value no entry takes as what this project does anyway (its `neutral`)
        assert str(err.value) == e.error(name) and e.source in str(err.value)
        assert "unknown config key" not in str(err.value)


def test_entries_name_their_source_and_existing_fields():
    sources = {"TRL GRPOConfig", "TRL GRPOTrainer", "verl ppo_trainer.yaml", "verl recipe/dapo", "PEFT LoraConfig"}
    for e in FOREIGN:
        assert e.source in sources, e
        assert all(f in NAMES for f in e.field.split(", ") if f), e  # a field it reads as, or asks for, exists
        assert (e.kind == "none") == (e.field == ""), e
        assert e.kind not in ("refuse", "none") or e.note, e  # a refusal says why


# Each name the issue found sent to a field of another meaning by the fuzzy hint, with a value a recipe would give it,
# and what it gets now: the (field, value) it is read as (each value other than the default), or a fragment of its
# refusal.
EXAMPLES = [
    ("beta", 0.04, "has no equivalent here: DAPO has no KL term"),  # was: adam_beta2, AdamW's beta2 = 0.04
    ("clip_ratio_high", 0.3, ("eps_high", 0.3)),  # was: cispo_eps_high
    ("clip_ratio_low", 0.15, ("eps_low", 0.15)),  # was: clip_c
    ("loss_agg_mode", "seq-mean-token-mean", ("loss_agg", "seq-mean-token-mean")),  # was: loss_mode
    ("learning_rate", 3e-6, ("lr", 3e-6)),  # was: overlong_filter
    ("mask_truncated_completions", True, ("overlong_filter", True)),  # was: rollout_correction
    ("num_generations", 8, ("group_size", 8)),  # was: max_num_gen_batches
    ("max_completion_length", 8192, ("l_max", 8192)),  # was: max_prompt_length
    ("train_batch_size", 256, ("prompts_per_step", 256)),  # was: mini_batch_size
    ("algorithm.filter_groups.enable", False, ("dynamic_sampling", False)),  # was: eval_k
    ("delta", 0.1, "unknown config key 'delta'; dapo-train --fields lists the fields"),  # was: model
    ("r", 16, ("lora_r", 16)),  # was: lr
    ("test_freq", 5, ("eval_every", 5)),  # was: temperature
]


@pytest.mark.parametrize("key,value,want", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_examples_get_their_field_or_say_why(key, value, want):
    if isinstance(want, str):
        with pytest.raises(InputError) as e:
            config_from_dict({key: value})
        assert want in str(e.value) and "did you mean" not in str(e.value), str(e.value)
        return
    c = asdict(config_from_dict({key: value}))
    assert {k: x for k, x in c.items() if x != DEFAULTS[k]} == dict([want])  # that field, and no other, changed


@pytest.mark.parametrize(
    "key,value,hint",
    [
        ("eps_hihg", 0.3, "did you mean 'eps_high'?"),
        ("grup_size", 8, "did you mean 'group_size'?"),
        ("max_num_gen_batch", 4, "did you mean 'max_num_gen_batches'?"),
        ("learning_rte", 1e-6, "did you mean 'lr'? (learning_rate in TRL GRPOConfig)"),
        ("adam_beta", 0.9, "did you mean 'adam_beta1' or 'adam_beta2'?"),  # as close to either: both named
        ("optimizer.lr", 1e-6, "did you mean 'lr'? (DAPOConfig is flat: no sections)"),
        ("micro_batch_size", 4, None),  # 'micro' is not 'mini': no mini_batch_size
        ("top_n", 5, None),  # not top_p
        ("importance_sampling_ratio", "token", None),  # a ratio is not a level
        ("grup_size", "eight", None),  # a string cannot be group_size
        ("delta", 0.1, None),
        ("beta2", 0.95, None),
    ],
)
def test_hints_point_only_at_a_field_of_the_same_meaning(key, value, hint):
    with pytest.raises(InputError) as e:
        config_from_dict({key: value})
    msg = str(e.value)
    assert msg.startswith(f"unknown config key '{key}'")
    if hint is None:
        assert "did you mean" not in msg and msg.endswith("dapo-train --fields lists the fields"), msg
    else:
        assert msg.endswith(hint), msg


def test_a_leaf_two_settings_share_asks_for_the_whole_name():
    with pytest.raises(
        InputError, match=r"n names several settings: .*rollout.n \(group_size\), .*val_kwargs.n \(eval_k\)"
    ):
        config_from_dict({"n": 16})
    assert config_from_dict({"val_kwargs.n": 4}).eval_k == 4  # the evaluation's, not the training group
    assert config_from_dict({"rollout.val_kwargs.temperature": 0.6}).temperature == 1.0  # the training one untouched


def test_verl_mini_batch_counts_prompts_and_converts_after_the_overrides(tmp_path):
    """verl's DAPO script: ppo_mini_batch_size 32 prompts of n = 16 responses, train_batch_size 512 prompts: the
    paper's 16 updates a step (Section 4.1). Read as 32 responses it would be 512 x 16 / 32 = 256 updates, 16x the
    paper's. The conversion reads the group size after the overrides, whatever name gives it."""
    p = tmp_path / "verl.yaml"
    p.write_text(
        "data.train_batch_size: 512\n"
        "actor_rollout_ref.rollout.n: 16\n"
        "actor_rollout_ref.actor.ppo_mini_batch_size: 32\n"
        "actor_rollout_ref.actor.clip_ratio_high: 0.28\n"
    )
    c = load_config(p)
    assert (c.prompts_per_step, c.group_size, c.mini_batch_size) == (512, 16, 512)
    assert c.prompts_per_step * c.group_size // c.mini_batch_size == 16
    assert load_config(p, {"group_size": 8}).mini_batch_size == 32 * 8  # the override's G, not the recipe's
    assert load_config(p, {"rollout.n": 4}).mini_batch_size == 32 * 4
    assert load_config(p, {"mini_batch_size": 64}).mini_batch_size == 64  # an override of the field itself wins
    saved = yaml.safe_load(save_config(c, tmp_path / "run" / "config.yaml").read_text())
    assert saved["mini_batch_size"] == 512 and saved["eps_high"] == 0.28  # the run records this project's names
    assert not any("." in k or k in ("ppo_mini_batch_size", "n") for k in saved)


def test_trl_conversions():
    "Each conversion against its definition: TRL's epsilon bounds both sides; warmup_ratio rounds up; bf16; loss_type."
    c = config_from_dict({"epsilon": 0.2})
    assert (c.eps_low, c.eps_high) == (0.2, 0.2)  # TRL: epsilon_high unset means epsilon
    c = config_from_dict({"epsilon": 0.2, "epsilon_high": 0.28})
    assert (c.eps_low, c.eps_high) == (0.2, 0.28)
    assert config_from_dict({"warmup_ratio": 0.1}, {"total_steps": 45}).warmup_steps == 5  # ceil(4.5)
    assert (
        config_from_dict({"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.1, "total_steps": 45}).warmup_steps
        == 4
    )
    assert config_from_dict({"bf16": True, "zero_stage": 2}).dtype == "bfloat16"
    assert config_from_dict({"bf16": False}).dtype == "float32"
    assert config_from_dict({"use_vllm": False}).rollout_backend == "hf"
    for t, agg in (("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")):
        assert config_from_dict({"loss_type": t}).loss_agg == agg
    with pytest.raises(InputError, match="loss_type = 'bnpo' has no loss_agg here"):
        config_from_dict({"loss_type": "bnpo"})
    with pytest.raises(InputError, match="bf16: got 'yes', expected true or false"):
        config_from_dict({"bf16": "yes"})


def test_one_field_twice_in_a_layer_is_refused_and_an_override_wins_across_names(tmp_path):
    with pytest.raises(InputError, match="learning_rate and lr both set lr; keep one"):
        config_from_dict({"learning_rate": 1e-6, "lr": 1e-5})
    assert config_from_dict({"learning_rate": 1e-6}, {"lr": 1e-5}).lr == 1e-5
    assert config_from_dict({"lr": 1e-6}, {"learning_rate": 1e-5}).lr == 1e-5
    p = tmp_path / "recipe.yaml"
    p.write_text("learning_rate: -1\n")
    with pytest.raises(InputError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: lr = -1.0 is out of range: allowed lr > 0 (set as learning_rate)"


def test_fields_lists_every_field_with_default_help_and_range(capsys):
    """`dapo-train --fields`: exit 0 without a recipe, one line a field with its default, help and allowed values;
    `--help` points to it."""
    from dapo_ref.train import main

    with pytest.raises(SystemExit) as e:
        main(["--fields"])
    assert e.value.code == 0
    out = capsys.readouterr().out.splitlines()
    rows = {l.split()[0]: l for l in out[1:]}
    assert list(rows) == [f.name for f in fields(DAPOConfig)]
    for f in fields(DAPOConfig):
        assert f.metadata["help"] in rows[f.name], f.name
        allowed = f.metadata["allowed"]
        assert allowed is None or allowed.words.format(f.name) in rows[f.name], f.name
    assert (
        rows["mini_batch_size"].split()[:3] == ["mini_batch_size", "=", "512"]
        and "responses" in rows["mini_batch_size"]
    )
    assert rows["warmup_steps"].split()[2] == "20" and "rollout steps" in rows["warmup_steps"]
    assert rows["l_max"].split()[2] == "20480" and "tokens" in rows["l_max"]
    assert rows["clip_c"].split()[2] == "10.0" and rows["reward_weights"].split()[2] == "null"
    help_ = io.StringIO()
    with contextlib.redirect_stdout(help_), pytest.raises(SystemExit):
        main(["--help"])
    assert "--fields" in help_.getvalue()


def test_the_values_verl_dapo_scripts_set_for_what_dapo_does_are_read_and_ignored():
    """verl's DAPO recipe scripts (recipe/dapo/*.sh) set `algorithm.adv_estimator=grpo`, `algorithm.use_kl_in_reward=False`,
    `actor_rollout_ref.actor.use_kl_loss=False`, `actor_rollout_ref.actor.kl_loss_coef=0.0`,
    `algorithm.kl_ctrl.kl_coef=0.0`, `actor_rollout_ref.actor.entropy_coeff=0`, `trainer.test_freq=-1` (never) and
    `use_dynamic_bsz=True`; TRL's defaults include `beta: 0.0` and `num_iterations: 1`; PEFT's `bias: none`. Each asks
    for what this project does anyway: read, nothing set. Any other value of the same key is still refused (a KL
    coefficient of 0.001 would change the objective), and -1 of an every-N-steps key is this project's 0."""
    from dapo_ref.cli import config_from_dict

    neutral = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.kl_loss_coef": 0.0,
        "algorithm.kl_ctrl.kl_coef": 0.0,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "beta": 0.0,
        "num_iterations": 1,
    }
    cfg = config_from_dict({**neutral, "trainer.test_freq": -1, "trainer.save_freq": -1})
    assert cfg == DAPOConfig(eval_every=0, save_every=0)
    for k, v in [("actor_rollout_ref.actor.kl_loss_coef", 0.001), ("beta", 0.04), ("num_iterations", 2)]:
        with pytest.raises(InputError, match="has no equivalent here"):
            config_from_dict({k: v})
    with pytest.raises(InputError, match="has no equivalent here"):
        config_from_dict({"actor_rollout_ref.actor.use_kl_loss": 1})  # 1 is not False: only the value itself
