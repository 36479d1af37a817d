"""Tests of the docs build and check itself (.ci/check_docs.py, .ci/browser_check.py): it must fail on the pages it exists to catch.

Small notebooks are written to a temporary nbs/ folder, built into a site with the real MkDocs build, and (when
Chromium is installed) walked with the real browser check (search, sidebar, every page): a good page passes; a raw
`$$`, a broken image, a broken link or anchor, a literal TeX macro, a console error and a request to another host
each fail, with a message naming it.
"""

import base64, json, struct, sys, zlib
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

CI = Path(__file__).resolve().parents[1] / ".ci"
sys.path.insert(0, str(CI))
import check_docs, browser_check  # noqa: E402

HAVE_CHROMIUM = Path(browser_check.CHROMIUM).exists()


def _png(w=2, h=2):
    "A valid w x h grey PNG, built by hand."
    raw = b"".join(b"\x00" + b"\x80" * w for _ in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _nb(*cells, title="# page\n\n> a test page"):
    nb = new_notebook(cells=[new_markdown_cell(title), *cells])
    nb.metadata = {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}}
    return nb


def _html_output(html):
    c = new_code_cell("show()")
    c.outputs = [new_output("display_data", data={"text/html": html, "text/plain": "<page>"})]
    return c


def _problems(nb, tmp_path, name="p.ipynb"):
    return check_docs.problems(tmp_path / name, nb)


# --- static checks (no browser) ---


def test_static_good_page_passes(tmp_path):
    (tmp_path / "other.ipynb").write_text("{}")
    (tmp_path / "fig.png").write_bytes(_png())
    nb = _nb(
        new_markdown_cell(
            "Some text:\n\n- a list\n- after a blank line\n\n$$x^2$$ and `$$` in code\n\n"
            "[other](other.ipynb#sec) ![fig](fig.png) [web](https://example.org)"
        ),
        new_code_cell("#| default_exp mod"),
        new_code_cell("#| export\ndef f(): pass"),
    )
    assert _problems(nb, tmp_path) == []


@pytest.mark.parametrize(
    "md, expected",
    [
        ("Display: $$x^2", "unbalanced $$"),
        ("Options:\n- one\n- two", "markdown list needs a blank line above it"),
        ("![plot](missing.png)", "link to missing image missing.png"),
        ('<img src="figs/nope.png">', "link to missing image figs/nope.png"),
        ("see [the loss](99_nothere.ipynb)", "link to missing notebook 99_nothere.ipynb"),
    ],
)
def test_static_checks_flag(tmp_path, md, expected):
    probs = _problems(_nb(new_markdown_cell(md)), tmp_path)
    assert any(expected in p for p in probs), probs


def test_list_inside_display_math_is_not_a_list(tmp_path):
    assert _problems(_nb(new_markdown_cell("$$a\n- b\n$$")), tmp_path) == []


def test_collapsed_callout_across_cells(tmp_path):
    "A Quarto callout opened in one markdown cell and closed by a ':::' cell: one <details> holding the cells between."
    box = [
        new_markdown_cell('::: {.callout-note collapse="true"}\n## The pool, `verify_pairs`\n\nHow it works.'),
        new_code_cell("x = 1"),
        new_markdown_cell(":::"),
    ]
    nb = _nb(*box, new_markdown_cell("After the box."))
    assert _problems(nb, tmp_path) == []
    md, _, _ = check_docs.notebook_markdown(tmp_path / "p.ipynb", nb, "dapo_ref")
    inside = md.split('<details class="note" markdown>')[1].split("</details>")[0]
    assert (
        "<summary>The pool, <code>verify_pairs</code></summary>" in inside
        and "How it works." in inside
        and "x = 1" in inside
    )
    assert "## The pool" not in md and "After the box." in md.split("</details>")[1]
    assert any("never closed" in p for p in _problems(_nb(*box[:2]), tmp_path))
    assert any("closes no callout" in p for p in _problems(_nb(new_markdown_cell(":::")), tmp_path))
    assert any("opens inside another" in p for p in _problems(_nb(box[0], *box), tmp_path))


