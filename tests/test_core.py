"""DAPOConfig: paper defaults, YAML round trip of every field, and the recipes in recipes/."""

from dataclasses import fields, asdict
from pathlib import Path

import pytest
import yaml

from dapo_ref.core import DAPOConfig, LOSS_AGGS
from dapo_ref.cli import config_from_dict, load_config, save_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_paper_defaults():
    c = DAPOConfig()
    # DAPO paper, Section 4.1 and Algorithm 1
    assert (c.eps_low, c.eps_high) == (0.2, 0.28)
    assert (c.group_size, c.prompts_per_step, c.mini_batch_size) == (16, 512, 512)
    assert (c.l_max, c.l_cache) == (16384 + 4096, 4096)
    assert (c.lr, c.warmup_steps) == (1e-6, 20)
    assert (c.eval_temperature, c.eval_top_p, c.eval_k) == (1.0, 0.7, 32)
    assert c.loss_agg == "token-mean" and c.loss_agg in LOSS_AGGS
    assert not any("kl" in f.name for f in fields(c)), "DAPO has no KL term"


def test_every_field_round_trips(tmp_path):
    c = config_from_dict({"eps_high": 0.3, "clip_c": None, "dynamic_sampling": False, "train_data": "x.parquet"})
    back = load_config(save_config(c, tmp_path / "c.yaml"))
    assert asdict(back) == asdict(c)


def test_every_field_is_declared_once_with_its_rules():
    """`knob` holds each field's help and range: every field has a help line, every number a range, and the default
    is inside it; the words an error shows name the field."""
    for f in fields(DAPOConfig):
        m = f.metadata
        assert m.get("help"), f"field {f.name} has no help line"
        if f.type.split("|")[0].strip() in ("int", "float"):
            assert m["allowed"] is not None, f"numeric field {f.name} has no allowed range"
        if m.get("allowed") is not None:
            assert f.default is None or m["allowed"].ok(f.default), f.name
            assert "{}" in m["allowed"].words or "one of" in m["allowed"].words or " or " in m["allowed"].words, f.name


@pytest.mark.parametrize(
    "key,val,msg",
    [
        ("eps_low", 1.0, "eps_low = 1.0 is out of range"),
        ("group_size", 0, "group_size = 0 is out of range: allowed group_size >= 1"),
        ("max_num_gen_batches", -1, "0 = unbounded"),
        ("dtype", "float16", "float32 or bfloat16"),
        ("dynamic_sampling", "yes", "dynamic_sampling: got 'yes'"),
        ("grup_size", 8, "did you mean 'group_size'"),
    ],
)
def test_errors_name_the_field(key, val, msg):
    with pytest.raises(ValueError, match=None) as e:
        config_from_dict({key: val})
    assert msg in str(e.value)


