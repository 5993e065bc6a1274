"""The documentation site: ``mkdocs build --strict`` succeeds, and the built site works in a
real headless browser (Debian's chromium, driven over the DevTools protocol on a pipe).

The browser tests skip, saying why, where no chromium is installed (``make test`` installs
it where it runs as root with apt-get: scripts/install_chromium.sh) or the docs tools are
missing (``pip install "polytrain[docs]"``).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _docs_tools_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            __import__(module)
        except ImportError:
            return f'{module} is not installed: pip install "polytrain[docs]"'
    return None


pytestmark = pytest.mark.skipif(
    _docs_tools_missing() is not None, reason=str(_docs_tools_missing())
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for the module with ``mkdocs build --strict``."""
    out = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_strict_build_writes_every_page(site):
    # Every page of the nav was built (a page missing from the nav, a broken link or anchor,
    # a reference mkdocstrings cannot resolve all fail --strict above).
    for page in (
        "index.html",
        "quickstart/index.html",
        "trainer/index.html",
        "own-loop/index.html",
        "failures/index.html",
        "multi-node/index.html",
        "migration/raysgd/index.html",
        "migration/ray-lightning/index.html",
        "migration/ray-train/index.html",
        "api/trainers/index.html",
        "api/train/index.html",
        "api/lightning/index.html",
        "benchmarks/index.html",
    ):
        assert (site / page).is_file(), page
    assert (site / "assets" / "benchmarks.png").stat().st_size > 10_000
    api = (site / "api" / "trainers" / "index.html").read_text()
    assert 'id="polytrain.TorchTrainer"' in api
    assert "Train a PyTorch model on Ray workers with any torch backend." in api
    index = json.loads((site / "search" / "search_index.json").read_text())
    titles = {doc["title"] for doc in index["docs"]}
    assert {"Checkpoints", "Failures and preemption", "Migrating from RaySGD"} <= titles


def test_readme_links_every_docs_page():
    # The README is the landing page: it links each page of the site.
    readme = (REPO_ROOT / "README.md").read_text()
    pages = sorted(
        p.relative_to(REPO_ROOT).as_posix()
        for p in (REPO_ROOT / "docs").rglob("*.md")
        if p.parent.name != "api" and p.name != "index.md"
    )
    missing = [p for p in pages if f"]({p})" not in readme]
    assert not missing, f"README.md does not link {missing}"
    assert "](docs/api/index.md)" in readme


# ------------------------------------------------------------------ the browser


def _find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """Headless chromium driven over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out)."""

    def __init__(self, executable: str, profile: Path):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # in the child, before exec: the protocol's fds are 3 and 4
            high_r, high_w = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        args = [
            executable,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",  # root in a container has no user namespaces for the sandbox
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            preexec_fn=wire_fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=self.session)
        self.call("Runtime.enable", session=self.session)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, timeout: float = 20, **params):
        self._next_id += 1
        request = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = session
        os.write(self._to_child, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def goto(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=self.session, url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str):
        result = self.call(
            "Runtime.evaluate",
            session=self.session,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20):
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout} s: {expression}")
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)


@pytest.fixture(scope="module")
def server(site):
    """The built site on http://127.0.0.1:<free port>/ (what ``python -m http.server`` does)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = _find_browser()
    if executable is None:
        pytest.skip(
            "no chromium (looked for " + ", ".join(BROWSERS) + "); "
            "bash scripts/install_chromium.sh installs Debian's as root"
        )
    b = Browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def test_home_page_renders(server, browser):
    browser.goto(server + "/")
    assert "polytrain" in browser.evaluate("document.title")
    # Material's JavaScript ran: it publishes document$ and builds the search form.
    browser.wait_for("typeof document$ !== 'undefined'")
    assert browser.evaluate("!!document.querySelector('form.md-search__form')")
    assert browser.evaluate("document.querySelector('h1').textContent").startswith("polytrain")
    nav = browser.evaluate(
        "Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link'))"
        ".map(a => a.textContent.trim())"
    )
    for title in ("Quick start", "The trainer", "Backends", "Checkpoints", "Benchmarks"):
        assert title in nav, nav
    assert "One trainer API, every distributed backend" in browser.evaluate(
        "document.body.innerText"
    )


def test_api_page_shows_the_docstrings(server, browser):
    browser.goto(server + "/api/trainers/")
    heading = browser.wait_for("document.getElementById('polytrain.TorchTrainer')?.textContent")
    assert "TorchTrainer" in heading
    text = browser.evaluate("document.querySelector('article').innerText")
    assert "Train a PyTorch model on Ray workers with any torch backend." in text
    assert "model_creator" in text and "TFTrainer" in text


def test_search_finds_pages(server, browser):
    # Material opens the search with ?q= and runs lunr in a web worker over search_index.json.
    browser.goto(server + "/?q=checkpoint")
    results = browser.wait_for(
        "Array.from(document.querySelectorAll('.md-search-result__item')).map(li => li.innerText)",
        timeout=30,
    )
    assert any("Checkpoints" in r for r in results), results
    meta = browser.evaluate("document.querySelector('.md-search-result__meta').innerText")
    assert "matching document" in meta, meta
    # A word in no page finds nothing: the results above come from the index.
    browser.goto(server + "/?q=zzqxjvunfindable")
    meta = browser.wait_for(
        "(() => { const m = document.querySelector('.md-search-result__meta');"
        " return m && /No matching/.test(m.innerText) && m.innerText; })()",
        timeout=30,
    )
    assert browser.evaluate("document.querySelectorAll('.md-search-result__item').length") == 0
