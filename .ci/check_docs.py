"""Docs check for machines without Quarto: render every notebook in nbs/ to HTML in _docs/, then open the pages in a browser.

`nbdev_docs` (Quarto) builds the real site from `_quarto.yml`; Quarto cannot be installed here, so this renders each
notebook with nbconvert the way the site shows it (hidden cells dropped, `#|` directives stripped, outputs kept,
equations typeset by a local copy of MathJax, links to notebooks pointed at the rendered pages, a navigation bar in the
sidebar's order), and fails on a rendering error or a page that would render wrongly:
- a notebook without a `# title` first cell, or with `#| export` cells but no `#| default_exp` (pages without
  exported code, such as index and troubleshooting, need none);
- an unbalanced `$$` in a markdown cell;
- a markdown list with no blank line above it (Quarto then renders it as a paragraph);
- a link to a notebook that does not exist, an image file that does not exist, a `_quarto.yml` sidebar entry that
  does not exist.
Then `.ci/browser_check.py` opens every page in headless Chromium (when installed; skipped with a message otherwise):
no console errors, every image loads, equations typeset, internal links resolve; screenshots of two pages.
Usage: python .ci/check_docs.py [--no-browser]
"""
import html, re, shutil, sys
from pathlib import Path
import nbformat, yaml
from jinja2 import DictLoader
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
NBS, OUT = ROOT / "nbs", ROOT / "_docs"
MATHJAX_DIR = "mathjax"  # _docs/mathjax/: MathJax 2.7 from the `jupyter-server-mathjax` package, served with the pages
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"

# The lab template, minus what it would fetch from a CDN: require.js (only needed by widget outputs), mermaid (no
# diagrams here) and MathJax, which is loaded from _docs/mathjax/ with the web fonts that copy ships (STIX-Web).
TEMPLATE = r"""{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_mathjax -%}
<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
               linebreaks: {automatic: true},
               // MathJax measures web fonts against a blank font it loads from url('about:blank'), which the browser
               // reports as a failed request; a local() font that is not there measures the same and fetches nothing
               styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax_Blank_None')"}}},
  // the hidden MathML copy for screen readers would pull in the TeX web fonts, which this copy of MathJax does not ship
  menuSettings: {assistiveMML: false},
  tex2jax: {inlineMath: [['$', '$'], ['\\(', '\\)']], displayMath: [['$$', '$$'], ['\\[', '\\]']],
            processEscapes: true, processEnvironments: true},
  TeX: {equationNumbers: {autoNumber: "AMS", useLabelIds: true}},
  displayAlign: "center", messageStyle: "none", showMathMenu: false
});
</script>
<script src="{{ resources.mathjax_url }}"></script>
{%- endblock html_head_js_mathjax -%}
{%- block extra_css -%}
<link rel="icon" href="data:,">
<style>
nav.dapo-nav { font: 14px/1.6 var(--jp-ui-font-family, sans-serif); padding: 8px 16px; border-bottom: 1px solid #ddd; }
nav.dapo-nav a { margin-right: 12px; white-space: nowrap; }
nav.dapo-nav a.current { font-weight: bold; text-decoration: none; color: inherit; }
nav.dapo-nav span.section { color: #666; margin-right: 6px; }
</style>
{%- endblock extra_css -%}
{%- block body_header -%}{{ super() }}
{{ resources.dapo_nav }}
{%- endblock body_header -%}
"""

LIST_ITEM = re.compile(r"\s*([-*]|\d+\.)\s+\S")
MD_LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](src)
HTML_IMG = re.compile(r"<img[^>]*\ssrc=[\"']([^\"']+)[\"']", re.I)

def _strip_directives(src):
    return "\n".join(l for l in src.split("\n") if not l.lstrip().startswith("#|")).strip("\n")

def _directives(src):
    return [l.strip() for l in src.split("\n") if l.lstrip().startswith("#|")]

def _is_local(target):
    return not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith(("#", "/"))

def sidebar_entries(quarto_yml):
    "The sidebar of `_quarto.yml` as [(section or None, 'NN_name.ipynb'), ...] in reading order."
    cfg = yaml.safe_load(Path(quarto_yml).read_text()) or {}
    out = []
    def walk(items, section):
        for it in items or []:
            if isinstance(it, str): out.append((section, it))
            elif isinstance(it, dict) and "contents" in it: walk(it["contents"], it.get("section"))
            elif isinstance(it, dict) and ("href" in it or "file" in it): out.append((section, it.get("href") or it["file"]))
    walk(((cfg.get("website") or {}).get("sidebar") or {}).get("contents"), None)
    return out

