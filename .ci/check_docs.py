"""Docs check for machines without Quarto: render every notebook in nbs/ to HTML in _docs/.

`nbdev_docs` (Quarto) builds the real site from `_quarto.yml`; Quarto cannot be installed here, so this
renders each notebook with nbconvert the way the site shows it (hidden cells dropped, `#|` directives
stripped, outputs kept, MathJax for equations, links to notebooks pointed at the rendered pages), and
fails on a rendering error or a page that would render wrongly:
- a notebook without a `# title` first cell, or (but for index) without `#| default_exp`;
- an unbalanced `$$` in a markdown cell;
- a markdown list with no blank line above it (Quarto then renders it as a paragraph);
- a link to a notebook that does not exist.
"""
import re, sys
from pathlib import Path
import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
NBS, OUT = ROOT / "nbs", ROOT / "_docs"

def _strip_directives(src):
    return "\n".join(l for l in src.split("\n") if not l.lstrip().startswith("#|")).strip("\n")

def _problems(path, nb):
    probs = []
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown" or not cells[0].source.lstrip().startswith("# "):
        probs.append("first cell must be a markdown title: '# name' then '> summary'")
    if path.name != "index.ipynb" and not any(c.cell_type == "code" and "#| default_exp" in c.source for c in cells):
        probs.append("no '#| default_exp' cell")
    for i, c in enumerate(cells):
        if c.cell_type != "markdown": continue
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        if src.count("$$") % 2: probs.append(f"cell {i}: unbalanced $$")
        lines = src.split("\n")
        for j in range(1, len(lines)):
            is_item = re.match(r"\s*([-*]|\d+\.)\s+\S", lines[j])
            prev = lines[j - 1]
            prev_item = re.match(r"\s*([-*]|\d+\.)\s+\S", prev) or prev.startswith((" ", "\t"))
            if is_item and prev.strip() and not prev_item and not prev.lstrip().startswith(("|", ">")):
                probs.append(f"cell {i}: markdown list needs a blank line above it: {lines[j][:40]!r}")
        for target in re.findall(r"\]\(([^)#\s]+\.ipynb)", c.source):
            if not (path.parent / target).exists(): probs.append(f"cell {i}: link to missing notebook {target}")
    return probs

def render(path, exporter):
    nb = nbformat.read(path, as_version=4)
    probs = _problems(path, nb)
    keep = []
    for c in nb.cells:
        if c.cell_type == "code":
            directives = [l.strip() for l in c.source.split("\n") if l.lstrip().startswith("#|")]
            if any(re.match(r"#\|\s*hide\b", d) for d in directives): continue  # hidden in the docs
            c.source = _strip_directives(c.source)
            if not c.source: continue  # e.g. the `#| default_exp` cell
        keep.append(c)
    nb.cells = keep
    body, _ = exporter.from_notebook_node(nb)
    body = re.sub(r'href="([^"#:]+)\.ipynb', r'href="\1.html', body)
    (OUT / (path.stem + ".html")).write_text(body, encoding="utf-8")
    return probs

def main():
    OUT.mkdir(exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    nbs = sorted(p for p in NBS.glob("*.ipynb") if not p.name.startswith("_"))
    failed = 0
    for p in nbs:
        try: probs = render(p, exporter)
        except Exception as e: probs = [f"rendering failed: {type(e).__name__}: {e}"]
        for pr in probs: print(f"docs: {p.relative_to(ROOT)}: {pr}")
        failed += bool(probs)
    print(f"docs: rendered {len(nbs) - failed}/{len(nbs)} notebooks to {OUT.relative_to(ROOT)}/ "
          "(nbconvert; `nbdev_docs` builds the Quarto site where Quarto is installed)")
    if failed: print("docs check failed: fix the notebooks named above"); sys.exit(1)

if __name__ == "__main__": main()