def test_title_and_export_rules(tmp_path):
    assert any("first cell must be a markdown title" in p for p in _problems(_nb(title="no title"), tmp_path))
    # a docs page with no module: fine without default_exp as long as nothing is exported
    assert _problems(_nb(new_code_cell("1 + 1")), tmp_path) == []
    probs = _problems(_nb(new_code_cell("#| export\ndef f(): pass")), tmp_path)
    assert any("'#| export' cells but no '#| default_exp'" in p for p in probs), probs


def test_sidebar_entries(tmp_path):
    y = tmp_path / "_quarto.yml"
    y.write_text(
        "website:\n  sidebar:\n    contents:\n      - index.ipynb\n      - section: A\n        contents:\n"
        "          - 01_a.ipynb\n          - section: B\n            contents: [02_b.ipynb]\n"
    )
    assert check_docs.sidebar_entries(y) == [(None, "index.ipynb"), ("A", "01_a.ipynb"), ("B", "02_b.ipynb")]


def test_text_underscores_as_jupyter_shows_them():
    src = "$$\\text{max\\_tokens} + a\\_b$$ and `\\text{x\\_y}` in code"
    assert check_docs._text_underscores(src) == "$$\\text{max_tokens} + a\\_b$$ and `\\text{x\\_y}` in code"


def test_api_names_and_entry():
    src = "from x import y\ndef public(a): pass\ndef _private(): pass\nclass Thing: pass\n@patch\ndef step(self: Thing): pass\n"
    assert check_docs._api_names(src) == ["public", "Thing", "Thing.step"]
    from dapo_ref.tiny import tiny_splits

    md = check_docs.api_entry(tiny_splits, "tiny_splits")
    assert "### tiny_splits" in md and "n_train:int, # training prompts" in md  # nbdev's signature with docments
    assert "Distinct train and held-out tiny problems" in md  # the docstring
    assert "| n_eval | int |  | held-out prompts |" in md  # the docments table
    assert "[source]" not in md


# --- rendering and the browser ---


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "A small nbs/ folder rendered to docs/: one good page and one page per defect."
    root = tmp_path_factory.mktemp("site")
    nbs, docs = root / "nbs", root / "docs"
    nbs.mkdir()
    (nbs / "fig.png").write_bytes(_png())
    img = base64.b64encode(_png(3, 3)).decode()
    png_out = new_code_cell("plot()")
    png_out.outputs = [new_output("display_data", data={"image/png": img, "text/plain": "<Figure>"})]
    pages = {
        "index": _nb(
            new_markdown_cell("Welcome: start with [the good page](good.ipynb)."), title="# home\n\n> the home page"
        ),
        "good": _nb(
            new_markdown_cell(
                "## Section one\n\nInline $\\varepsilon_{\\text{high}} = 0.28$ and\n\n"
                "$$\\frac{1}{\\sum_i |o_i|}\\sum_i \\hat{A}_{i}$$\n\n"
                "![fig](fig.png) [again](#section-one) [self](good.ipynb#section-one) "
                "[other](other.ipynb)\n\n```python\nx = 1\n```"
            ),
            png_out,
        ),
        "other": _nb(new_markdown_cell("Back [home](good.ipynb).")),
        "raw_dollars": _nb(new_markdown_cell("It costs $$ 5 per token.")),
        "broken_image": _nb(new_markdown_cell("![gone](gone.png)")),
        "broken_link": _nb(new_markdown_cell("[a page](nothere.ipynb)")),
        "broken_anchor": _nb(new_markdown_cell("[an anchor](good.ipynb#no-such-heading)")),
        "literal_macro": _nb(new_markdown_cell("$$\\text{rate \\times time}(a, o)$$")),
        "console_error": _nb(_html_output("<script>console.error('boom from the page')</script><p>x</p>")),
        "external_request": _nb(_html_output('<img src="http://127.0.0.2:9/x.png" alt="remote">')),
    }
    for name, nb in pages.items():
        nbformat.write(nb, nbs / f"{name}.ipynb")
    logs = []
    failed = check_docs.render_all(nbs, docs, None, log=logs.append)
    return docs, failed, logs


