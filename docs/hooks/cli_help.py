"""MkDocs hooks: the command-line reference is the parser's own help, and the docstrings'
Sphinx roles read as code.

A line ``<!-- zephon-help COMMAND -->`` in a page becomes the output of ``python -m
zephon COMMAND --help`` (``<!-- zephon-help -->``: the top-level help), run when the
site is built, so the reference cannot drift from the code. A command that fails to
print its help fails the build.

The docstrings name other objects with Sphinx roles (``:func:`zephon.torch.loader```), which
the API reference renders as code: the role's prefix is dropped from the page, a
``~package.module.Name`` target reads as ``Name`` (Sphinx's meaning of the tilde), and a
paragraph ending in the literal-block marker ``::`` ends in one colon.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|ref):(?=<code>)")
MARKER = re.compile(r"^<!-- zephon-help ?([\w-]*) -->$", re.M)


def _help(command: str) -> str:
    argv = [sys.executable, "-m", "zephon", *([command] if command else []), "--help"]
    env = {**os.environ, "COLUMNS": "88"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} failed: {done.stderr.strip()}")
    return f"```text\n{done.stdout.rstrip()}\n```"


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(lambda m: _help(m.group(1)), markdown)


TILDE = re.compile(r"<code>~(?:[\w]+\.)*(\w+(?:\(\))?)</code>")
LITERAL_MARKER = re.compile(r"::</p>")


def on_page_content(html: str, **_: object) -> str:
    html = ROLE.sub("", html)
    html = TILDE.sub(r"<code>\1</code>", html)
    return LITERAL_MARKER.sub(":</p>", html)
