"""The lesson path's size, a guard against its growing: prose words / 200 + non-blank code lines / 20, over the
notebooks `nbs/index.ipynb` lists under **The algorithm**. It is not the reading time: that is what a first-time
reader measured, stated in the index (figures, derivations and code are read at rates no count captures).

Prose = the words (whitespace-separated) of the markdown cells; code = the non-blank lines of every code cell (a
student stepping through the notebook meets the hidden ones too). `python .ci/lesson_time.py` prints one row per
notebook and the total; `--max M` exits 1 when the total is over M (`make lint`)."""

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


def count(nb: Path) -> dict:
    cells = json.loads(nb.read_text())["cells"]
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = sum(
        1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines() if line.strip()
    )
    return dict(words=words, code=code, size=words / 200 + code / 20)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    limit = float(argv[argv.index("--max") + 1]) if "--max" in argv else None
    rows = [(n, count(NBS / f"{n}.ipynb")) for n in lesson_path()]
    print(f"{'notebook':<16} {'words':>6} {'code':>5} {'size':>6}")
    for n, r in rows:
        print(f"{n:<16} {r['words']:>6} {r['code']:>5} {r['size']:>6.1f}")
    total = sum(r["size"] for _, r in rows)
    print(f"{'total':<16} {sum(r['words'] for _, r in rows):>6} {sum(r['code'] for _, r in rows):>5} {total:>6.1f}")
    if limit is not None and total > limit:
        print(
            f"lesson path: size {total:.1f}, over the {limit:g} allowed (words / 200 + code lines / 20)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
