"""The documentation as a reader uses it: every page's code runs, the site builds, it renders.

- **Every Python block runs.** The pages are ``README.md`` and every ``docs/**/*.md``.
  A page's blocks run top to bottom in one directory, as a reader following the page
  runs them: a fresh copy of a directory where ``python -m zephon example-data .`` ran
  (the command the pages name), each block saved to a file and run with ``python
  file.py`` in a fresh interpreter, and each must print something (a block that prints
  nothing shows nothing). A block whose first line is a comment naming a file
  (``# train.py``) is saved under that name; when the name is ``test_*.py`` it is a test
  file and runs with ``python -m pytest``. A block that imports a package that is not
  installed (an extra), or needs one of ``NEEDS``, is skipped, and the rest of the page
  still runs.
- **The site builds** with ``mkdocs build --strict``: a warning (a broken link or anchor,
  a page left out of the nav, an API name mkdocstrings cannot find) fails it. Then every
  link and anchor in the built HTML is followed inside the site (the API reference's
  links too, which the Markdown check does not see).
- **The site renders** in headless Chromium, served over HTTP on 127.0.0.1 as a reader's
  browser gets it: every page's article has its heading and text, the API reference pages
  have their rendered objects, and no page logs a console message. The landing page and
  a how-to page are saved as screenshots (to ``$ZEPHON_DOCS_SCREENSHOTS`` when set).

The build and browser tests skip without the ``docs`` extra (mkdocs) or Chromium.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import html.parser
import importlib.util
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from zephon.example_data import EXAMPLES

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
EXAMPLE_DATA = "python -m zephon example-data ."
NAMED = re.compile(r"#\s*([A-Za-z_][A-Za-z0-9_]*\.py)\s*$")
# substring of a block -> the module it needs, where no import line says so
NEEDS = {'backend="ray"': "ray", '"ray")': "ray", "sources.parquet(": "pyarrow",
         "sources.hf_dataset(": "datasets", "zephon.vision": "simplejpeg",
         "sources.lance(": "lance", "sources.array_record(": "array_record",
         "zephon.torch": "torch"}


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: pathlib.Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def pages_with_code() -> list[pathlib.Path]:
    return [p for p in pages() if blocks(p)]


def reads_example_data(code: str) -> bool:
    return any(ex.path.rstrip("/") in code for ex in EXAMPLES)


def missing_modules(code: str) -> list[str]:
    """The packages a block needs that are not installed: its imports, ``NEEDS``, and the
    library of each example file it reads (``example-data`` skips a file whose library
    is missing)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    names.update(module for marker, module in NEEDS.items() if marker in code)
    names.update(ex.module.split(".")[0] for ex in EXAMPLES if ex.module and re.search(
        rf"[\"']{re.escape(ex.path.rstrip('/'))}(/[^\"']*)?[\"']", code))
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """An empty directory after the pages' ``python -m zephon example-data .``."""
    d = tmp_path_factory.mktemp("docs-data")
    proc = subprocess.run([sys.executable, "-m", "zephon", "example-data", "."], cwd=d,
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    return d


def run_block(code: str, index: int, where: pathlib.Path) -> subprocess.CompletedProcess:
    first = code.splitlines()[0] if code.strip() else ""
    named = NAMED.fullmatch(first.strip())
    name = named.group(1) if named else f"block_{index}.py"
    (where / name).write_text(code, encoding="utf-8")
    argv = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
            if name.startswith("test_") else [sys.executable, name])
    return subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=600,
                          env=clean_env())


@pytest.mark.parametrize("page", pages_with_code(), ids=page_id)
def test_every_python_block_of_the_page_runs_top_to_bottom(page, tmp_path, example_dir):
    shutil.copytree(example_dir, tmp_path, dirs_exist_ok=True)
    skipped, unsaved = [], []  # the files of skipped named blocks: later blocks run them
    for index, code in enumerate(blocks(page)):
        missing = missing_modules(code) + [f"block {name} (skipped)" for name in unsaved
                                           if name in code]
        if missing:
            skipped.append(f"block {index} needs {', '.join(missing)}")
            named = NAMED.fullmatch(code.splitlines()[0].strip()) if code.strip() else None
            if named:
                unsaved.append(named.group(1))
            continue
        proc = run_block(code, index, tmp_path)
        where = f"{page_id(page)} block {index}"
        assert proc.returncode == 0, f"{where} failed:\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), f"{where} prints nothing:\n{code}"
        if '"train.bin"' in code:  # read as what it holds: uint16 ids, as nanoGPT writes them
            assert "uint16" in proc.stdout and "uint32" not in proc.stdout, proc.stdout
    if skipped and len(skipped) == len(blocks(page)):
        pytest.skip("; ".join(skipped) + " (their extras are not installed)")


def test_the_block_rules_can_fail(tmp_path):
    """A failing block fails, a named test block runs under pytest, a missing package skips."""
    assert run_block("raise SystemExit(3)\n", 0, tmp_path).returncode == 3
    test_file = "# test_gate.py\ndef test_it():\n    assert 1 == 2\n"
    proc = run_block(test_file, 1, tmp_path)
    assert proc.returncode == 1 and "1 failed" in proc.stdout
    assert (tmp_path / "test_gate.py").exists()
    assert missing_modules("import zephon_no_such_package as z\nimport os") == \
        ["zephon_no_such_package"]
    assert missing_modules("from os import path\nprint(1)") == []
    images = next(ex for ex in EXAMPLES if ex.path.rstrip("/") == "images")
    reads_images = 'sources.image_folder("images")'
    assert (images.module in missing_modules(reads_images)) == \
        (importlib.util.find_spec(images.module) is None)


