"""The launch scripts of the full run resolve: recipes/dapo-qwen2.5-32b.slurm (and the DeepSpeed launcher command in it)
and the README's launch commands name files, recipes, fields and entry points that exist, with a world size that equals
the recipe's nnodes x gpus_per_node and engines that stay inside a node."""

import configparser, importlib.util, re, shlex, shutil, subprocess
from dataclasses import fields
from pathlib import Path


from dapo_ref.core import DAPOConfig
from dapo_ref.cli import load_config, parse_overrides
from dapo_ref.plan import engine_layout

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "recipes" / "dapo-qwen2.5-32b.slurm"
FIELDS = {f.name for f in fields(DAPOConfig)}


def console_scripts() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "settings.ini")
    return {l.split("=")[0].strip() for l in cfg["DEFAULT"]["console_scripts"].split("\n") if l.strip()}


def logical_lines(text: str) -> list[str]:
    "Shell lines with backslash continuations joined."
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def check_train_command(words: list[str], world: int, nodes: int, per_node: int):
    "`... --config R key=value ...` of dapo-train: R loads with the overrides (placeholders for shell variables), world fits."
    cfg_path = ROOT / words[words.index("--config") + 1].strip('"')
    assert cfg_path.is_file(), cfg_path
    kv = [w for w in words if re.fullmatch(r"[a-z_]+=.*", w)]
    assert {k.split("=")[0] for k in kv} <= FIELDS, kv
    ov = parse_overrides([re.sub(r'"?\$\{?\w+\}?"?', "x", w) for w in kv])  # $OUT/... -> x/...: a path, as at run time
    cfg = load_config(cfg_path, ov)
    assert (cfg.nnodes, cfg.gpus_per_node) == (nodes, per_node) and cfg.nnodes * cfg.gpus_per_node == world
    lay = engine_layout(world, cfg.vllm_tensor_parallel, cfg.gpus_per_node)
    assert all(first // per_node == last // per_node for _, first, last, _ in lay)  # each engine inside one node
    return cfg


def test_slurm_script_resolves():
    text = SLURM.read_text()
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(SLURM)]).returncode == 0  # it parses
    sb = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    nodes, per_node = int(sb["nodes"]), int(sb["gpus-per-node"])
    assert sb["ntasks-per-node"] == "1"  # one torchrun per node; it starts the node's ranks
    run = next(l for l in logical_lines(text) if "torchrun" in l and not l.lstrip().startswith("#"))
    words = shlex.split(run)
    assert words[words.index("--nproc_per_node") + 1] == str(per_node)
    assert words[words.index("--no-python") + 1] in console_scripts()  # dapo-train
    assert re.search(r"^RECIPE=(\S+)", text, re.M).group(1) == "recipes/dapo-qwen2.5-32b.yaml"
    words = [w.replace("$RECIPE", "recipes/dapo-qwen2.5-32b.yaml") for w in words]
    cfg = check_train_command(words, nodes * per_node, nodes, per_node)
    assert cfg.dist_timeout >= 3600  # a rollout round of the 32B recipe can take longer than NCCL's 10 minutes
    # the staging step names the model and the files the learner and vLLM read
    assert "snapshot_download" in text and "'*.safetensors'" in text and "CPUAdamBuilder().load()" in text


def test_deepspeed_launcher_command_resolves():
    text = SLURM.read_text()
    block = "\n".join(
        l.lstrip("# ") for l in text.splitlines() if l.startswith("#   ") or l.startswith("#             ")
    )
    line = next(l for l in logical_lines(block) if l.startswith("deepspeed "))
    words = shlex.split(line)
    nodes, per_node = int(words[words.index("--num_nodes") + 1]), int(words[words.index("--num_gpus") + 1])
    assert importlib.util.find_spec(words[words.index("--module") + 1]) is not None  # dapo_ref.train
    check_train_command(words, nodes * per_node, nodes, per_node)


def test_readme_launch_commands_resolve():
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S))  # the commands shown
    cmds = [
        l.split("  #")[0]
        for l in logical_lines(blocks)
        if re.match(r"\s*(torchrun|deepspeed|sbatch|dapo-train|dapo-plan)\b", l)
    ]
    assert any("sbatch recipes/dapo-qwen2.5-32b.slurm" in c for c in cmds), cmds
    for c in cmds:
        for path in re.findall(r"recipes/[\w.\-]+\.(?:yaml|slurm)", c):
            assert (ROOT / path).is_file(), (path, c)
        words = shlex.split(c)
        if "--nproc_per_node" in words and "--config" in words and "--nnodes" in words:
            n, g = int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc_per_node") + 1])
            check_train_command(words, n * g, n, g)
