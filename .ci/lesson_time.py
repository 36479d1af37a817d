"""The lesson path's size, a guard against its growing: prose words / 200 + non-blank code lines / 20, over the
notebooks `nbs/index.ipynb` lists under **The algorithm**. It is not the reading time: that is what a first-time
reader measured, stated in the index (figures, derivations and code are read at rates no count captures).

The path is what a page marks as its DAPO content: every cell but those whose code the reader does not see (`#| hide`:
the tests, collapsed in JupyterLab and absent from the docs; `#| echo: false`: code that draws a figure or a table,
whose output stays on the path) and those of a section whose heading starts with "Engineering" (up to the next heading
of its level or above). Prose = the words (whitespace-separated) of its markdown cells; code = the non-blank lines of
its code cells; `off` = the same size for the cells left out. `python .ci/lesson_time.py` prints one row per
notebook and the total; `--max M` exits 1 when the total is over M (`make lint`); `--collapse` marks every hidden cell
of the path collapsed for JupyterLab (cell metadata `jupyter.source_hidden`, which settings.ini lets nbdev_clean keep),
and `make lint` fails while one is not."""

import json, re, sys
from pathlib import Path

NBS = Path(__file__).resolve().parents[1] / "nbs"


def lesson_path(index: Path = NBS / "index.ipynb") -> list[str]:
    "The notebooks of the index's algorithm table, in order."
    text = "\n".join(
        "".join(c["source"]) for c in json.loads(index.read_text())["cells"] if c["cell_type"] == "markdown"
    )
    part = text.split("**The algorithm**", 1)[1].split("**The engineering**", 1)[0]
    return re.findall(r"^\| \[(\w+)\]\(\w+\.ipynb\)", part, re.M)


HIDDEN = re.compile(r"#\|\s*(hide\b|echo:\s*false\b)")  # a code cell whose source the reader does not see
HEADING = re.compile(r"^(#{1,6}) +(.*)$", re.M)


def on_path(cells: list) -> list[bool]:
    "For each cell: is it on the path (not hidden, not in an Engineering section)?"
    out, off_level = [], None  # off_level: the level of the Engineering heading we are under
    for c in cells:
        s = "".join(c["source"])
        if c["cell_type"] == "markdown":
            for hashes, title in HEADING.findall(s):
                if off_level is None or len(hashes) <= off_level:
                    off_level = len(hashes) if title.startswith("Engineering") else None
        hidden = c["cell_type"] == "code" and HIDDEN.match(s) is not None
        out.append(off_level is None and not hidden)
    return out


def size(cells: list) -> tuple[int, int, float]:
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = sum(
        1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines() if line.strip()
    )
    return words, code, words / 200 + code / 20


def count(nb: Path) -> dict:
    cells = json.loads(nb.read_text())["cells"]
    keep = on_path(cells)
    words, code, sz = size([c for c, k in zip(cells, keep) if k])
    return dict(words=words, code=code, size=sz, off=size([c for c, k in zip(cells, keep) if not k])[2])


def uncollapsed(nb: Path, fix: bool = False) -> int:
    "The number of hidden cells of `nb` not collapsed in JupyterLab; with `fix`, collapse them (and write `nb`)."
    d = json.loads(nb.read_text())
    todo = [
        c
        for c in d["cells"]
        if c["cell_type"] == "code"
        and HIDDEN.match("".join(c["source"]))
        and not c.get("metadata", {}).get("jupyter", {}).get("source_hidden")
    ]
    if fix and todo:
        for c in todo:
            c.setdefault("metadata", {}).setdefault("jupyter", {})["source_hidden"] = True
        nb.write_text(json.dumps(d, indent=1, ensure_ascii=False) + "\n")
    return len(todo)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    loose = {n: uncollapsed(NBS / f"{n}.ipynb", fix="--collapse" in argv) for n in lesson_path()}
    if any(loose.values()) and "--collapse" not in argv:
        names = ", ".join(f"{n} ({k})" for n, k in loose.items() if k)
        print(
            f"hidden cells not collapsed in JupyterLab: {names}; run python .ci/lesson_time.py --collapse",
            file=sys.stderr,
        )
        return 1
    limit = float(argv[argv.index("--max") + 1]) if "--max" in argv else None
    rows = [(n, count(NBS / f"{n}.ipynb")) for n in lesson_path()]
    print(f"{'notebook':<16} {'words':>6} {'code':>5} {'size':>6} {'off':>6}")
    for n, r in rows:
        print(f"{n:<16} {r['words']:>6} {r['code']:>5} {r['size']:>6.1f} {r['off']:>6.1f}")
    total = sum(r["size"] for _, r in rows)
    words, code, off = (sum(r[k] for _, r in rows) for k in ("words", "code", "off"))
    print(f"{'total':<16} {words:>6} {code:>5} {total:>6.1f} {off:>6.1f}")
    if limit is not None and total > limit:
        print(
            f"lesson path: size {total:.1f}, over the {limit:g} allowed (words / 200 + code lines / 20)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