def test_every_page_that_reads_example_files_names_the_command_first():
    """A reader who starts on any page learns how to get the files its blocks read."""
    for page in pages():
        text = page.read_text(encoding="utf-8")
        readers = [m for m in BLOCK.finditer(text) if reads_example_data(m.group(1))]
        if readers:
            assert EXAMPLE_DATA in text, f"{page_id(page)} reads example files but never names {EXAMPLE_DATA!r}"
            assert text.index(EXAMPLE_DATA) < readers[0].start(), page_id(page)


def test_every_example_file_is_read_by_some_page():
    code = [c for p in pages() for c in blocks(p)]
    for ex in EXAMPLES:
        assert any(ex.path.rstrip("/") in c for c in code), f"no page reads {ex.path}"


# -- the built site -----------------------------------------------------------------------

def test_every_page_is_in_the_nav():
    """mkdocs --strict says so too; this says which page, without the docs extra."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r"([\w./-]+\.md)\s*$", config, re.M))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason='the site needs the docs extra: python -m pip install -e ".[docs]"')
    pytest.importorskip("mkdocstrings", reason="the site needs the docs extra")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert not warnings, warnings
    return out


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" and value:
                self.ids.add(value)
            elif key == "name" and tag == "a" and value:
                self.ids.add(value)
            elif key in ("href", "src") and value:
                self.links.append(value)


@functools.lru_cache(maxsize=None)
def parsed(path: pathlib.Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


def html_pages(site: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def broken_links(site: pathlib.Path) -> list[str]:
    """Every relative link and anchor in the built site that does not resolve."""
    broken = []
    for page in html_pages(site):
        for link in parsed(page).links:
            url = urllib.parse.urlsplit(link)
            if url.scheme or link.startswith("//"):
                continue  # outside the site: no network is assumed here
            target = page if not url.path else (page.parent / urllib.parse.unquote(url.path))
            target = pathlib.Path(os.path.normpath(target))
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link}")
            elif url.fragment and target.suffix == ".html" and \
                    urllib.parse.unquote(url.fragment) not in parsed(target).ids:
                broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    return broken


def test_the_site_builds_strict_with_no_broken_link(site):
    assert (site / "index.html").exists()
    assert len(html_pages(site)) >= 20
    assert broken_links(site) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#x">b</a><a href="#top">t</a>'
                                     '<a href="https://example.org/">e</a><h1 id="top">a</h1>')
    (tmp_path / "b.html").write_text('<h1 id="y">b</h1>')
    assert broken_links(tmp_path) == ["a.html: b.html#x (no such anchor)"]
    (tmp_path / "b.html").unlink()
    assert broken_links(tmp_path) == ["a.html: b.html#x"]


def test_the_api_reference_documents_the_public_names(site):
    text = {p.name: p.read_text(encoding="utf-8") for p in (site / "reference").glob("*.html")}
    for page, names in {"pipeline.html": ["Pipeline", "Batch"],
                        "sources.html": ["jsonl", "parquet", "webdataset", "mixture", "mds"],
                        "options.html": ["RuntimeOptions", "RunPolicy"],
                        "jobs.html": ["run"], "torch.html": ["loader"],
                        "errors.html": ["ZephonError"]}.items():
        for name in names:
            assert re.search(rf'id="[\w.]*\b{re.escape(name)}"', text[page]), (page, name)


# -- the site in a browser ----------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=3000"]


@pytest.fixture(scope="module")
def served(site):
    """The built site served over HTTP on 127.0.0.1 (stopped after the module)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(site)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):  # up to 30 s on a loaded machine
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if proc.poll() is not None:
                pytest.fail("the HTTP server for the site did not start")
            time.sleep(0.1)
        else:
            pytest.fail("the HTTP server for the site did not listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True,
                          timeout=120)


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def article_text(dom: str) -> str:
    match = re.search(r'<article[^>]*class="[^"]*md-content__inner[^"]*"[^>]*>(.*?)</article>',
                      dom, re.S)
    return re.sub(r"<[^>]+>", " ", match.group(1)) if match else ""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_every_page_renders_in_a_browser(site, served):
    problems = []
    for page in html_pages(site):
        rel = page.relative_to(site).as_posix()
        done = chromium("--dump-dom", f"{served}/{rel}")
        dom = done.stdout
        text = " ".join(article_text(dom).split())
        if done.returncode != 0 or "<h1" not in dom or len(text) < 200:
            problems.append(f"{rel}: not rendered (rc {done.returncode}, {len(text)} chars of text)")
        if rel.startswith("reference/") and rel != "reference/index.html" and \
                rel != "reference/cli.html" and "doc-heading" not in dom:
            problems.append(f"{rel}: no API object rendered")
        problems += [f"{rel}: {line}" for line in console_lines(done.stderr)]
    assert problems == []


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_the_landing_page_and_a_how_to_page_as_screenshots(site, served, tmp_path):
    out = pathlib.Path(os.environ.get("ZEPHON_DOCS_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    for rel, name in (("index.html", "landing.png"), ("how-to/checkpoints.html", "how-to.png")):
        shot = out / name
        done = chromium(f"--screenshot={shot}", "--window-size=1280,1000", f"{served}/{rel}")
        assert done.returncode == 0, done.stderr[-2000:]
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (name, len(data))
