"""Build the docs site with MkDocs Material from the notebooks' saved outputs, check it, then open it in a browser.

Quarto cannot be installed here, so `nbdev_docs` cannot build the site `_quarto.yml` describes. This builds the same
site with a maintained static-site tool instead: each notebook of nbs/ becomes a Markdown page in _proc/site/ the
way nbdev prepares it for Quarto (hidden cells dropped, `#|` directives stripped, saved outputs kept, figures written
next to the page, and after each `#| export` cell an API entry for every public function or class it defines:
nbdev's `show_doc` signature and docstring, then the docments argument table), the sidebar comes from `_quarto.yml`'s
sidebar (the one source of the reading order), and `mkdocs build` (configuration: mkdocs.yml) writes _docs/ with
offline search, a table of contents per page, copy buttons on code and equations typeset by a local MathJax.
It fails on a rendering error, a MkDocs warning (a link or anchor it cannot resolve) or a page that would render wrongly:
- a notebook without a `# title` first cell, or with `#| export` cells but no `#| default_exp` (pages without
  exported code, such as index and troubleshooting, need none);
- an unbalanced `$$` in a markdown cell;
- a markdown list with no blank line above it (Quarto then renders it as a paragraph);
- a link to a notebook that does not exist, an image file that does not exist, a `_quarto.yml` sidebar entry that
  does not exist.
Then `.ci/browser_check.py` follows a reader through the site in headless Chromium (when installed; skipped with a
message otherwise): search, the sidebar from first page to last, no console errors, images, equations, links.
Usage: python .ci/check_docs.py [--no-browser]
"""

import ast, base64, html, importlib, re, shutil, subprocess, sys, time
from pathlib import Path
import nbformat, yaml

ROOT = Path(__file__).resolve().parents[1]
NBS, OUT, SRC = ROOT / "nbs", ROOT / "_docs", ROOT / "_proc" / "site"
MATHJAX_DIR = "mathjax"  # _docs/mathjax/: MathJax 2.7 from the `jupyter-server-mathjax` package, served with the pages
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

LIST_ITEM = re.compile(r"\s*([-*]|\d+\.)\s+\S")
MD_LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](src)
HTML_IMG = re.compile(r"<img[^>]*\ssrc=[\"']([^\"']+)[\"']", re.I)
# A Quarto callout that spans cells: a markdown cell opens it (first line `::: {.callout-note collapse="true"}`, its
# first heading the title), the cells after it are inside, a markdown cell `:::` closes it. Rendered here as
# Material's collapsible admonition (<details>), as Quarto renders it with nbdev_docs.
CALLOUT_OPEN = re.compile(r"^:::\s*\{\.callout-(\w+)([^}]*)\}\s*$")
CALLOUT_CLOSE = re.compile(r"^:::\s*$")


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
            if isinstance(it, str):
                out.append((section, it))
            elif isinstance(it, dict) and "contents" in it:
                walk(it["contents"], it.get("section"))
            elif isinstance(it, dict) and ("href" in it or "file" in it):
                out.append((section, it.get("href") or it["file"]))

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
    exports = [
        i
        for i, c in enumerate(cells)
        if c.cell_type == "code"
        and any(re.match(r"#\|\s*(export|exporti|exports)\b", d) for d in _directives(c.source))
    ]
    if exports and not has_exp:
        probs.append(
            f"cell {exports[0]}: '#| export' cells but no '#| default_exp' cell (a docs page with no module "
            "must have no exported cells)"
        )
    depth = 0
    for i, c in enumerate(cells):
        if c.cell_type != "markdown":
            continue
        first = c.source.strip().split("\n")[0]
        if CALLOUT_OPEN.match(first):
            if depth:
                probs.append(f"cell {i}: a callout opens inside another; close the first with a ':::' cell")
            depth += 1
        elif CALLOUT_CLOSE.match(c.source.strip()):
            if not depth:
                probs.append(f"cell {i}: ':::' closes no callout")
            depth = max(0, depth - 1)
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        src_nocode = re.sub(r"`[^`\n]*`", "", src)
        if src_nocode.count("$$") % 2:
            probs.append(f"cell {i}: unbalanced $$")
        lines = re.sub(r"\$\$.*?\$\$", "$$ $$", src_nocode, flags=re.S).split("\n")  # no lists inside display math
        for j in range(1, len(lines)):
            prev = lines[j - 1]
            prev_item = LIST_ITEM.match(prev) or prev.startswith((" ", "\t"))
            if (
                LIST_ITEM.match(lines[j])
                and prev.strip()
                and not prev_item
                and not prev.lstrip().startswith(("|", ">"))
            ):
                probs.append(f"cell {i}: markdown list needs a blank line above it: {lines[j][:40]!r}")
        targets = [(bang == "!", t) for bang, t in MD_LINK.findall(src_nocode)] + [
            (True, t) for t in HTML_IMG.findall(src_nocode)
        ]
        for is_img, t in targets:
            if not _is_local(t):
                continue
            f = t.split("#")[0].split("?")[0]
            if not f:
                continue
            if not (path.parent / f).exists():
                what = "image" if is_img else ("notebook" if f.endswith(".ipynb") else "file")
                probs.append(f"cell {i}: link to missing {what} {t}")
    if depth:
        probs.append("a callout is opened and never closed; end it with a markdown cell ':::'")
    return probs


