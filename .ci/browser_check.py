"""Browser check of the docs site (_docs/, built with MkDocs Material by .ci/check_docs.py): a reader's path in headless Chromium.

Served from 127.0.0.1 (nothing else is reachable offline, and nothing else may be requested), the check
- opens the home page, types "Clip-Higher" into the search box and follows the first hit, which must be the loss page;
- goes back home and clicks through the left sidebar from the first page to the last, one click per page;
- opens directly any page the sidebar does not list.
Every page it lands on must load with no console error, uncaught exception or failed request, and request nothing
from another host; every image loads (`naturalWidth > 0`); its equations are typeset (every TeX source became
MathJax output, no MathJax error box, no raw `$$` or TeX command left in the visible text, code blocks aside); and
every internal link (another page, a file, an `#anchor`) resolves to an existing file and element id.
It saves screenshots of the home, loss, trainer and ablation pages under _docs/screenshots/ and prints their paths.

Chromium is Debian's `chromium` (/usr/bin/chromium, or $CHROMIUM), driven over the DevTools protocol with
`websocket-client`. Without it the check says it skipped and passes, unless DOCS_BROWSER_REQUIRED=1 (set by .ci/run).
Usage: python .ci/browser_check.py [DOCS_DIR] [PAGE.html ...]
"""

import json, os, re, shutil, subprocess, sys, tempfile, threading, time, urllib.parse
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-dev-shm-usage",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-port=0",
]
SCREENSHOTS = ("index", "04_loss", "09_algorithm", "14_ablation")  # home, loss, Algorithm 1 and ablation pages
SEARCH = ("Clip-Higher", "04_loss.html")  # what a reader searches for, and the page its first hit must open
WIDTH, HEIGHT, MAX_SHOT_HEIGHT = 1280, 900, 6000
PAGE_TIMEOUT = 60.0  # seconds for one page to load and typeset

# Runs in the page once it has loaded and MathJax has finished: what the checks need, as JSON.
AUDIT_JS = r"""
(() => {
  const skip = 'pre, code, script, style, textarea, .MathJax, .MathJax_Display, .MathJax_Preview';
  const textOf = (root) => {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT,
      {acceptNode: n => (n.parentElement && n.parentElement.closest(skip)) ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT});
    let t = '';
    while (walker.nextNode()) t += walker.currentNode.nodeValue + '\n';
    return t;
  };
  const raw = [];
  // a $$ left anywhere outside code; a TeX command left in the prose of a markdown cell
  for (const m of textOf(document.body).matchAll(/[^\n]{0,30}\$\$[^\n]{0,30}/g)) raw.push(m[0].trim());
  // the prose of the page: markdown cells (a cell's output may show TeX source on purpose, as the reward table does)
  const prose = [...document.querySelectorAll('article.md-content__inner')].map(a => {
    const c = a.cloneNode(true); c.querySelectorAll('.nb-output').forEach(e => e.remove()); return textOf(c); }).join('\n');
  for (const m of prose.matchAll(/[^\n]{0,30}\\(frac|sum|mathbb|mathrm|mathcal|hat|left|right|text|epsilon|varepsilon|cdot|begin|end|operatorname|sqrt|le|ge|min|max)\b[^\n]{0,30}/g))
    raw.push(m[0].trim());
  const scripts = [...document.querySelectorAll('script[type^="math/tex"]')];
  const typeset = scripts.filter(s => { const p = s.previousElementSibling;
    return p && p.matches('.MathJax, .MathJax_Display, .MathJax_CHTML, .MathJax_SVG, .MathJax_SVG_Display'); }).length;
  const errors = [...document.querySelectorAll('.MathJax .merror, .MathJax_Error, .MathJax .noError, #MathJax_Message:not(:empty)')]
    .map(e => e.textContent.slice(0, 80));
  // a backslash in typeset output is a macro MathJax printed instead of running, e.g. \_ inside \text{} or \texttt{}
  for (const s of scripts) {
    const p = s.previousElementSibling;
    if (p && p.textContent.includes('\\') && !/\\(backslash|setminus)/.test(s.textContent))
      errors.push('macro printed literally in ' + s.textContent.slice(0, 80));
  }
  return JSON.stringify({
    title: document.title,
    images: [...document.images].map(i => ({src: (i.getAttribute('src') || '').slice(0, 60), ok: i.complete && i.naturalWidth > 0})),
    math: {sources: scripts.length, typeset, rendered: document.querySelectorAll('.MathJax, .MathJax_Display, mjx-container').length,
           errors, mathjax: !!(window.MathJax && window.MathJax.Hub)},
    raw: raw.slice(0, 5),
    ids: [...document.querySelectorAll('[id], a[name]')].map(e => e.id || e.getAttribute('name')),
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
    height: Math.ceil(document.documentElement.scrollHeight),
  });
})()
"""

