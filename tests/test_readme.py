"""README.md as a newcomer uses it: the landing page.

- It opens with exactly the two set-up commands (CI runs them), stays a landing page
  (under 200 lines), and every link in it leads to a file of the checkout.
- Its Python blocks run as written with every page's blocks (``tests/test_docs.py``).
- No install line, in the README or the documentation, asks the package index for
  ``zephon`` (a different project of that name is published there): zephon is installed
  from the checkout, ``-e .`` style.
"""

from __future__ import annotations

import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def readme() -> str:
    return README.read_text(encoding="utf-8")


def docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").rglob("*.md")))


def test_readme_opens_with_the_two_setup_commands():
    first = readme().split("```", 2)[1]
    lines = [line for line in first.splitlines()[1:] if line.strip()]
    assert len(lines) == 2
    assert "zephon demo" in lines[0] and "pytest" in lines[1]


def test_readme_is_a_landing_page():
    assert len(readme().splitlines()) < 200
    assert len(re.findall(r"^```python", readme(), re.M)) == 1  # one complete example


def test_every_link_of_the_readme_leads_to_a_file_of_the_checkout():
    links = re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", readme()))
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15, links
    missing = [link for link in local if not (ROOT / link.split("#")[0]).exists()]
    assert missing == []


def install_commands(text: str) -> list[list[str]]:
    """The arguments after ``pip install`` of every command in the README's code: each
    line of a fenced block, each inline span (which may wrap over lines), up to ``&&``,
    ``;`` or ``|``."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
    out = []
    for line in lines:
        for match in re.finditer(r"pip install\b(.*)", line):
            args = []
            for token in shlex.split(match.group(1), comments=True):
                if token in ("&&", ";", "|", "||"):
                    break
                args.append(token)
            out.append(args)
    return out


def zephon_install_problems(args: list[str]) -> list[str]:
    problems = []
    for i, token in enumerate(args):
        if token.startswith("-"):
            continue
        name = re.match(r"[A-Za-z0-9_.-]*", token).group(0)
        if name.lower() == "zephon":
            problems.append(f"{token!r} asks the package index for zephon")
        elif name == "." and (i == 0 or args[i - 1] != "-e"):
            problems.append(f"{token!r} is not an editable install of the checkout")
    return problems


def test_no_install_line_asks_the_index_for_zephon():
    commands = install_commands(readme() + "\n" + docs_text())
    from_checkout = [args for args in commands if any(a.startswith(".") for a in args)]
    assert len(from_checkout) >= 4, commands  # the setup lines and the extras
    problems = [p for args in commands for p in zephon_install_problems(args)]
    assert not problems, problems


def test_the_install_check_catches_an_index_install():
    assert zephon_install_problems(shlex.split('"zephon[torch]"'))
    assert zephon_install_problems(["zephon"])
    assert zephon_install_problems(shlex.split('".[parquet]"'))
    assert not zephon_install_problems(shlex.split('-e ".[parquet]"'))
    assert not zephon_install_problems(["torch==2.13.0"])
    assert install_commands("run `pip install\n  -e \".[bench]\"` first") == [["-e", ".[bench]"]]