def _local_images(nb):
    "Local image files referenced by markdown cells (copied next to the rendered page)."
    out = []
    for c in nb.cells:
        if c.cell_type != "markdown":
            continue
        src = re.sub(r"```.*?```", "", c.source, flags=re.S)
        out += [t for bang, t in MD_LINK.findall(src) if bang and _is_local(t)] + [
            t for t in HTML_IMG.findall(src) if _is_local(t)
        ]
    return out


def mathjax_source():
    "Folder of the MathJax 2.7 files shipped by the `jupyter-server-mathjax` package (a dev dependency)."
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise SystemExit(
            "docs check failed: MathJax is not installed locally (the pages must typeset equations offline): "
            "pip install jupyter-server-mathjax (it is in settings.ini dev_requirements: make install)"
        )
    return Path(jupyter_server_mathjax.__file__).parent / "static"


def copy_mathjax(out_dir):
    "Copy MathJax into `out_dir/mathjax` (once: skipped when the copy is there already)."
    src, dst = mathjax_source(), out_dir / MATHJAX_DIR
    if not (dst / "MathJax.js").exists() or (dst / "MathJax.js").stat().st_size != (src / "MathJax.js").stat().st_size:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return dst


def _title(nb, stem):
    "The page title: the text of the notebook's `# title` line."
    if nb.cells and nb.cells[0].cell_type == "markdown":
        m = re.match(r"\s*#\s+(.+)", nb.cells[0].source)
        if m:
            return m.group(1).strip()
    return stem


def _api_names(src):
    "Public functions and classes an `#| export` cell defines, in order; a fastcore `@patch` method as `Class.method`."
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        decos = [
            d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in getattr(node, "decorator_list", [])
        ]
        if "patch" in decos and node.args.args and isinstance(node.args.args[0].annotation, ast.Name):
            out.append(f"{node.args.args[0].annotation.id}.{node.name}")
        elif "patch" not in decos:
            out.append(node.name)
    return out


def api_entry(obj, name):
    "Markdown of one API entry: nbdev's `show_doc` (signature with docments, docstring), then the docments argument table."
    from nbdev.showdoc import BasicMarkdownRenderer
    from fastcore.docments import DocmentTbl

    md = BasicMarkdownRenderer(obj, name=name, title_level=3)._repr_markdown_()
    md = re.sub(r"\A---\s*\n+", "", md)
    # the [source] link points at doc_host's repository with a line number nbdev can only find in a Quarto build
    md = re.sub(r"^\[source\]\([^)]*\)\{[^}]*\}\s*\n+", "", md, flags=re.M)
    try:
        tbl = DocmentTbl(obj)._repr_markdown_()
    except Exception:
        tbl = ""
    return f'<div class="api-entry" markdown>\n\n{md.strip()}\n\n{tbl.strip()}\n\n</div>'


def _slugify():
    from pymdownx.slugs import slugify

    return slugify(case="lower")


def _output_markdown(out, stem, n, files):
    "Markdown for one saved output; images are added to `files` ({relative path: bytes})."
    t = out.get("output_type")
    if t == "stream":
        return _text_block(out.get("text", ""))
    if t == "error":
        return _text_block("\n".join(out.get("traceback", [])))
    data = out.get("data", {})
    for mime, ext in (("image/png", "png"), ("image/jpeg", "jpg"), ("image/svg+xml", "svg")):
        if mime in data:
            name = f"{stem}_files/output_{n}.{ext}"
            raw = data[mime]
            files[name] = (
                raw.encode() if ext == "svg" else base64.b64decode(raw if isinstance(raw, str) else "".join(raw))
            )
            return f"![output]({name}){{ .nb-output }}"
    if "text/markdown" in data:
        return f'<div class="nb-output" markdown>\n\n{data["text/markdown"].strip()}\n\n</div>'
    if "text/html" in data:
        return f'<div class="nb-output" markdown="0">\n{data["text/html"].strip()}\n</div>'
    if "text/plain" in data:
        return _text_block(data["text/plain"])
    return ""


