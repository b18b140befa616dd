"""The docs site: it builds with warnings as errors, and every page of it opens in a real headless browser.

The site is built (incrementally, after ``make docs`` only what changed) into ``docs/_build/html`` and served on
127.0.0.1; Debian's Chromium, driven through its ChromeDriver by selenium, opens each page once. The tests then
check what the browser saw: no page logs an error (a script that fails, a file that does not load), every image
is drawn, every internal link reaches an existing file and, for a ``#fragment``, an element of that id, and MathJax
typeset every formula without an error. ``make browser`` (part of ``make test``) installs Chromium and ChromeDriver
with apt-get where they are missing; without them these tests fail, saying so.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import importlib
import pathlib
import pprint
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SITE = DOCS / "_build" / "html"
PUBLIC_MODULES = ("optax_sparse_adam", "optax_sparse_adam.nnx", "optax_sparse_adam.linen")

# Collects, once MathJax (where the page has it) has typeset the page, what the tests check.
PAGE_SCRIPT = """
const done = arguments[arguments.length - 1];
const report = (error) => done({
  title: document.title,
  h1: document.querySelectorAll("article h1").length,
  links: Array.from(document.querySelectorAll("a[href]"), (a) => a.href),
  ids: Array.from(document.querySelectorAll("[id]"), (e) => e.id)
    .concat(Array.from(document.querySelectorAll("a[name]"), (e) => e.name)),
  broken_images: Array.from(document.images).filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.src),
  math: document.querySelectorAll(".math").length,
  typeset: Array.from(document.querySelectorAll(".math")).filter((e) => e.querySelector("mjx-container svg")).length,
  math_errors: document.querySelectorAll('[data-mml-node="merror"], mjx-merror').length,
  mathjax_error: error || null,
});
if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
  window.MathJax.startup.promise.then(() => report(null), (e) => report(String(e)));
} else {
  report(document.querySelector(".math") ? "the page has math but MathJax did not start" : null);
}
"""


@dataclasses.dataclass
class Page:
    title: str
    h1: int
    links: list[str]
    ids: set[str]
    broken_images: list[str]
    math: int
    typeset: int
    math_errors: int
    mathjax_error: str | None
    console_errors: list[str]

    @classmethod
    def empty(cls) -> Page:
        return cls("", 0, [], set(), [], 0, 0, 0, None, [])


def _sphinx_build() -> None:
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(DOCS), str(SITE)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"the docs build failed (warnings are errors):\n{done.stdout}\n{done.stderr}"


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail(
            "the docs test needs Chromium and ChromeDriver on PATH (found chromium: "
            f"{chromium}, chromedriver: {driver}); `make browser` installs Debian's packages "
            "(apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    return chromium, driver


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> pathlib.Path:
    _sphinx_build()
    return SITE


@pytest.fixture(scope="module")
def server(site: pathlib.Path) -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _html_pages(site: pathlib.Path) -> list[str]:
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if not p.relative_to(site).parts[0].startswith(("_static", "_sources", "_images"))
    )


@pytest.fixture(scope="module")
def pages(site: pathlib.Path, server: str) -> dict[str, Page]:
    """Every HTML page of the site, as the browser saw it."""
    chromium, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    seen: dict[str, Page] = {}
    try:
        for path in _html_pages(site):
            driver.get(server + path)
            data = driver.execute_async_script(PAGE_SCRIPT)
            errors = [
                e["message"]
                for e in driver.get_log("browser")
                if e["level"] == "SEVERE" and "/favicon.ico " not in e["message"]  # the browser's own request
            ]
            seen[path] = Page(**{**data, "ids": set(data["ids"]), "console_errors": errors})
    finally:
        driver.quit()
    return seen


REQUIRED_PAGES = ("index.html", "getting_started.html", "which_path.html", "api.html", "gallery/index.html")
# Pages whose math must be there: a docstring's ``.. math::``, a guide's ``$$``, a notebook's ``$``.
MATH_PAGES = (
    "_autosummary/optax_sparse_adam.sparse_adam.html",
    "guides/semantics.html",
    "gallery/word_embeddings.html",
)


def load_problems(pages: dict[str, Page]) -> dict[str, Any]:
    """Pages that log an error, draw an image broken, or lack a title or their one heading."""
    problems: dict[str, Any] = {p: "missing" for p in REQUIRED_PAGES if p not in pages}
    if len(pages) < 40:
        problems["the site"] = f"only {len(pages)} pages"
    for path, p in pages.items():
        if p.console_errors or p.broken_images or not p.title or (p.h1 != 1 and path != "search.html"):
            problems[path] = {"console": p.console_errors, "broken images": p.broken_images, "h1": p.h1}
    return problems


def link_problems(site: pathlib.Path, server: str, pages: dict[str, Page]) -> list[tuple[str, str, str]]:
    """Internal links to a file that does not exist, or to an anchor that its page does not have."""
    broken = []
    for path, page in pages.items():
        for href in page.links:
            if not href.startswith(server):
                continue  # another site, or mailto:
            url = urllib.parse.urlsplit(href)
            target = urllib.parse.unquote(url.path[len(urllib.parse.urlsplit(server).path) :]) or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if not (site / target).is_file():
                broken.append((path, href, "no such file"))
            elif url.fragment and target in pages and urllib.parse.unquote(url.fragment) not in pages[target].ids:
                broken.append((path, href, "no such anchor"))
    return broken


def math_problems(pages: dict[str, Page]) -> dict[str, Any]:
    """Formulas that MathJax did not typeset, or typeset as an error."""
    problems: dict[str, Any] = {p: "no math found" for p in MATH_PAGES if not pages.get(p, Page.empty()).math}
    for path, p in pages.items():
        if p.math and (p.typeset != p.math or p.math_errors or p.mathjax_error):
            problems[path] = {"formulas": p.math, "typeset": p.typeset, "errors": p.math_errors, "js": p.mathjax_error}
    return problems


def api_problems(pages: dict[str, Page]) -> list[str]:
    """Public names without an entry (an element of their full name's id) in the API reference, or not on its
    index page."""
    ids = set().union(*(p.ids for path, p in pages.items() if path.startswith("_autosummary/")))
    index = pages.get("api.html", Page.empty())
    linked = {link.split("#")[-1] for link in index.links if "#" in link}
    missing = []
    for module_name in PUBLIC_MODULES:
        for name in importlib.import_module(module_name).__all__:
            full = f"{module_name}.{name}"
            if full not in ids or full not in linked:
                missing.append(full)
    return missing


def test_site_in_a_browser(site: pathlib.Path, server: str, pages: dict[str, Page]) -> None:
    """Every page loads cleanly, every internal link resolves, the math renders, every public name has its entry.

    One test, so that the site is built and browsed once even when pytest-xdist spreads the tests over workers.
    """
    problems = {
        "pages that do not load cleanly": load_problems(pages),
        "broken internal links": link_problems(site, server, pages),
        "math not typeset": math_problems(pages),
        "public names without an API entry (add them to docs/api.rst)": api_problems(pages),
    }
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, pprint.pformat(problems, width=120)


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def test_getting_started_runs() -> None:
    """The getting-started page's code, block after block, trains and moves only the rows its batch reads."""
    import jax
    import numpy as np

    blocks = _python_blocks((DOCS / "getting_started.md").read_text())
    assert len(blocks) == 2
    scope: dict[str, Any] = {}
    exec(compile(blocks[0], "getting_started.md, the loop", "exec"), scope)
    coll, params, loss = scope["coll"], scope["params"], scope["loss"]
    assert np.isfinite(float(loss))
    fresh = coll.init(jax.random.key(0))
    moved = np.asarray(coll.table(params["emb"], "item") != coll.table(fresh, "item")).any(axis=1)
    assert set(np.flatnonzero(moved)) == {1, 2, 4, 9}
    exec(compile(blocks[1], "getting_started.md, gradients built by hand", "exec"), scope)
    rows = np.flatnonzero(np.asarray(scope["params"]["table"]).any(axis=1))
    assert set(rows.tolist()) == {5, 9}