# Resolves when MathJax (if the page loads it) has typeset the page and the web fonts are in.
WAIT_MATHJAX_JS = r"""
(async () => {
  const t0 = Date.now();
  const usesMJ = !!document.querySelector('script[src*="MathJax.js"]');
  if (!usesMJ) return 'no MathJax on the page';
  while (!(window.MathJax && window.MathJax.isReady) && Date.now() - t0 < %d) await new Promise(r => setTimeout(r, 50));
  if (!(window.MathJax && window.MathJax.isReady)) return 'MathJax did not start';
  await new Promise(r => MathJax.Hub.Queue(r));
  await document.fonts.ready;
  return 'ok';
})()
"""


class CDP:
    "A minimal DevTools-protocol client over one browser websocket (flattened target sessions)."

    def __init__(self, ws_url):
        import websocket  # websocket-client

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id, self.events = 0, []

    def _recv(self, deadline):
        self.ws.settimeout(max(0.05, deadline - time.monotonic()))
        return json.loads(self.ws.recv())

    def send(self, method, params=None, session=None, timeout=30.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method}: no answer in {timeout:.0f} s")
            m = self._recv(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error'].get('message')}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def wait_event(self, name, session, timeout):
        "Wait for event `name` of `session` (buffered ones first); return its params."
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e["method"] == name and e.get("sessionId") == session:
                    return self.events.pop(i)["params"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not come in {timeout:.0f} s")
            m = self._recv(deadline)
            if "method" in m:
                self.events.append(m)

    def evaluate(self, expr, session, timeout=30.0):
        r = self.send(
            "Runtime.evaluate",
            {"expression": expr, "awaitPromise": True, "returnByValue": True},
            session,
            timeout=timeout,
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    def close(self):
        try:
            self.ws.close()
        except Exception:
            pass


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


def serve(docs):
    "Serve `docs` on 127.0.0.1 (a free port) in a thread; return (server, base url)."
    srv = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(docs)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def start_chromium(profile):
    "Start headless Chromium with a fresh profile; return (process, browser websocket url)."
    log = open(Path(profile) / "chromium.log", "wb")
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    port_file, deadline = Path(profile) / "DevToolsActivePort", time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if port_file.exists():
            lines = port_file.read_text().split()
            if len(lines) >= 2:
                return proc, f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        time.sleep(0.05)
    tail = (Path(profile) / "chromium.log").read_text(errors="replace")[-2000:]
    stop_chromium(proc)
    raise RuntimeError(f"chromium did not start (exit code {proc.poll()}):\n{tail}")


def stop_chromium(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)  # its own session: the browser and its child processes, nothing else
        except ProcessLookupError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def _is_external(url):
    return not url.startswith(("data:", "blob:", "about:", "chrome-error:", "devtools:")) and urllib.parse.urlsplit(
        url
    ).hostname not in ("127.0.0.1", None)


def land(cdp, session, action, timeout=PAGE_TIMEOUT):
    "Do `action()` (a navigation or a click; it returns an error text or None), wait for the new page to load and typeset; return (audit dict, console/network problems)."
    cdp.events = [e for e in cdp.events if e.get("sessionId") != session]
    err = action()
    if err:
        return None, [err]
    cdp.wait_event("Page.loadEventFired", session, timeout)
    state = cdp.evaluate(WAIT_MATHJAX_JS % int(timeout * 1000 / 2), session, timeout=timeout)
    audit = json.loads(cdp.evaluate(AUDIT_JS, session))
    time.sleep(0.05)
    cdp.send("Runtime.evaluate", {"expression": "0"}, session)  # pulls in events that came in meanwhile
    errs = [] if state in ("ok", "no MathJax on the page") else [state]
    for e in cdp.events:
        if e.get("sessionId") != session:
            continue
        m, p = e["method"], e["params"]
        if m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            errs.append(
                "console."
                + p["type"]
                + ": "
                + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])[:200]
            )
        elif m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            errs.append(f"uncaught exception: {(d.get('exception') or {}).get('description', d.get('text'))[:200]}")
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            errs.append(
                f"console error ({p['entry']['source']}): {p['entry']['text'][:160]} {p['entry'].get('url', '')}"
            )
        elif m == "Network.requestWillBeSent" and _is_external(p["request"]["url"]):
            errs.append(f"request to another host (the docs must work offline): {p['request']['url'][:120]}")
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            errs.append(f"request failed: {p.get('errorText')} ({p.get('type', '')})")
        elif m == "Network.responseReceived" and p["response"]["status"] >= 400:
            errs.append(f"HTTP {p['response']['status']}: {p['response']['url'][:120]}")
    cdp.events = [e for e in cdp.events if e.get("sessionId") != session]
    return audit, list(dict.fromkeys(errs))


def check_page(cdp, session, url, timeout=PAGE_TIMEOUT):
    "Load `url` in the tab `session`; return (audit dict, list of console/network problems)."

    def go():
        r = cdp.send("Page.navigate", {"url": url}, session)
        return f"navigation failed: {r['errorText']}" if r.get("errorText") else None

    return land(cdp, session, go, timeout)


def click(cdp, session, js_find, timeout=PAGE_TIMEOUT):
    "Click the element the expression `js_find` returns (as a reader would) and check the page it opens."

    def go():
        found = cdp.evaluate(
            f"(() => {{ const el = {js_find}; if (!el) return false; el.click(); return true; }})()", session
        )
        return None if found else f"nothing to click: {js_find}"

    return land(cdp, session, go, timeout)


# Types the query into MkDocs Material's search box and waits for the hits: JSON {hits: [href, ...]}.
SEARCH_JS = r"""
(async (q) => {
  const input = document.querySelector('input.md-search__input');
  if (!input) return JSON.stringify({error: 'no search box on the page'});
  input.focus(); input.value = q;
  for (const ev of ['focus', 'input', 'keyup']) input.dispatchEvent(new Event(ev, {bubbles: true}));
  const t0 = Date.now();
  let hits = [];
  while (Date.now() - t0 < 20000) {
    hits = [...document.querySelectorAll('a.md-search-result__link')];
    if (hits.length) break;
    await new Promise(r => setTimeout(r, 100));
  }
  return JSON.stringify({hits: hits.map(a => a.getAttribute('href')).slice(0, 5)});
})(%s)
"""

SIDEBAR_JS = r"""JSON.stringify([...document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]')]
  .map(a => a.href.split('#')[0]).filter((h, i, all) => all.indexOf(h) === i && h.endsWith('.html')))"""


def content_problems(audit):
    "Images, equations and raw TeX of one page's audit."
    probs = [f"image did not load: {i['src']!r}" for i in audit["images"] if not i["ok"]]
    m = audit["math"]
    if m["sources"] and not m["mathjax"]:
        probs.append("MathJax is not loaded, equations are not typeset")
    if m["typeset"] < m["sources"]:
        probs.append(f"only {m['typeset']} of {m['sources']} equations were typeset")
    probs += [f"MathJax error: {e!r}" for e in m["errors"]]
    probs += [f"raw TeX left in the text: {t!r}" for t in audit["raw"]]
    return probs


def link_problems(pages, docs, base):
    "Internal links of every checked page: the file must exist under `docs`, the #anchor must be an element id there."
    ids = {name: set(a["ids"]) for name, a in pages.items()}
    out = {}
    for name, a in pages.items():
        probs = []
        for href in dict.fromkeys(a["links"]):
            url = urllib.parse.urljoin(base + name, href)
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or parts.netloc != urllib.parse.urlsplit(base).netloc:
                continue
            rel = urllib.parse.unquote(parts.path).lstrip("/") or "index.html"
            if rel.endswith("/"):
                rel += "index.html"
            f = docs / rel
            if not f.is_file():
                probs.append(f"broken link {href!r}: {rel} does not exist")
                continue
            if not parts.fragment:
                continue
            if rel in ids:
                target_ids = ids[rel]
            elif f.suffix == ".html":
                target_ids = set(re.findall(r'\b(?:id|name)="([^"]+)"', f.read_text(errors="replace")))
            else:
                continue
            if parts.fragment not in target_ids and urllib.parse.unquote(parts.fragment) not in target_ids:
                probs.append(
                    f"broken link {href!r}: no element with id {urllib.parse.unquote(parts.fragment)!r} in {rel}"
                )
        out[name] = probs
    return out


def screenshot(cdp, session, path, height):
    "Save a PNG of the whole page (at most MAX_SHOT_HEIGHT css pixels tall) to `path`."
    h = max(HEIGHT, min(height, MAX_SHOT_HEIGHT))
    cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": h, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    import base64

    data = cdp.send("Page.captureScreenshot", {"format": "png"}, session, timeout=60)["data"]
    cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        session,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(data))
    return path