def _text_block(text):
    text = ANSI.sub("", text).rstrip("\n")
    if not text.strip():
        return ""
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{fence} {{ .text .nb-output }}\n{text}\n{fence}"


TEXT_MACRO = re.compile(r"\\(text|texttt|textrm|textit)\{([^{}]*)\}")


def _text_underscores(src):
    "`\\_` inside `\\text{..}` of an equation as `_`, outside code: Jupyter's markdown unescapes it before MathJax sees it, MathJax would print the backslash."
    parts = re.split(r"(```.*?```|`[^`\n]*`)", src, flags=re.S)
    fix = lambda m: f"\\{m.group(1)}{{{m.group(2).replace(chr(92) + '_', '_')}}}"
    return "".join(p if i % 2 else TEXT_MACRO.sub(fix, p) for i, p in enumerate(parts))


def notebook_markdown(path, nb, lib):
    "The page of notebook `path` (parsed `nb`) as Markdown, its files ({relative path: bytes}) and API entries [(name, page anchor)]."
    files, api, parts, n = {}, [], [], 0
    mod = next(
        (
            m.group(1)
            for c in nb.cells
            if c.cell_type == "code"
            for m in [re.search(r"^#\|\s*default_exp\s+(\S+)", c.source, re.M)]
            if m
        ),
        None,
    )
    slug = _slugify()
    for c in nb.cells:
        if c.cell_type == "markdown":
            src = re.sub(r"(\]\(\s*<?)([^)\s>:#]+)\.ipynb", r"\1\2.md", c.source)  # links to notebooks -> pages
            lines = src.strip().split("\n")
            if m := CALLOUT_OPEN.match(lines[0]):
                title = next((l.lstrip("#").strip() for l in lines[1:] if l.startswith("#")), m.group(1).capitalize())
                body = "\n".join(l for l in lines[1:] if l.lstrip("#").strip() != title or not l.startswith("#"))
                title = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(title, quote=False))  # <summary> is HTML
                opened = "" if 'collapse="true"' in m.group(2) else " open"
                parts.append(f'<details class="{m.group(1)}" markdown{opened}>\n<summary>{title}</summary>')
                src = body
            elif CALLOUT_CLOSE.match(src.strip()):
                parts.append("</details>")
                continue
            parts.append(_text_underscores(src))
            continue
        if c.cell_type != "code":
            continue
        ds = _directives(c.source)
        if any(re.match(r"#\|\s*hide\b", d) for d in ds):
            continue
        echo = not any(re.match(r"#\|\s*echo:\s*false", d) for d in ds)
        show_out = not any(re.match(r"#\|\s*output:\s*false", d) for d in ds)
        src = _strip_directives(c.source)
        if src and echo:
            parts.append(f"```python\n{src}\n```")
        if show_out:
            for o in c.get("outputs", []):
                n += 1
                md = _output_markdown(o, path.stem, n, files)
                if md:
                    parts.append(md)
        if mod and any(re.match(r"#\|\s*(export|exports)\b", d) for d in ds):
            module = importlib.import_module(f"{lib}.{mod}")
            for name in _api_names(src):
                obj = module
                for part in name.split("."):
                    obj = getattr(obj, part)
                parts.append(api_entry(obj, name))
                api.append((name, f"{path.stem}.md#{slug(name, '-')}"))
    return "\n\n".join(parts) + "\n", files, api


def nav_from_sidebar(entries, titles, extra=()):
    "MkDocs `nav` from the `_quarto.yml` sidebar entries [(section or None, 'x.ipynb')], pages that exist only."
    nav, sections = [], {}
    for section, name in entries:
        stem = Path(name).stem
        if stem not in titles:
            continue
        item = {("Home" if stem == "index" else titles[stem]): f"{stem}.md"}
        if section is None:
            nav.append(item)
        else:
            if section not in sections:
                sections[section] = []
                nav.append({section: sections[section]})
            sections[section].append(item)
    return nav + list(extra)


