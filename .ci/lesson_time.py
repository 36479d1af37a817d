"""The reading time of the lesson path, by the count issue #37 fixed: prose words / 200 + non-blank code lines / 20 +
one minute per figure, over the notebooks `nbs/index.ipynb` lists under **The algorithm**.

Prose = the words (whitespace-separated) of the markdown cells; code = the non-blank lines of every code cell (a
student stepping through the notebook meets the hidden ones too); a figure = a code output holding an image.
`python .ci/lesson_time.py` prints one row per notebook and the total; `--max M` exits 1 when the total is over M, and
`--check-index` when the index does not state the total, rounded to the minute ("gives N minutes")."""

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
    figs = sum(
        1
        for c in cells
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if any(k.startswith("image/") for k in o.get("data", {}))
    )
    return dict(words=words, code=code, figures=figs, minutes=words / 200 + code / 20 + figs)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    limit = float(argv[argv.index("--max") + 1]) if "--max" in argv else None
    rows = [(n, count(NBS / f"{n}.ipynb")) for n in lesson_path()]
    print(f"{'notebook':<16} {'words':>6} {'code':>5} {'figs':>4} {'min':>6}")
    for n, r in rows:
        print(f"{n:<16} {r['words']:>6} {r['code']:>5} {r['figures']:>4} {r['minutes']:>6.1f}")
    total = sum(r["minutes"] for _, r in rows)
    print(
        f"{'total':<16} {sum(r['words'] for _, r in rows):>6} {sum(r['code'] for _, r in rows):>5} "
        f"{sum(r['figures'] for _, r in rows):>4} {total:>6.1f}"
    )
    if limit is not None and total > limit:
        print(f"lesson path: {total:.1f} minutes, over the {limit:g} allowed", file=sys.stderr)
        return 1
    if "--check-index" in argv:
        text = (NBS / "index.ipynb").read_text()
        stated = re.search(r"gives (\d+) minutes", text)
        if not stated or int(stated.group(1)) != round(total):
            said = stated.group(1) if stated else "no number"
            print(
                f"nbs/index.ipynb states {said} minutes; the count gives {round(total)}: update the index",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