def _page(url, base):
    "The site-relative file of `url` (index.html for the folder)."
    rel = urllib.parse.unquote(urllib.parse.urlsplit(url).path)[len(urllib.parse.urlsplit(base).path) :]
    return rel if rel and not rel.endswith("/") else rel + "index.html"


def run_check(docs, names=None, shots=SCREENSHOTS, search=SEARCH, log=print):
    "Follow a reader through the site in `docs` (search, then the sidebar), then open the pages `names` not reached (default: every top-level page); return ({page: [problems]}, screenshot paths)."
    docs = Path(docs).resolve()
    names = names or sorted(p.name for p in docs.glob("*.html") if p.name != "404.html")
    if not names:
        return {"(none)": [f"no pages in {docs}"]}, []
    srv, base = serve(docs)
    profile = tempfile.mkdtemp(prefix="dapo-docs-chromium-")
    proc, cdp, pages, problems, shot_paths = None, None, {}, {}, []
    t_start = time.perf_counter()

    def record(name, audit, errs, how, t0):
        if audit is not None:
            pages[name] = audit
            errs = errs + content_problems(audit)
            if Path(name).stem in shots and not any(p.stem == Path(name).stem for p in shot_paths):
                shot_paths.append(screenshot(cdp, s, docs / "screenshots" / f"{Path(name).stem}.png", audit["height"]))
        problems[name] = problems.get(name, []) + [e for e in errs if e not in problems.get(name, [])]
        pages.setdefault(name, None)
        info = (
            (
                f"{len(audit['images'])} images, {audit['math']['typeset']}/{audit['math']['sources']} equations typeset, "
                f"{len(audit['links'])} links"
            )
            if audit
            else "not loaded"
        )
        log(f"browser: {name} ({how}): {'ok' if not errs else 'FAILED'} ({info}; {time.perf_counter() - t0:.1f} s)")

    def here():
        return _page(cdp.evaluate("location.href", s), base)

    try:
        proc, ws = start_chromium(profile)
        cdp = CDP(ws)
        target = cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            cdp.send(m, {}, s)
        cdp.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
            s,
        )
        home = "index.html" if "index.html" in names else names[0]
        t0 = time.perf_counter()
        audit, errs = check_page(cdp, s, base + home)
        record(home, audit, errs, "home", t0)
        # 1. search, and follow the first hit
        if search and audit is not None:
            query, expected = search
            t0 = time.perf_counter()
            res = json.loads(cdp.evaluate(SEARCH_JS % json.dumps(query), s, timeout=40))
            if res.get("error") or not res.get("hits"):
                problems.setdefault("search", []).append(
                    f"searching {query!r} found nothing ({res.get('error', 'no hits')})"
                )
            else:
                audit, errs = click(cdp, s, "document.querySelector('a.md-search-result__link')")
                got = here()
                if got != expected:
                    problems.setdefault("search", []).append(
                        f"the first hit for {query!r} opened {got}, not {expected}"
                    )
                record(got, audit, errs, f"first search hit for {query!r}", t0)
                log(f"browser: search {query!r}: {len(res['hits'])}+ hits, first {res['hits'][0]} -> {got}")
            check_page(cdp, s, base + home)
        # 2. the sidebar, first page to last, one click each
        sidebar = [_page(u, base) for u in json.loads(cdp.evaluate(SIDEBAR_JS, s))] if audit is not None else []
        if home in sidebar:
            sidebar.remove(home)
        for name in sidebar:
            t0 = time.perf_counter()
            try:
                audit, errs = click(
                    cdp,
                    s,
                    f"[...document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]')]"
                    f".find(a => a.href.split('#')[0] === {json.dumps(base + name)})",
                )
                if audit is not None and here() != name:
                    errs = errs + [f"the sidebar link opened {here()}"]
            except Exception as e:
                audit, errs = None, [f"check failed: {type(e).__name__}: {e}"]
            record(name, audit, errs, "sidebar", t0)
        if sidebar:
            log(f"browser: sidebar: clicked through {len(sidebar)} pages, {sidebar[0]} to {sidebar[-1]}")
        # 3. pages the reader's path did not reach
        for name in names:
            if name in pages:
                continue
            t0 = time.perf_counter()
            try:
                audit, errs = check_page(cdp, s, base + name)
            except Exception as e:
                audit, errs = None, [f"check failed: {type(e).__name__}: {e}"]
            record(name, audit, errs, "opened directly", t0)
        for name, probs in link_problems({k: v for k, v in pages.items() if v}, docs, base).items():
            if probs and not problems[name]:
                log(f"browser: {name}: FAILED (links)")
            problems[name] += probs
    finally:
        if cdp is not None:
            try:
                cdp.send("Browser.close", timeout=5)
            except Exception:
                pass
            cdp.close()
        if proc is not None:
            stop_chromium(proc)
        srv.shutdown()
        srv.server_close()
        shutil.rmtree(profile, ignore_errors=True)
    for st in shots:
        if f"{st}.html" in names and not any(p.stem == st for p in shot_paths):
            problems.setdefault(f"{st}.html", []).append("no screenshot was saved")
    failed = [n for n in problems if problems[n]]
    for n in failed:
        for p in problems[n]:
            log(f"browser: {n}: {p}")
    for p in shot_paths:
        log(f"browser: screenshot {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}")
    log(
        f"browser check: {len(pages)} pages checked in headless Chromium ({', '.join(Path(n).stem for n in pages)}), "
        f"{len(failed)} failed, {time.perf_counter() - t_start:.0f} s"
    )
    return problems, shot_paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    docs = Path(argv[0]) if argv else ROOT / "_docs"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        required = os.environ.get("DOCS_BROWSER_REQUIRED", "") not in ("", "0")
        print(
            f"browser check: {'FAILED' if required else 'skipped'}: no Chromium at {CHROMIUM} "
            "(Debian: apt-get install chromium; .ci/run installs it)"
        )
        return 1 if required else 0
    try:
        import websocket  # noqa: F401
    except ImportError:
        print("browser check failed: the websocket-client package is missing: pip install websocket-client")
        return 1
    problems, _ = run_check(docs, argv[1:] or None)
    if any(problems.values()):
        print("browser check failed: fix the pages named above (open them from _docs/ in a browser to see)")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