def problems(path, nb):
    "What would render wrongly in notebook `path` (its parsed `nb`): a list of messages, empty when fine."
    probs = []
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown" or not cells[0].source.lstrip().startswith("# "):
        probs.append("first cell must be a markdown title: '# name' then '> summary'")
    code = [c for c in cells if c.cell_type == "code"]
    has_exp = any(re.match(r"#\|\s*default_exp\b", d) for c in code for d in _directives(c.source))
    exports = [i for i, c in enumerate(cells) if c.cell_type == "code"
               and any(re.match(r"#\|\s*(export|exporti|exports)\b", d) for d in _directives(c.source))]
    if exports and not has_exp:
        probs.append(f"cell {exports[0]}: '#| export' cells but no '#| default_exp' cell (a docs page with no module "
                     "must have no exported cells)")
    for i, c in enumerate(cells):
        if c.cell_type != "markdown": continue
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        src_nocode = re.sub(r"`[^`\n]*`", "", src)
        if src_nocode.count("$$") % 2: probs.append(f"cell {i}: unbalanced $$")
        lines = re.sub(r"\$\$.*?\$\$", "$$ $$", src_nocode, flags=re.S).split("\n")  # no lists inside display math
        for j in range(1, len(lines)):
            prev = lines[j - 1]
            prev_item = LIST_ITEM.match(prev) or prev.startswith((" ", "\t"))
            if LIST_ITEM.match(lines[j]) and prev.strip() and not prev_item and not prev.lstrip().startswith(("|", ">")):
                probs.append(f"cell {i}: markdown list needs a blank line above it: {lines[j][:40]!r}")
        targets = [(bang == "!", t) for bang, t in MD_LINK.findall(src_nocode)] + [(True, t) for t in HTML_IMG.findall(src_nocode)]
        for is_img, t in targets:
            if not _is_local(t): continue
            f = t.split("#")[0].split("?")[0]
            if not f: continue
            if not (path.parent / f).exists():
                what = "image" if is_img else ("notebook" if f.endswith(".ipynb") else "file")
                probs.append(f"cell {i}: link to missing {what} {t}")
    return probs

def _local_images(nb):
    "Local image files referenced by markdown cells (copied next to the rendered page)."
    out = []
    for c in nb.cells:
        if c.cell_type != "markdown": continue
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        out += [t for bang, t in MD_LINK.findall(src) if bang and _is_local(t)] + [t for t in HTML_IMG.findall(src) if _is_local(t)]
    return out

def _slug(text):
    "Pandoc's (so Quarto's) automatic heading identifier."
    s = re.sub(r"[^\w\s.-]", "", html.unescape(re.sub(r"<[^>]+>", "", text)).strip().lower())
    s = re.sub(r"\s", "-", s)  # each space a hyphen: "A > 0" -> "a--0", as pandoc does
    return re.sub(r"^[^a-z]+", "", s) or "section"

def _quarto_anchors(body):
    "Give each heading Quarto's id as well (an empty anchor before it), so `page.html#quarto-id` links resolve here too."
    def add(m):
        tag, hid, inner = m.group(1), m.group(2), m.group(3)
        slug = _slug(re.sub(r'<a class="anchor-link".*?</a>', "", inner))
        return (m.group(0) if slug == hid else f'<a id="{slug}"></a>{m.group(0)}')
    return re.sub(r'<(h[1-6]) id="([^"]*)">(.*?)</\1>', add, body, flags=re.S)

def nav_html(entries, current, stems):
    "The sidebar of `_quarto.yml` as one line of links to the pages in `stems`."
    parts, last = ['<nav class="dapo-nav">'], None  # (a top-level entry after a section gets a "|" before it)
    for section, nbname in entries:
        stem = Path(nbname).stem
        if stem not in stems: continue
        if section != last: parts.append(f'<span class="section">{section + ":" if section else "|"}</span>')
        last = section
        cls = ' class="current"' if stem == current else ""
        parts.append(f'<a href="{stem}.html"{cls}>{"home" if stem == "index" else stem}</a>')
    parts.append("</nav>")
    return "\n".join(parts)

