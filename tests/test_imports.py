"""The import graph of dapo_ref follows the reading order of the notebooks.

A module may import only modules whose notebooks come before its own (`nbs/*.ipynb` sorted by name, each notebook's
`#| default_exp`): then every notebook runs with what was taught above it, and there is no import circle. The graph
counts every import, at the top of a module or inside a function. `UPWARD` lists the imports that still run up the
reading order; the test demands the list be exact, so it can only shrink (an import removed) or fail (one added).
With the list empty the graph has no circle: every edge points to an earlier notebook.
"""

import ast, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (importer, imported): imports that run up the reading order (none left: every import points to an earlier notebook).
UPWARD: set[tuple[str, str]] = set()


def reading_order() -> dict[str, int]:
    "module name -> position of its notebook in the reading order."
    order = {}
    for i, nb in enumerate(sorted((ROOT / "nbs").glob("*.ipynb"))):
        for c in json.loads(nb.read_text())["cells"]:
            m = re.match(r"#\|\s*default_exp\s+(\S+)", "".join(c["source"]))
            if c["cell_type"] == "code" and m:
                order[m.group(1)] = i
    return order


def imports() -> dict[str, set[str]]:
    "module -> the dapo_ref modules it imports (anywhere in its source)."
    mods = {p.stem for p in (ROOT / "dapo_ref").glob("*.py") if not p.stem.startswith("_")}
    graph = {}
    for m in mods:
        deps = set()
        for n in ast.walk(ast.parse((ROOT / "dapo_ref" / f"{m}.py").read_text())):
            if isinstance(n, ast.ImportFrom):
                if n.level == 1 and n.module:
                    deps.add(n.module.split(".")[0])
                elif n.level == 1 or n.module == "dapo_ref":
                    deps.update(a.name for a in n.names)
                elif n.module and n.module.startswith("dapo_ref."):
                    deps.add(n.module.split(".")[1])
            elif isinstance(n, ast.Import):
                deps.update(a.name.split(".")[1] for a in n.names if a.name.startswith("dapo_ref."))
        graph[m] = (deps & mods) - {m}
    return graph


def test_every_module_has_a_notebook():
    assert set(imports()) <= set(reading_order()), set(imports()) - set(reading_order())


def test_imports_follow_the_reading_order():
    order, graph = reading_order(), imports()
    upward = {(m, d) for m, ds in graph.items() for d in ds if order[d] > order[m]}
    assert upward - UPWARD == set(), f"new imports up the reading order: {sorted(upward - UPWARD)}"
    assert UPWARD - upward == set(), f"these are gone: remove them from UPWARD {sorted(UPWARD - upward)}"


def test_no_private_imports_across_modules():
    "A module uses another's public names only: `from .x import _name` would tie it to what x may change freely."
    bad = []
    for p in (ROOT / "dapo_ref").glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.level == 1 or (n.module or "").startswith("dapo_ref")):
                bad += [f"{p.name}: {a.name}" for a in n.names if a.name.startswith("_") and a.name != "__version__"]
    assert bad == [], bad


# Lines as ruff formats them (`make lint`, line length 120). A class is read whole, so one cell holds it (`@patch` only
# where prose comes between its methods), and so is a table of data (one constant): such a cell may be longer.
MAX_MODULE_LINES, MAX_EXPORT_CELL_LINES, MAX_CLASS_CELL_LINES = 600, 100, 250
# core: the config's schema (a field, its bound and its reference per hyperparameter) and the rules between fields.
# `validate` must sit beside DAPOConfig (its __post_init__ calls it: a config that exists is a valid one), so moving the
# rules to a later notebook would import up the reading order; the loss family (#52) added six fields and their rules.
# plan: one memory model, a term per buffer with the source it is read from (#58 added DeepSpeed's buckets, the fused
# head's fp32 gradient, the gathered batch and vLLM's profile run); its CLI and table are a screen beside it.
# vllm_rollout: the one engine with its weight stream, memory order, LoRA serving (#58) and shutdown; the parts meet
# in `around_update` and `close`, so a reader follows one module.
# data: the DAPO schema, the data spec (a path, a dapo-data name or a hub dataset, with a column mapping: #59) and the
# one-line checks of a file's rows; core: + the bf16-without-master-copy rule and dynamic_sampling_metric (#59), and the
# hub fields (model_revision, push_to_hub, ...); trainer: + the hub at both ends of a run (#59 item 6). All next to split.
LONGER = {"core.py": 760, "trainer.py": 630, "plan.py": 740, "vllm_rollout.py": 720, "data.py": 720}