def test_yaml_scientific_notation(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("lr: 1e-6\nwarmup_steps: 10\n")  # YAML 1.1 reads 1e-6 as a string
    assert load_config(p).lr == 1e-6


def test_overrides_parse_as_yaml():
    assert parse_overrides(["clip_c=null", "eps_high=0.2", "model=runs/x"]) == {
        "clip_c": None,
        "eps_high": 0.2,
        "model": "runs/x",
    }


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_recipes_load(recipe):
    load_config(recipe)


# ---------------------------------------------------------------- bad input: one line naming the input and the fix
from dapo_ref.core import InputError
from dapo_ref.cli import cli_errors, find_recipe, one_line

FLOAT_FIELDS = [f.name for f in fields(DAPOConfig) if f.type.startswith("float")]


def test_float_fields_listed():
    assert {"lr", "temperature", "eps_high", "weight_decay", "clip_c", "reward_timeout"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("key", FLOAT_FIELDS)
@pytest.mark.parametrize("val", [float("inf"), float("-inf"), float("nan"), "inf", ".inf", "nan", "1e999"])
def test_non_finite_rejected_everywhere(key, val):
    if val == ".inf":
        val = yaml.safe_load(val)  # YAML's own spelling of infinity
    with pytest.raises(InputError) as e:
        config_from_dict({key: val})
    assert str(e.value).startswith(f"{key} = ") and "is not a finite number" in str(e.value)


@pytest.mark.parametrize("key", ["group_size", "total_steps", "l_max"])
def test_non_finite_int_rejected(key):
    with pytest.raises(InputError, match=f"{key}: got inf"):
        config_from_dict({key: float("inf")})


def _load(tmp_path, content, **ov):
    p = tmp_path / "recipe.yaml"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError) as e:
        load_config(p, ov)
    msg = str(e.value)
    assert "\n" not in msg
    return msg.replace(str(p), "recipe.yaml")


@pytest.mark.parametrize("content", ["", "\n\n", "# nothing but a comment\n", "---\n"])
def test_empty_recipe_refused(tmp_path, content):
    msg = _load(tmp_path, content)
    assert msg.startswith("recipe.yaml holds no config keys") and "{}" in msg


def test_explicit_empty_mapping_means_defaults(tmp_path):
    (tmp_path / "r.yaml").write_text("{}\n")
    assert load_config(tmp_path / "r.yaml") == DAPOConfig()


def test_duplicate_key(tmp_path):
    assert (
        _load(tmp_path, "model: tiny\nlr: 1e-6\ngroup_size: 4\nlr: 1e-2\n")
        == "recipe.yaml: key 'lr' appears twice (lines 2 and 4); keep one of them"
    )


def test_duplicate_key_even_if_values_agree(tmp_path):
    assert "key 'seed' appears twice" in _load(tmp_path, "seed: 1\nseed: 1\n")


@pytest.mark.parametrize(
    "content,line",
    [
        ("lr: 1e-6\ngroup_size: [8,\n", 3),
        ("a: 1\n  b: 2\n", 2),
        ("lr: 1e-6\n\tgroup_size: 8\n", 2),
        ("model: 'tiny\n", 2),
    ],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path, content, line):
    msg = _load(tmp_path, content)
    assert msg.startswith(f"recipe.yaml: YAML syntax error at line {line}") and "<unicode string>" not in msg


def test_not_utf8(tmp_path):
    assert _load(tmp_path, b"model: tiny\n# caf\xe9\n").startswith("recipe.yaml: not UTF-8 text (byte 0xe9 on line 2)")


def test_not_a_mapping(tmp_path):
    assert "expected a mapping of config keys" in _load(tmp_path, "[1, 2]\n")


def test_bad_value_names_file_but_not_for_overrides(tmp_path):
    assert _load(tmp_path, "lr: -1\n") == "recipe.yaml: lr = -1.0 is out of range: allowed lr > 0"
    assert _load(tmp_path, "lr: 1e-6\n", lr=-1) == "lr = -1.0 is out of range: allowed lr > 0"
    assert _load(tmp_path, "grup_size: 8\n").startswith("recipe.yaml: unknown config key 'grup_size'")


def test_folder_and_missing_file(tmp_path):
    with pytest.raises(InputError, match="is a folder, not a YAML recipe; pass the recipe file$"):
        load_config(tmp_path)
    (tmp_path / "config.yaml").write_text("model: tiny\n")  # a run folder: point at its config
    with pytest.raises(InputError, match="did you mean .*config.yaml"):
        load_config(tmp_path)
    with pytest.raises(InputError, match="no recipe file at"):
        load_config(tmp_path / "nope.yaml")


def test_override_errors():
    with pytest.raises(InputError, match="given twice"):
        parse_overrides(["seed=1", "seed=2"])
    with pytest.raises(InputError, match="not a YAML scalar"):
        parse_overrides(["model=[a"])


def test_find_recipe_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_recipe("recipes/tiny-cpu.yaml") == ROOT / "recipes" / "tiny-cpu.yaml"
    assert load_config("recipes/tiny-cpu.yaml").model == "tiny"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny-cpu.yaml").write_text("model: mine\n")
    assert load_config("recipes/tiny-cpu.yaml").model == "mine"  # the working directory's file comes first


def test_cli_errors_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        with cli_errors("dapo-x"):
            raise InputError("--flag 3: too big; use 2")
    assert e.value.code == 2 and capsys.readouterr().err == "dapo-x: error: --flag 3: too big; use 2\n"
    with pytest.raises(SystemExit):
        with cli_errors("dapo-x"):
            raise FileNotFoundError("no file a\nat all")
    assert capsys.readouterr().err == "dapo-x: error: no file a at all\n"
    with pytest.raises(KeyError):  # a bug is not an input error
        with cli_errors("dapo-x"):
            raise KeyError("bug")
    assert one_line(OSError()) == "OSError"


def test_eval_data_takes_a_list_or_commas_and_expands_each_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    want = "/home/u/a.parquet,b.jsonl"
    assert config_from_dict({"eval_data": ["~/a.parquet", "b.jsonl"]}).eval_data == want  # a YAML list
    assert config_from_dict({"eval_data": "~/a.parquet,b.jsonl"}).eval_data == want  # eval_data=a,b on the CLI
    assert config_from_dict({"eval_data": "~/a.parquet"}).eval_data == "/home/u/a.parquet"  # one path as before
    assert config_from_dict({}).val_before_train is True  # step-0 evaluation stays the default
    with pytest.raises(ValueError, match="val_before_train: got 'no', expected true or false"):
        config_from_dict({"val_before_train": "no"})