def mathjax_source():
    "Folder of the MathJax 2.7 files shipped by the `jupyter-server-mathjax` package (a dev dependency)."
    try: import jupyter_server_mathjax
    except ImportError:
        raise SystemExit("docs check failed: MathJax is not installed locally (the pages must typeset equations offline): "
                         "pip install jupyter-server-mathjax (it is in settings.ini dev_requirements: make install)")
    return Path(jupyter_server_mathjax.__file__).parent / "static"

def copy_mathjax(out_dir):
    "Copy MathJax into `out_dir/mathjax` (once: skipped when the copy is there already)."
    src, dst = mathjax_source(), out_dir / MATHJAX_DIR
    if not (dst / "MathJax.js").exists() or (dst / "MathJax.js").stat().st_size != (src / "MathJax.js").stat().st_size:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return dst

def make_exporter():
    e = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"dapo_docs.html.j2": TEMPLATE})],
                     template_file="dapo_docs.html.j2")
    e.mathjax_url = f"{MATHJAX_DIR}/MathJax.js?config={MATHJAX_CONFIG}"
    e.exclude_input_prompt = e.exclude_output_prompt = True  # no `In [ ]:` (notebooks are committed without counts)
    return e

def render(path, exporter, out_dir=OUT, nav=""):
    "Render notebook `path` to `out_dir/<stem>.html`; return its problems."
    nb = nbformat.read(path, as_version=4)
    probs = problems(path, nb)
    keep = []
    for c in nb.cells:
        if c.cell_type == "code":
            if any(re.match(r"#\|\s*hide\b", d) for d in _directives(c.source)): continue  # hidden in the docs
            c.source = _strip_directives(c.source)
            if not c.source: continue  # e.g. the `#| default_exp` cell
        keep.append(c)
    nb.cells = keep
    body, _ = exporter.from_notebook_node(nb, resources={"dapo_nav": nav, "metadata": {"name": path.stem}})
    body = re.sub(r'href="([^"#:]+)\.ipynb', r'href="\1.html', body)
    body = _quarto_anchors(body)
    for t in _local_images(nb):  # images next to the notebook go next to the page
        f = path.parent / t.split("#")[0].split("?")[0]
        if f.is_file() and f.resolve().is_relative_to(path.parent.resolve()):
            (out_dir / t).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out_dir / t.split("#")[0].split("?")[0])
    (out_dir / (path.stem + ".html")).write_text(body, encoding="utf-8")
    return probs

def render_all(nbs_dir=NBS, out_dir=OUT, quarto_yml=None, log=print):
    "Render every notebook of `nbs_dir` (not `_scratch` ones) into `out_dir`; return the number of failed notebooks."
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_mathjax(out_dir)
    exporter = make_exporter()
    nbs = sorted(p for p in nbs_dir.glob("*.ipynb") if not p.name.startswith("_"))
    entries = sidebar_entries(quarto_yml) if quarto_yml and Path(quarto_yml).exists() else [(None, p.name) for p in nbs]
    failed = 0
    for section, name in entries:
        if not (nbs_dir / name).exists():
            log(f"docs: {Path(quarto_yml).name}: sidebar entry {name} does not exist in {nbs_dir.name}/"); failed += 1
    listed = {Path(n).name for _, n in entries}
    for p in nbs:
        if p.name not in listed: log(f"docs: note: {p.name} is not in the sidebar of _quarto.yml (add it there)")
    for old in out_dir.glob("*.html"):  # a page of a removed notebook would be checked as if current
        if not (nbs_dir / (old.stem + ".ipynb")).exists(): old.unlink()
    stems = {p.stem for p in nbs}
    for p in nbs:
        try: probs = render(p, exporter, out_dir, nav_html(entries, p.stem, stems))
        except Exception as e: probs = [f"rendering failed: {type(e).__name__}: {e}"]
        for pr in probs: log(f"docs: {p.relative_to(nbs_dir.parent)}: {pr}")
        failed += bool(probs)
    log(f"docs: rendered {len(nbs)} notebooks to {out_dir.name}/ with {failed} problem(s) "
        "(nbconvert; `nbdev_docs` builds the Quarto site where Quarto is installed)")
    return failed

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    failed = render_all(NBS, OUT, ROOT / "_quarto.yml")
    if failed: print("docs check failed: fix the notebooks named above"); sys.exit(1)
    if "--no-browser" in argv: return
    sys.path.insert(0, str(Path(__file__).parent))
    import browser_check
    sys.exit(browser_check.main([str(OUT)]))

if __name__ == "__main__": main()