def one_class(src: str) -> bool:
    "The cell defines one class (beside imports and constants) or one constant, and no function."
    kinds = [type(n) for n in ast.parse(src.replace("#|", "# |")).body]
    if kinds.count(ast.ClassDef) == 1:
        return set(kinds) <= {ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign}
    return kinds == [ast.Assign]


def test_modules_and_export_cells_stay_short():
    "No module over 600 lines (nbdev's `_modidx` aside) and no `#| export` cell over 100 (250 for one class or one table): a file and a cell a reader can hold."
    long_mods = {
        p.name: n
        for p in (ROOT / "dapo_ref").glob("*.py")
        if p.name != "_modidx.py"
        for n in [len(p.read_text().splitlines())]
        if n > LONGER.get(p.name, MAX_MODULE_LINES)
    }
    long_cells = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        for i, c in enumerate(json.loads(nb.read_text())["cells"]):
            src, n = "".join(c["source"]), len("".join(c["source"]).splitlines())
            if c["cell_type"] != "code" or not re.match(r"#\|\s*export", src):
                continue
            if n > (MAX_CLASS_CELL_LINES if one_class(src) else MAX_EXPORT_CELL_LINES):
                long_cells.append(f"{nb.name} cell {i}: {n} lines")
    assert long_mods == {} and long_cells == [], (long_mods, long_cells)


# The ladder of issue #36: the algorithm and the implementations of its two interfaces sit side by side above
# `interfaces` and the pure pieces, and neither side imports the other; the run (`trainer`) picks and wires them.
PURE = {"core", "data", "reward", "advantage", "loss", "loss_family", "rollout_correction", "sampling"}
IMPLEMENTATIONS = {"rollout", "vllm_rollout", "learner", "sharded_learner", "scale", "sharded"}


def test_the_algorithm_imports_only_the_interfaces_and_the_pure_pieces():
    graph = imports()
    assert graph["algorithm"] <= PURE | {"interfaces"}, graph["algorithm"] - PURE - {"interfaces"}
    assert graph["interfaces"] <= PURE, graph["interfaces"]
    above = {m for m in graph if "algorithm" in graph[m]} | {"algorithm"}
    assert not (IMPLEMENTATIONS & above), IMPLEMENTATIONS & above  # no implementation imports the algorithm
    assert not (graph["algorithm"] & IMPLEMENTATIONS)


def test_the_algorithm_module_meets_no_rank():
    "Algorithm 1 for one process: no torch.distributed, no `dist.` helper, no file I/O, no user-input validation."
    src = (ROOT / "dapo_ref" / "algorithm.py").read_text()
    for word in ("torch.distributed", "dist.", "open(", "Path(", "InputError", "save_pretrained", "json.dump"):
        assert word not in src, word


def test_the_one_process_learner_meets_no_rank():
    "The plain learner has no collective: where ranks would meet it calls hooks that `sharded_learner` answers."
    graph = imports()
    assert "dist" not in graph["learner"] and "dist" in graph["sharded_learner"]
    src = (ROOT / "dapo_ref" / "learner.py").read_text()
    for word in ("torch.distributed", "dist.", "all_reduce(", "local_rank(", "barrier("):
        assert word not in src, word