def build_site(nbs_dir=NBS, out_dir=OUT, quarto_yml=None, log=print, src_dir=None, lib="dapo_ref"):
    "Notebooks of `nbs_dir` -> Markdown in `src_dir` -> MkDocs Material site in `out_dir`; return the number of problems."
    t0 = time.time()
    nbs_dir, out_dir = Path(nbs_dir), Path(out_dir)
    src_dir = Path(src_dir) if src_dir else out_dir.parent / "_proc" / "site"
    shutil.rmtree(src_dir, ignore_errors=True)
    src_dir.mkdir(parents=True)
    nbs = sorted(p for p in nbs_dir.glob("*.ipynb") if not p.name.startswith("_"))
    entries = sidebar_entries(quarto_yml) if quarto_yml and Path(quarto_yml).exists() else [(None, p.name) for p in nbs]
    failed = 0
    for section, name in entries:
        if not (nbs_dir / name).exists():
            log(f"docs: {Path(quarto_yml).name}: sidebar entry {name} does not exist in {nbs_dir.name}/")
            failed += 1
    listed = {Path(n).name for _, n in entries}
    for p in nbs:
        if p.name not in listed:
            log(f"docs: note: {p.name} is not in the sidebar of _quarto.yml (add it there)")
    titles, api = {}, []
    for p in nbs:
        try:
            nb = nbformat.read(p, as_version=4)
            probs = problems(p, nb)
            md, files, entries_api = notebook_markdown(p, nb, lib)
            (src_dir / f"{p.stem}.md").write_text(md, encoding="utf-8")
            for rel, data in files.items():
                (src_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (src_dir / rel).write_bytes(data)
            for t in _local_images(nb):  # images next to the notebook go next to the page
                f = p.parent / t.split("#")[0].split("?")[0]
                if f.is_file() and f.resolve().is_relative_to(p.parent.resolve()):
                    (src_dir / t).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, src_dir / t)
            titles[p.stem] = _title(nb, p.stem)
            api += [(p.stem, n, a) for n, a in entries_api]
        except Exception as e:
            probs = [f"rendering failed: {type(e).__name__}: {e}"]
        for pr in probs:
            log(f"docs: {p.relative_to(nbs_dir.parent)}: {pr}")
        failed += bool(probs)
    extra = []
    if api:
        lines = [
            "# API reference",
            "",
            "Every function and class the notebooks export, by module, linked to its entry "
            "(signature, docstring and argument table) on the page that defines it.",
            "",
        ]
        for stem in dict.fromkeys(s for s, _, _ in api):
            lines += ["", f"## {titles.get(stem, stem)}", ""] + [f"- [`{n}`]({a})" for s, n, a in api if s == stem]
        (src_dir / "api.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        extra = [{"API reference": "api.md"}]
    shutil.copyfile(ROOT / "docs" / "extra.css", src_dir / "extra.css")
    cfg = {
        "INHERIT": str(ROOT / "mkdocs.yml"),
        "docs_dir": str(src_dir),
        "site_dir": str(out_dir.resolve()),
        "theme": {"name": "material", "custom_dir": str(ROOT / "docs" / "overrides")},
        "nav": nav_from_sidebar(entries, titles, extra),
    }
    cfg_path = src_dir.parent / f"mkdocs-{src_dir.name}.yml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--clean", "-f", str(cfg_path)], capture_output=True, text=True
    )
    warnings = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith(("WARNING", "ERROR"))]
    for w in warnings:
        log(f"docs: mkdocs: {w}")
    if r.returncode:
        log(f"docs: mkdocs build failed:\n{r.stderr[-3000:]}")
        return failed + 1
    copy_mathjax(out_dir)
    log(
        f"docs: built {len(titles)} notebook pages{' and the API reference' if api else ''} ({len(api)} entries) into "
        f"{out_dir.name}/ with MkDocs Material in {time.time() - t0:.0f} s, {failed + len(warnings)} problem(s) "
        "(`nbdev_docs` builds the Quarto site where Quarto is installed)"
    )
    return failed + len(warnings)


render_all = build_site


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    failed = build_site(NBS, OUT, ROOT / "_quarto.yml", src_dir=SRC)
    if failed:
        print("docs check failed: fix the notebooks named above")
        sys.exit(1)
    print(f"docs: open the site with `python -m http.server -d {OUT.name}` and http://localhost:8000/")
    if "--no-browser" in argv:
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import browser_check

    sys.exit(browser_check.main([str(OUT)]))


if __name__ == "__main__":
    main()
