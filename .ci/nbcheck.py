"""`make nbtest`'s worker: one notebook, in this fresh process, run as nbdev_test runs it, then its outputs checked.

    python .ci/nbcheck.py nbs/NAME.ipynb            # run; compare every cell's fresh output with the saved one
    python .ci/nbcheck.py nbs/NAME.ipynb --write    # run; save the fresh outputs (then `nbdev_clean`)

The run is nbdev_test's: the notebook's folder as the working directory, IN_TEST=1, code cells top to bottom, the cells
whose directives name a flag of settings.ini's `tst_flags` (slow, gpu), `eval: false` or an `nbdev_export(` call
skipped (their saved outputs are kept as they are). The check: a cell that shows something must have saved outputs, and
what it shows must be what was saved. "What it shows" is what the rendered page shows of it as text: standard output,
results (Markdown where a result has it, else its text) and errors; a figure counts as a figure (its pixels are not
compared: font rasterisation differs between machines); standard error (progress bars, library warnings) is not part of
the lesson and is not compared. A cell whose output cannot be the same twice says so on its first lines with
`#| volatile` and a reason in a comment; its output is still run, and saved with --write, and must be saved when it
shows something, but is not compared. Numbers printed with more than 6 significant digits are compared within a
relative 1e-6 (`same`: CPU models round differently in their last digits); everything else must be equal.
Exit status 0: ran and matched; 1: a cell raised or an output differs (each listed with its first differing line)."""

import difflib, os, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_ALWAYS = ("notest",)


def directives(src: str) -> dict:
    "The `#| key value` lines at the top of a cell, as {key: value}."
    out = {}
    for line in src.splitlines():
        if not line.startswith("#|"):
            if line.strip():
                break
            continue
        key, _, val = line[2:].strip().partition(" ")
        out[key.rstrip(":")] = val.strip()
    return out


def shown(outputs) -> str:
    "What a reader sees of a cell's outputs, as text (see the module docstring)."
    parts = []
    for o in outputs or []:
        t = o.get("output_type")
        if t == "stream" and o.get("name") == "stdout":
            parts.append("".join(o.get("text", "")))
        elif t in ("execute_result", "display_data"):
            d = o.get("data", {})
            if "image/png" in d or "image/svg+xml" in d:
                parts.append("<figure>")
            else:
                parts.append("".join(d.get("text/markdown", "")) or "".join(d.get("text/plain", "")))
        elif t == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "\n".join(p.rstrip("\n") for p in parts)


NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
REL = 1e-6  # agreement asked of numbers printed with more than 6 significant digits (see `same`)


def digits(s: str) -> int:
    "Significant digits of a printed number."
    m = s.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return len(m)


def same(old: str, new: str) -> bool:
    """Whether the fresh text is the saved text. Words, layout and every number printed with at most 6 significant
    digits must be equal. A number printed with more digits (a float's full repr) may differ in its trailing digits on
    another CPU model: vectorised reductions and math kernels (AVX2 / AVX-512) round in a different order, float64 by a
    few units of 1e-16 per operation, float32 by a few of 6e-8, so a summed float32 value by up to about its term
    count x 6e-8; such numbers match within REL = 1e-6 of their size (a reduction over up to ~16 float32 terms)."""
    if old == new:
        return True
    if NUMBER.sub("#", old) != NUMBER.sub("#", new):
        return False
    for a, b in zip(NUMBER.findall(old), NUMBER.findall(new)):
        if a == b:
            continue
        if min(digits(a), digits(b)) <= 6:
            return False
        x, y = float(a), float(b)
        if abs(x - y) > REL * max(abs(x), abs(y)):
            return False
    return True


def main(argv) -> int:
    path, write = Path(argv[0]).resolve(), "--write" in argv
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    from nbdev.config import get_config

    flags = set(get_config().tst_flags.split()) | set(SKIP_ALWAYS)
    os.environ["IN_TEST"] = "1"
    nb = read_nb(path)
    os.chdir(path.parent)
    sh = CaptureShell(path)
    problems, crashed = [], False
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        d = directives(c.source)
        if flags & d.keys() or d.get("eval", "").lower() == "false" or "nbdev_export" + "(" in c.source:
            continue
        saved = c.get("outputs", [])
        c.outputs = []
        sh.cell(c)
        if sh.exc is not None:
            problems.append(f"cell {i} raised {type(sh.exc).__name__}: {sh.exc}")
            print(sh.prettytb(fname=path), file=sys.stderr)
            crashed = True
            break
        old, new = shown(saved), shown(c.get("outputs", []))
        if ("volatile" in d and (new == "" or old != "")) or same(old, new):
            continue
        if not old:
            problems.append(f"cell {i} shows output and none is saved; first line: {new.splitlines()[0][:160]!r}")
        else:
            diff = [
                l for l in difflib.unified_diff(old.splitlines(), new.splitlines(), "saved", "fresh", lineterm="", n=0)
            ][2:6]
            problems.append(f"cell {i} shows other output than is saved: " + " / ".join(l[:160] for l in diff))
    if write and not crashed:
        write_nb(nb, path)
        print(f"{path.name}: fresh outputs written ({len(problems)} cells changed); run nbdev_clean")
        return 0
    for p in problems:
        print(f"{path.name}: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