def test_render_offline_assets(site):
    docs, failed, logs = site
    # the static check catches three of the defects, MkDocs the links it cannot resolve; the rest need the browser
    flagged = {l.split(":")[1].strip() for l in logs if l.startswith("docs: nbs/")}
    assert flagged == {"nbs/raw_dollars.ipynb", "nbs/broken_image.ipynb", "nbs/broken_link.ipynb"}, logs
    mk = [l for l in logs if l.startswith("docs: mkdocs: WARNING")]
    assert len(mk) == 3 and any("'good.md#no-such-heading'" in l for l in mk), mk
    assert failed == 6
    html = (docs / "good.html").read_text()
    assert (docs / "mathjax" / "MathJax.js").is_file() and "mathjax/MathJax.js?config=" in html
    import re

    remote = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', html)
    assert remote == [], remote  # no CDN, no web fonts: the pages must work offline
    assert 'href="other.html"' in html and "fig.png" in html and (docs / "fig.png").is_file()
    assert 'class="arithmatex"' in html  # math handed to MathJax
    assert "good_files/output_" in html  # the saved figure output
    index = json.loads((docs / "search" / "search_index.json").read_text())
    assert any("Section one" in d["title"] for d in index["docs"])  # searchable offline, per section


@pytest.mark.skipif(not HAVE_CHROMIUM, reason=f"no Chromium at {browser_check.CHROMIUM} (apt-get install chromium)")
def test_browser_check_catches_each_defect(site, tmp_path):
    docs, _, _ = site
    logs = []
    problems, shots = browser_check.run_check(
        docs, None, shots=("good",), search=("Section one", "good.html"), log=logs.append
    )
    text = "\n".join(logs)
    assert problems["good.html"] == [], text
    assert problems["other.html"] == [] and problems["index.html"] == [], text
    assert [p.name for p in shots] == ["good.png"] and shots[0].stat().st_size > 1000
    expect = {
        "raw_dollars.html": "raw TeX left in the text",
        "broken_image.html": "image did not load",
        "broken_link.html": "broken link 'nothere.md': nothere.md does not exist",
        "broken_anchor.html": "no element with id 'no-such-heading' in good.html",
        "literal_macro.html": "macro printed literally",
        "console_error.html": "console.error: boom from the page",
        "external_request.html": "request to another host",
    }
    for page, msg in expect.items():
        assert any(msg in p for p in problems[page]), (page, problems[page])
    assert "browser check: 10 pages checked" in text and "7 failed" in text
    assert "search 'Section one'" in text and "sidebar: clicked through 9 pages" in text


def test_browser_check_skips_without_chromium(monkeypatch, capsys):
    monkeypatch.setattr(browser_check, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("DOCS_BROWSER_REQUIRED", raising=False)
    assert browser_check.main(["."]) == 0
    assert "browser check: skipped" in capsys.readouterr().out
    monkeypatch.setenv("DOCS_BROWSER_REQUIRED", "1")
    assert browser_check.main(["."]) == 1
    assert "browser check: FAILED" in capsys.readouterr().out


def test_sidebar_entry_missing_fails(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    nbformat.write(_nb(new_markdown_cell("Hello.")), nbs / "index.ipynb")
    y = tmp_path / "_quarto.yml"
    y.write_text("website:\n  sidebar:\n    contents:\n      - index.ipynb\n      - 07_gone.ipynb\n")
    logs = []
    assert check_docs.render_all(nbs, tmp_path / "docs", y, log=logs.append) == 1
    assert any("sidebar entry 07_gone.ipynb does not exist" in l for l in logs), logs
    page = (tmp_path / "docs" / "index.html").read_text()
    assert "md-nav--primary" in page and "07_gone" not in page  # the sidebar links only pages that exist


def test_sidebar_order_comes_from_quarto_yml(tmp_path):
    entries = [(None, "index.ipynb"), ("Part", "02_b.ipynb"), ("Part", "01_a.ipynb"), (None, "03_c.ipynb")]
    titles = {"index": "home", "01_a": "a", "02_b": "b", "03_c": "c"}
    assert check_docs.nav_from_sidebar(entries, titles) == [
        {"Home": "index.md"},
        {"Part": [{"b": "02_b.md"}, {"a": "01_a.md"}]},
        {"c": "03_c.md"},
    ]
